"""What every monitor shows of a run beside its metrics: the ladder's picture on measured steps, and at
the end the ladder over training and the one-screen summary."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from lnmonitor.core.output.metric_names import per_norm, run_metric
from lnmonitor.views.pictures import over_training_picture, step_picture
from lnmonitor.views.summary import RunCurves, summary_text

__all__ = ["RunViews", "WriteImage"]

WriteImage = Callable[[str, object, int], None]  # (tag, HWC uint8 image, step)


class RunViews:
    """The pictures and summary of one run (a monitor keeps one per run, on rank zero).

    ``name`` starts the warnings; ``info(text)`` and ``warn(key, text)`` are the monitor's;
    ``image_every_n_steps`` is the least number of steps between two ladder pictures (the last step gets
    one regardless).  ``write(tag, image, step)`` is the framework's way to log an image (None: none).  A
    picture that fails turns the pictures off with one warning; the metrics go on.
    """

    def __init__(self, name: str, info: Callable[[str], None], warn: Callable[[str, str], None], *,
                 images: bool, image_every_n_steps: int, summary: bool) -> None:
        self.name, self._info, self._warn = name, info, warn
        self.images, self.image_every_n_steps, self.summary = images, image_every_n_steps, summary
        self.curves = RunCurves(series=(per_norm("inv_sigma", ""),))
        self._last_picture = -math.inf
        self._ended = False

    def add(self, step: int, metrics: dict[str, float]) -> None:
        """A dict the monitor logged at ``step``."""
        self.curves.add(step, metrics)

    def step(self, write: WriteImage | None, result, step: int, last: bool = False) -> None:
        """A measured step's ladder picture, when ``image_every_n_steps`` have passed or it is ``last``."""
        due = step - self._last_picture >= self.image_every_n_steps or last
        if write is not None and self.images and due:
            self._last_picture = step
            self._picture(write, run_metric("ladder"), lambda: step_picture(result.figures, step), step)

    def end(self, write: WriteImage | None, title: str, watched: Sequence[str] | None = None,
            start: tuple[int, float] | None = None, settings: Mapping[str, object] | None = None) -> None:
        """Once per run: the ladder over training and the summary (arguments: as :func:`summary_text`)."""
        if self._ended or not self.curves:
            return
        self._ended = True
        curves = self.curves.curves()
        if write is not None and self.images and (heatmap := over_training_picture(curves)) is not None:
            self._picture(write, run_metric("ladder_over_training"), lambda: heatmap[1], heatmap[0])
        if self.summary:
            self._info(summary_text(curves, title, watched, start, settings))

    def _picture(self, write: WriteImage, tag: str, draw: Callable, step: int) -> None:
        try:
            write(tag, draw(), step)
        except Exception as err:  # noqa: BLE001 - a picture must never stop training
            self.images = False
            self._warn("images", f"{self.name}: no more pictures ({err!r}); the metrics go on")
