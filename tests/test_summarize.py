"""``lnmonitor summarize``: a TensorBoard run, a CSVLogger run, a folder of several runs, and
bad input (one line on stderr, exit code 2, nothing else)."""

from __future__ import annotations

import math
import re
import warnings

import pytest
from conftest import NORMS, char_data, trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from PIL import Image

from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor
from lnmonitor.commands.cli import main
from lnmonitor.views.events import read_scalars


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    """Two runs: ``a`` logged to TensorBoard and CSV at once, ``b`` (eps 0.1) to TensorBoard."""
    root = tmp_path_factory.mktemp("logs")
    for eps, loggers in (
        (1e-5, lambda: [TensorBoardLogger(root, name="a"), CSVLogger(root, name="a_csv")]),
        (1e-1, lambda: [TensorBoardLogger(root, name="b")]),
    ):
        data, module = char_data(5, eps=eps)
        callbacks = [LayerNormMonitor(every_n_steps=2),
                     FinalNormInvarianceMonitor(invariance_every_n_steps=2)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer(5, callbacks, logger=loggers()).fit(module, datamodule=data)
    return root


COLUMNS = ("inv_sigma", "rms", "eps_over_var", "share_median", "share_max")  # the printed ladder's


def _ladder_rows(out: str) -> dict[str, float]:
    """``{norm: 1/sigma}`` from the printed ladder table(s) of the first run."""
    rows = {}
    for line in out.split("\n\n")[0].splitlines():
        parts = line.split()
        if parts and f"model.{parts[0]}" in NORMS:
            rows[f"model.{parts[0]}"] = float(parts[1])
    return rows


def test_summarize_a_tensorboard_run_prints_the_ladder_and_writes_the_figures(logdir, tmp_path, capsys):
    run = logdir / "a" / "version_0"
    assert main(["summarize", str(run), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("lnmonitor summary: version_0")
    logged = read_scalars(run)
    rows = _ladder_rows(out)
    assert list(rows) == NORMS  # forward order
    # every column of the ladder is the last value logged (3 figures; eps/var 2)
    table = {line.split()[0]: line.split()[1:6] for line in out.splitlines()
             if line.split() and f"model.{line.split()[0]}" in NORMS}
    for name in NORMS:
        for cell, stat in zip(table[name.removeprefix("model.")], COLUMNS, strict=True):
            value, rel = logged[f"lnmonitor/{stat}/{name}"][-1][1], 0.05 if stat == "eps_over_var" else 5e-3
            assert math.isclose(float(cell), value, rel_tol=rel), (name, stat)
    line = next(ln for ln in out.splitlines() if "random direction: median share" in ln)
    shown = [float(x) for x in re.findall(r"\d\.\d+", line)]
    assert [math.isclose(a, logged[f"lnmonitor/share_baseline/{q}"][-1][1], rel_tol=5e-3)
            for a, q in zip(shown, ("median", "max"), strict=True)] == [True, True], line
    # the invariance table: one column per case, the last probe's delta-loss and output residual
    lines = out.split("final-norm invariance at step 5")[1].splitlines()
    cases = lines[0].replace(" (control)", "").split()
    assert lines[0].count("(control)") == 1 and "axis_5 (control)" in lines[0]
    for row, stat in ((lines[1], "dloss"), (lines[2], "out_residual")):
        for case, cell in zip(cases, row.split()[-len(cases):], strict=True):
            value = logged[f"lnmonitor/invariance/{case}/{stat}"][-1][1]
            assert math.isclose(float(cell), value, rel_tol=0.05), (case, stat)  # "0" only for 0
    for png in ("version_0_ladder_heatmap.png", "version_0_shares.png"):
        with Image.open(tmp_path / png) as image:
            assert image.width > 300 and image.height > 200, png


def test_summarize_a_csv_run_reads_the_same_numbers(logdir, capsys):
    assert main(["summarize", str(logdir / "a"), "--no-figures"]) == 0
    from_tensorboard = _ladder_rows(capsys.readouterr().out)
    assert main(["summarize", str(logdir / "a_csv"), "--no-figures"]) == 0
    out = capsys.readouterr().out
    from_csv = _ladder_rows(out)
    assert list(from_csv) == NORMS and "final-norm invariance at step 5" in out
    for name in NORMS:
        assert math.isclose(from_csv[name], from_tensorboard[name], rel_tol=5e-3), name


def test_summarize_reads_a_run_whose_tags_an_integration_prefixed(logdir, tmp_path, capsys):
    """A transformers Trainer's TensorBoard puts ``train/`` before every tag: the same run
    summarizes to the same ladder, figures and invariance."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(tmp_path / "trainer") as writer:
        for tag, points in read_scalars(logdir / "a" / "version_0").items():
            for step, value in points:
                writer.add_scalar(f"train/{tag}", value, step)
    assert main(["summarize", str(logdir / "a" / "version_0"), "--no-figures"]) == 0
    plain = capsys.readouterr().out
    assert main(["summarize", str(tmp_path / "trainer"), "--out", str(tmp_path / "figures")]) == 0
    out = capsys.readouterr().out
    assert list(_ladder_rows(out)) == NORMS and _ladder_rows(out) == _ladder_rows(plain)
    assert out.split("wrote ")[0].split("\n", 1)[1].rstrip() == plain.split("\n", 1)[1].rstrip()
    assert (tmp_path / "figures" / "trainer_shares.png").is_file()


def test_summarize_a_folder_of_runs_sets_them_side_by_side(logdir, tmp_path, capsys):
    assert main(["summarize", str(logdir), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    table = out[out.index("3 runs side by side"):].split("\n\n")[0].splitlines()[2:]
    names = [line.split()[0] for line in table]
    assert names == ["a/version_0", "a_csv/version_0", "b/version_0"]
    eps_over_var = {line.split()[0]: float(line.split()[5]) for line in table}
    assert eps_over_var["b/version_0"] > 1e3 * eps_over_var["a/version_0"]  # eps 0.1 against 1e-5
    assert (tmp_path / "ladders.png").is_file() and (tmp_path / "b_version_0_shares.png").is_file()


@pytest.mark.parametrize("case", ["missing", "empty", "no event files", "corrupt", "a file", "not ours"])
def test_summarize_bad_input_is_one_line_and_exit_code_2(case, logdir, tmp_path, capsys):
    folder = tmp_path / "logs"
    if case != "missing":
        folder.mkdir()
    if case == "no event files":
        (folder / "notes.txt").write_text("hello")
    if case == "corrupt":  # a good run next to a file of garbage named like an event file
        good = logdir / "a" / "version_0"
        for f in good.iterdir():
            (folder / "good").mkdir(exist_ok=True)
            (folder / "good" / f.name).write_bytes(f.read_bytes())
        (folder / "bad").mkdir()
        (folder / "bad" / "events.out.tfevents.0.host.0.0").write_bytes(b"\x17" * 300)
    if case == "a file":
        folder = folder / "notes.txt"
        folder.write_text("hello")
    if case == "not ours":  # a run without lnmonitor
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(folder) as writer:
            writer.add_scalar("loss", 1.0, 0)
    assert main(["summarize", str(folder), "--no-figures"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("lnmonitor summarize: error: ")
    expected = {"missing": "does not exist", "empty": "is empty", "a file": "is a file",
                "no event files": "no TensorBoard event file", "corrupt": "fails its crc32 check",
                "not ours": "no lnmonitor metric"}
    assert expected[case] in captured.err


def test_a_llama_run_reads_by_its_names_in_the_table_and_the_share_plot(tmp_path, capsys, monkeypatch):
    """A transformers Llama held as ``self.model`` (names like
    model.model.layers.0.post_attention_layernorm): every name whole in the table, and the
    share plot sized to its labels, legend and title."""
    import sys
    from pathlib import Path

    import lightning as L

    from lnmonitor.views import summary_figures

    examples = str(Path(__file__).resolve().parents[1] / "examples")
    sys.path.insert(0, examples)
    try:
        from transformers_causal_lm import build
    finally:
        sys.path.remove(examples)
    module, train, _ = build("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.Trainer(max_steps=2, logger=TensorBoardLogger(tmp_path, name="llama"), enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                  callbacks=[LayerNormMonitor(every_n_steps=1)]).fit(module, train)
    figures = []
    monkeypatch.setattr(summary_figures, "save_png", lambda fig, path: figures.append((fig, path.name)))
    assert main(["summarize", str(tmp_path / "llama"), "--out", str(tmp_path / "png")]) == 0
    out = capsys.readouterr().out
    norms = sorted({tag.split("/", 2)[2] for tag in read_scalars(tmp_path / "llama" / "version_0")
                    if tag.startswith("lnmonitor/inv_sigma/")})
    assert "model.model.layers.0.post_attention_layernorm" in norms and "model.model.norm" in norms
    assert "names without 'model.model.'" in out
    rows = {line.split()[0] for line in out.splitlines() if line.startswith("  ") and len(line.split()) > 5}
    assert {n.removeprefix("model.model.") for n in norms} <= rows

    fig = next(fig for fig, name in figures if name.endswith("_shares.png"))
    fig.tight_layout()  # as save_png does
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    page, box = fig.bbox, ax.get_window_extent(renderer)
    legend = ax.get_legend().get_window_extent(renderer)
    assert legend.x0 >= box.x1  # beside the axes, not over the markers
    texts = [ax.title, *ax.get_xticklabels(), ax.get_legend()]
    for text in texts:
        extent = text.get_window_extent(renderer)
        assert page.x0 <= extent.x0 and extent.x1 <= page.x1 and page.y0 <= extent.y0 and extent.y1 <= page.y1
    assert box.height >= 0.5 * page.height  # the plot is not squeezed by its labels
