"""Read a run's logged lnmonitor metrics back: the last step's ladder as a table, and 1/sigma
of every norm over training as a PNG.  Works on any run folder with TensorBoard event files
or a CSVLogger's metrics.csv (``lnmonitor summarize`` does this and more).

    python examples/read_back.py runs/examples/own_module/version_0
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lnmonitor.core.output.metric_names import parse, per_norm
from lnmonitor.views.events import read_run
from lnmonitor.views.names import short_names
from lnmonitor.views.plotting import new_figure, save_png


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run folder (event files or metrics.csv)")
    parser.add_argument("--png", type=Path, default=None, help="where to write the figure")
    args = parser.parse_args()
    curves = read_run(args.run)  # lnmonitor's names, also a transformers.Trainer run's (train/...)
    ladder = {metric.name: points for tag, points in curves.items()
              if (metric := parse(tag)) is not None and metric[:2] == ("norm", "inv_sigma")}
    if not ladder:
        raise SystemExit(f"no lnmonitor/inv_sigma/* metrics in {args.run}")
    short = dict(zip(ladder, short_names(list(ladder)), strict=True))  # without their shared prefix
    print(f"{'norm':40s} {'step':>6s} {'1/sigma':>8s} {'rms':>8s} {'share median':>12s}")
    for norm, points in ladder.items():
        step, value = points[-1]
        rms = dict(curves.get(per_norm("rms", norm), [])).get(step, float("nan"))
        share = dict(curves.get(per_norm("share_median", norm), [])).get(step, float("nan"))
        print(f"{short[norm]:40s} {step:6d} {value:8.3f} {rms:8.3f} {share:12.4f}")
    fig = new_figure(7, 4)
    ax = fig.add_subplot()
    for norm, points in ladder.items():
        ax.plot(*zip(*points, strict=True), label=short[norm])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("1/sigma")
    ax.set_yscale("log")
    ax.legend(fontsize=6, ncol=2)
    png = args.png or args.run / "inv_sigma.png"
    save_png(fig, png)
    print(f"figure: {png}")


if __name__ == "__main__":
    main()
