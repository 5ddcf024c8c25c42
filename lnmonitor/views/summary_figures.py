"""The figures of ``lnmonitor summarize``, from a run's curves; each returns False, writing nothing, when
the run logged too little for it."""

from __future__ import annotations

import io
import math
import textwrap
from collections.abc import Mapping
from pathlib import Path

from lnmonitor.core.output.files import atomic_write_bytes
from lnmonitor.core.output.metric_names import baseline_metric, per_norm
from lnmonitor.views.names import short_names
from lnmonitor.views.pictures import heatmap_picture
from lnmonitor.views.plotting import new_figure, save_png
from lnmonitor.views.summary import Curves, ladder_grid, ladder_of, last

__all__ = ["figure_heatmap", "figure_ladders", "figure_shares"]

LABEL_INCHES = 0.05  # height of one character of a tick label at 7 pt, turned 60 degrees
LEGEND_INCHES = 1.9  # a legend of 7 pt placed beside the axes
TITLE_CHARS = 13  # characters of a 9 pt title per inch


def figure_heatmap(curves: Curves, title: str, path: Path) -> bool:
    """1/sigma of every rung against depth and step."""
    from PIL import Image

    rungs, steps, grid = ladder_grid(curves)
    if not rungs or len(steps) < 2:
        return False
    picture = heatmap_picture(short_names(rungs), steps, grid, f"{title}: 1/sigma of each rung")
    buf = io.BytesIO()
    Image.fromarray(picture).save(buf, format="png")
    atomic_write_bytes(Path(path), buf.getvalue())
    return True


def figure_shares(curves: Curves, title: str, path: Path) -> bool:
    """Each norm's dead-plane share (median, p90, max) at the last logged step, against the random
    direction's median and max."""
    rungs, others = ladder_of(curves)
    names = [n for n in rungs + others if math.isfinite(last(curves, per_norm("share_median", n)))]
    if not names:
        return False
    labels = short_names(names)
    # inches: the rotated tick labels below the axes, the legend beside them
    below = LABEL_INCHES * max(len(label) for label in labels)
    width = max(5.0, 0.45 * len(names) + 2.0) + LEGEND_INCHES
    fig = new_figure(width, 3.2 + below)
    ax = fig.add_subplot()
    x = range(len(names))
    for stat, marker, label in (("share_median", "o", "median"), ("share_p90", "^", "p90"),
                                ("share_max", "v", "max")):
        ax.plot(x, [last(curves, per_norm(stat, n)) for n in names], marker, label=f"{label} share")
    for stat, style in (("median", "--"), ("max", ":")):
        each = [last(curves, baseline_metric(stat, n)) for n in names]
        if all(math.isfinite(v) for v in each):
            ax.plot(x, each, "k" + style, lw=1, label=f"random direction, {stat}")
        elif math.isfinite(shared := last(curves, baseline_metric(stat))):
            ax.axhline(shared, color="k", ls=style, lw=1, label=f"random direction, {stat}")
    ax.set_xticks(list(x), labels, rotation=60, ha="right", rotation_mode="anchor", fontsize=7)
    ax.set_ylabel("dead-plane share |P w| / |w|")
    ax.set_ylim(0, 1)
    heading = f"{title}: dead-plane share at the last logged step"
    ax.set_title(textwrap.fill(heading, int(width * TITLE_CHARS)), fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the markers, not on them
    save_png(fig, path)
    return True


def figure_ladders(runs: Mapping[str, Curves], path: Path) -> bool:
    """Several runs' 1/sigma ladders at their last logged step."""
    fig = new_figure(7.0, 4.2)
    ax = fig.add_subplot()
    drawn = 0
    for name, curves in runs.items():
        rungs, _ = ladder_of(curves)
        values = [last(curves, per_norm("inv_sigma", n)) for n in rungs]
        if len(rungs) > 1 and all(math.isfinite(v) and v > 0 for v in values):
            ax.plot(range(len(rungs)), values, "o-", ms=3, label=name)
            drawn += 1
    if drawn < 2:
        return False
    ax.set_yscale("log")
    ax.set_xlabel("rung (forward order: first norm 0, final norm last)")
    ax.set_ylabel("1/sigma at the last logged step")
    ax.set_title("1/sigma ladders side by side", fontsize=9)
    ax.legend(fontsize=7)
    save_png(fig, path)
    return True
