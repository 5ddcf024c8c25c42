"""views/run_views.py: what every monitor shows beside its metrics (the monitors' own output is
compared in tests/test_three_callbacks.py)."""

from __future__ import annotations

import torch

from lnmonitor.core.meter.meter import LadderMeter
from lnmonitor.tiny.model import GPTConfig, TinyGPT
from lnmonitor.views.run_views import RunViews


def _result():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(width=32, depth=2, heads=2, context=16))
    meter = LadderMeter(model, info=lambda _: None)
    x = torch.randint(0, 65, (4, 16))
    with meter.step():
        model(x, x)[1].backward()
    return meter.result()


def test_pictures_are_spaced_the_last_step_gets_one_and_the_end_draws_and_says_once():
    result, said, written = _result(), [], []
    views = RunViews("T", said.append, lambda key, text: None, images=True, image_every_n_steps=10,
                     summary=True)
    write = lambda tag, image, step: written.append((tag, step, image.shape[-1]))  # noqa: E731
    for step in (0, 5, 10, 12):
        views.add(step, result.metrics(positions=step == 0))
        views.step(write, result, step, last=step == 12)
    views.end(write, "TinyGPT, end of training")
    views.end(write, "TinyGPT, end of training")  # once
    ladder, heatmap = "lnmonitor/ladder", "lnmonitor/ladder_over_training"
    assert [(t, s) for t, s, _ in written] == [(ladder, 0), (ladder, 10), (ladder, 12), (heatmap, 12)]
    assert all(channels == 3 for *_, channels in written)
    assert len(said) == 1 and said[0].startswith("lnmonitor summary: TinyGPT, end of training")


def test_a_picture_that_fails_turns_the_pictures_off_with_one_warning_and_nothing_raises():
    result, warned = _result(), []
    views = RunViews("T", lambda _: None, lambda key, text: warned.append((key, text)), images=True,
                     image_every_n_steps=1, summary=False)

    def broken(tag, image, step):
        raise OSError("disk full")

    for step in range(3):
        views.add(step, result.metrics())
        views.step(broken, result, step)
    views.end(broken, "x")
    assert len(warned) == 1 and warned[0][0] == "images" and "disk full" in warned[0][1]
    assert not views.images
