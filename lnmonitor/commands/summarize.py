"""``lnmonitor summarize LOGDIR``: what lnmonitor logged in any run, as text and PNGs."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from lnmonitor.core.output.metric_names import parse
from lnmonitor.errors import UsageError

__all__ = ["register", "run"]


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "summarize", help="summarize what lnmonitor logged in a run or a folder of runs",
        description="Read every run under LOGDIR (TensorBoard event files or a CSVLogger's "
        "metrics.csv), print the 1/sigma ladder, the dead-plane shares against the random "
        "baseline and the final-norm invariance residuals at the last logged step, how the "
        "ladder moved, the runs side by side when there are several, and write the ladder "
        "heatmap and the share plot of each run as PNG.",
    )
    parser.add_argument("logdir", type=Path, help="a run's folder or a folder of runs (e.g. lightning_logs)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for the PNGs (default: LOGDIR/lnmonitor-summary)")
    parser.add_argument("--no-figures", action="store_true", help="print only; write no PNG")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lnmonitor.views.events import event_file_problem, event_files, find_runs, read_run
    from lnmonitor.views.summary import comparison_lines, summary_text

    logdir: Path = args.logdir
    if not logdir.exists():
        raise UsageError(f"{logdir} does not exist")
    if not logdir.is_dir():
        raise UsageError(f"{logdir} is a file: pass the folder that holds the run's event files")
    if not any(logdir.iterdir()):
        raise UsageError(f"{logdir} is empty: pass a folder a Trainer logged to (e.g. lightning_logs)")
    folders = find_runs(logdir)
    if not folders:
        raise UsageError(f"no TensorBoard event file (events.out.tfevents.*) or CSVLogger metrics.csv "
                         f"under {logdir}")
    for folder in folders:
        for path in event_files(folder):
            problem = event_file_problem(path)
            if problem is not None:
                raise UsageError(f"{path} is not a readable event file ({problem}): move it out of "
                                 f"{logdir} and run summarize again")
    runs = {_run_name(logdir, folder): read_run(folder) for folder in folders}
    measured = {name: c for name, c in runs.items() if any(parse(t) for t in c)}
    if not measured:
        raise UsageError(f"no lnmonitor metric in the {len(runs)} run(s) under {logdir}: was a "
                         "LayerNormMonitor or FinalNormInvarianceMonitor among the Trainer's callbacks?")
    for name, curves in runs.items():
        print(summary_text(curves, name) if name in measured else f"{name}: no lnmonitor metric logged")
        print()
    if len(measured) > 1:
        print(f"{len(measured)} runs side by side (last logged step):")
        print("\n".join(comparison_lines(measured)))
    if not args.no_figures:
        written = _figures(measured, args.out if args.out is not None else logdir / "lnmonitor-summary")
        if written:
            print("\nwrote " + ", ".join(str(p) for p in written))
    return 0


def _run_name(logdir: Path, folder: Path) -> str:
    relative = folder.relative_to(logdir).as_posix()
    return logdir.resolve().name if relative == "." else relative


def _figures(runs: dict, out: Path) -> list[Path]:
    from lnmonitor.views.summary_figures import figure_heatmap, figure_ladders, figure_shares

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, curves in runs.items():
        slug = re.sub(r"[^A-Za-z0-9_.=-]+", "_", name)
        for kind, draw in (("ladder_heatmap", figure_heatmap), ("shares", figure_shares)):
            path = out / f"{slug}_{kind}.png"
            if draw(curves, name, path):
                written.append(path)
    if len(runs) > 1 and figure_ladders(runs, out / "ladders.png"):
        written.append(out / "ladders.png")
    return written
