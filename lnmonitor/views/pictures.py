"""Pictures of the ladder, as ``(H, W, 3)`` uint8 arrays for loggers that take images: :func:`ladder_picture`
(one step, drawn with Pillow in a few milliseconds) and :func:`heatmap_picture` (a whole fit, matplotlib)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from lnmonitor.views.names import short_name, short_names
from lnmonitor.views.summary import ladder_grid

__all__ = ["heatmap_picture", "ladder_picture", "over_training_picture", "step_picture"]

_BLUE, _ORANGE, _RED = (31, 119, 180), (255, 127, 14), (200, 30, 30)
_GREY, _INK = (200, 200, 200), (40, 40, 40)


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # pragma: no cover - Pillow < 10.1
        return ImageFont.load_default()


def _ticks(lo: float, hi: float) -> list[float]:
    """Ticks for a log axis over [lo, hi]: 1-2-5 per decade, or evenly spaced round values when that
    gives fewer than three."""
    ticks = [m * 10.0**d for d in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
             for m in (1, 2, 5) if lo <= m * 10.0**d <= hi]
    if len(ticks) >= 3:
        return ticks
    raw = (hi - lo) / 6
    unit = 10.0 ** math.floor(math.log10(raw))
    step = next(m * unit for m in (1, 2, 2.5, 5, 10) if m * unit >= raw)
    return [k * step for k in range(math.ceil(lo / step), math.floor(hi / step) + 1) if k > 0]


def _labels(names: Sequence[str], most: int = 12, longest: int = 14) -> list[str]:
    """Axis labels for the rungs: the names without their common dotted prefix (a long one keeps its layer
    numbers and its last part, cut to ``longest``); past ``most``, only every k-th and the last."""
    parts = [n.split(".") for n in names]
    common = 0
    while len(names) > 1 and all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1

    def shorten(rest: list[str]) -> str:
        label = ".".join(rest)
        if len(label) > longest:
            label = ".".join([p for p in rest[:-1] if p.isdigit()] + [rest[-1]])
        return label if len(label) <= longest else label[: longest - 1] + "~"

    short = [shorten(p[common:]) for p in parts]
    every = math.ceil(len(names) / most)
    return [s if i % every == 0 or i == len(names) - 1 else "" for i, s in enumerate(short)]


def ladder_picture(names: Sequence[str], inv_sigma: Sequence[float], rms: Sequence[float],
                   final: str | None = None, title: str = "") -> np.ndarray:
    """1/sigma (blue dots) and rms (orange squares) of each rung, in forward order, on a log scale; the
    final norm marked in red.  Non-finite values are left out."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (480, 320), "white")
    draw = ImageDraw.Draw(img)
    font, small = _font(15), _font(13)
    left, right, top, bottom = 60, 480 - 14, 46, 320 - 84
    values = [v for v in (*inv_sigma, *rms) if v is not None and math.isfinite(v) and v > 0]
    if not names or not values:
        draw.text((left, top), "no rung measured yet", fill=_INK, font=font)
        return np.asarray(img)
    lo, hi = min(values) / 1.25, max(values) * 1.25
    span = math.log(hi) - math.log(lo)

    def y(v: float) -> float:
        return bottom - (math.log(v) - math.log(lo)) / span * (bottom - top)

    def x(i: int) -> float:
        return left + (i + 0.5) * (right - left) / len(names)

    for t in _ticks(lo, hi):
        draw.line([(left, y(t)), (right, y(t))], fill=_GREY)
        draw.text((left - 5, y(t)), f"{t:g}", fill=_INK, font=small, anchor="rm")
    draw.rectangle([left, top, right, bottom], outline=_INK)
    for i, (name, label) in enumerate(zip(names, _labels(names), strict=True)):
        if name == final:
            draw.line([(x(i), top), (x(i), bottom)], fill=_RED, width=1)
            draw.text((min(x(i), right), top - 3), "final", fill=_RED, font=small, anchor="rb")
        if label:
            color = _RED if name == final else _INK
            box = Image.new("RGBA", (int(draw.textlength(label, font=small)) + 4, 16), (255, 255, 255, 0))
            ImageDraw.Draw(box).text((2, 0), label, fill=color, font=small)
            turned = box.rotate(45, expand=True)
            img.paste(turned, (int(x(i)) - turned.width + 8, bottom + 4), turned)
    for series, color, marker in ((inv_sigma, _BLUE, "o"), (rms, _ORANGE, "s")):
        points = [(x(i), y(v)) for i, v in enumerate(series) if v is not None and math.isfinite(v) and v > 0]
        if len(points) > 1:
            draw.line(points, fill=color, width=2)
        for px, py in points:
            box = [px - 4, py - 4, px + 4, py + 4]
            (draw.ellipse if marker == "o" else draw.rectangle)(box, fill=color)
    draw.text((left, 10), title, fill=_INK, font=font)
    for k, (label, color) in enumerate((("1/sigma", _BLUE), ("rms of the stream", _ORANGE))):
        at = left + 8 + 90 * k
        draw.rectangle([at, 30, at + 9, 39], fill=color)
        draw.text((at + 13, 28), label, fill=_INK, font=small)
    return np.asarray(img)


def heatmap_picture(names: Sequence[str], steps: Sequence[int], values: np.ndarray,
                    title: str = "") -> np.ndarray:
    """``values`` (rungs x steps) as a log-scaled heatmap, rungs in forward order top down."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 0.28 * len(names) + 1.8), dpi=90)
    canvas = FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    grid = np.ma.masked_invalid(np.where(values > 0, values, np.nan))
    at = np.asarray(steps, dtype=float)
    middles = (at[1:] + at[:-1]) / 2 if len(at) > 1 else np.empty(0)
    ends = (at[0], at[-1]) if len(at) > 1 else (at[0] - 0.5, at[0] + 0.5)
    edges = np.concatenate(([ends[0]], middles, [ends[1]]))  # each step's cell, cut at the ends
    image = ax.pcolormesh(edges, np.arange(len(names) + 1) - 0.5, grid, cmap="viridis", norm=LogNorm())
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_xlabel("optimizer step")
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, label="1/sigma")
    fig.tight_layout()
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def step_picture(figures, step: int) -> np.ndarray:
    """The ladder of one measured step (its :class:`~lnmonitor.core.meter.meter.LadderFigures`), titled
    with the step and the attenuation."""
    rungs, by_name = figures.rungs, figures.by_name()
    title = f"step {step}" + (f": attenuation {figures.attenuation:.2f}x"
                              if math.isfinite(figures.attenuation) else "")
    final = short_name(figures.final, rungs) if figures.final else None
    return ladder_picture(short_names(rungs), [by_name[n].inv_sigma for n in rungs],
                          [by_name[n].rms for n in rungs], final, title)


def over_training_picture(curves) -> tuple[int, np.ndarray] | None:
    """``(last step, heatmap)`` of 1/sigma of every rung of ``curves``; None with fewer than two steps."""
    rungs, steps, grid = ladder_grid(curves)
    if len(steps) < 2:
        return None
    return steps[-1], heatmap_picture(short_names(rungs), steps, grid,
                                      "1/sigma of each rung over training (forward order, top down)")
