"""Make the README's pictures of the views: TensorBoard in headless Chromium on two short
train-tiny runs (eps 1e-5 and 1e-1), and ``lnmonitor summarize`` on them.

    python docs/screenshots.py [--steps 400] [--work /tmp/lnmonitor-shots]

Writes into docs/img/: ``tensorboard_custom_scalars.png``, ``tensorboard_images.png``,
``tensorboard_hparams.png``, ``ladder_picture.png`` (the picture the monitor logs),
``summarize_heatmap.png``, ``summarize_shares.png``, ``summarize_ladders.png`` and
``summarize.txt`` (what the command printed).  Needs chromium, chromedriver and selenium
(see tools/board.py); takes about two minutes on two cores.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import board  # noqa: E402

IMG = ROOT / "docs" / "img"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps per run")
    parser.add_argument("--work", type=Path, default=Path("/tmp/lnmonitor-shots"), help="scratch folder")
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    for eps in ("1e-5", "1e-1"):
        subprocess.run(
            [sys.executable, "-m", "lnmonitor.commands.cli", "train-tiny", "--max-steps", str(args.steps),
             "--val-every", str(args.steps // 4), "--eps", eps, "--out", str(args.work / f"eps={eps}")],
            check=True, cwd=ROOT,
        )
    IMG.mkdir(parents=True, exist_ok=True)
    with board.browser(1400, 1000) as driver, board.serve(args.work) as url:
        board.open_dashboard(driver, url, "custom_scalars", ["lnmonitor: 1/sigma ladder"])
        driver.save_screenshot(str(IMG / "tensorboard_custom_scalars.png"))
        board.open_dashboard(driver, url, "images", ["lnmonitor/ladder"], images=4)
        driver.save_screenshot(str(IMG / "tensorboard_images.png"))
        board.open_dashboard(driver, url, "hparams", ["lnmonitor/ladder/attenuation"])
        driver.save_screenshot(str(IMG / "tensorboard_hparams.png"))
    _save_ladder_picture(args.work / "eps=1e-5")

    from lnmonitor.commands.cli import main as cli

    out = args.work / "summary"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        cli(["summarize", str(args.work), "--out", str(out)])
    (IMG / "summarize.txt").write_text(printed.getvalue())
    for name, target in (("eps=1e-5_train-tiny_version_0_ladder_heatmap.png", "summarize_heatmap.png"),
                         ("eps=1e-5_train-tiny_version_0_shares.png", "summarize_shares.png"),
                         ("ladders.png", "summarize_ladders.png")):
        shutil.copyfile(out / name, IMG / target)
    print(f"wrote the pictures to {IMG}")
    return 0


def _save_ladder_picture(run: Path) -> None:
    """The last ``lnmonitor/ladder`` picture of a run, as it was logged."""
    from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator

    folder = next(p.parent for p in run.rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(folder), size_guidance={IMAGES: 0})
    acc.Reload()
    (IMG / "ladder_picture.png").write_bytes(acc.Images("lnmonitor/ladder")[-1].encoded_image_string)


if __name__ == "__main__":
    sys.exit(main())
