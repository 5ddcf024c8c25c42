"""``lnmonitor analyze``: tables, the three files, and one-line errors for bad checkpoints."""

import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from lnmonitor.commands.cli import main
from lnmonitor.core.norms.find import find_norms
from lnmonitor.errors import UsageError
from lnmonitor.experiments.analysis import analyze, study_ladder
from lnmonitor.experiments.analysis_report import headline_rows, to_markdown
from lnmonitor.tiny.checkpoint import load_checkpoint
from lnmonitor.tiny.corpus import load_corpus
from lnmonitor.tiny.data import CharDataModule
from lnmonitor.tiny.recipe import Recipe
from lnmonitor.tiny.train import fit

FIGURES = ("spectrum", "shares", "ladder", "sweep")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A freshly trained tiny GPT (40 steps) and its last.ckpt."""
    recipe = Recipe(width=32, depth=2, heads=2, context=16, max_steps=40, val_every=40)
    result = fit(recipe, load_corpus(), tmp_path_factory.mktemp("run"), progress=False)
    return result.checkpoint


@pytest.fixture(scope="module")
def analyzed(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("analysis")
    code = main(["analyze", str(checkpoint), "--batches", "2", "--out", str(out)])
    assert code == 0
    return out


def test_analyze_writes_markdown_json_and_figures(analyzed):
    names = sorted(p.name for p in analyzed.iterdir())
    assert names == sorted(["analysis.md", "analysis.json"] + [f"analysis_{f}.png" for f in FIGURES])
    for fig in FIGURES:
        assert (analyzed / f"analysis_{fig}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (analyzed / "analysis.md").read_text()
    for heading in ("## Headline figures, next to the study", "## Norm Jacobians at one row",
                    "## Block versus branch rank at one position", "## Dead-plane shares",
                    "## The 1/sigma ladder", "## Final-norm invariance", "### Scale sweep"):
        assert heading in md
    assert "![shares](analysis_shares.png)" in md


def md_table(md: str, heading: str) -> list[dict[str, str]]:
    """The rows of the first table after ``heading``, as ``{column: cell}``."""
    lines = md.split(heading + "\n", 1)[1].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    header, _, *rows = ([c.strip() for c in ln.strip("|").split(" | ")] for ln in lines[start:end])
    return [dict(zip(header, row, strict=True)) for row in rows]


def numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?", text)]


def near(printed: float, value: float, decimals: int = 3) -> bool:
    """``printed`` is ``value`` to the digits shown: ``decimals``, or 2 significant figures below 1e-3."""
    if abs(value) < 1e-3:
        return math.isclose(printed, value, rel_tol=0.05)
    return math.isclose(printed, value, abs_tol=0.5 * 10**-decimals)


def test_the_markdown_tables_are_the_meters_figures(analyzed):
    """Every number of the share and ladder tables, the attenuation and growth line and the
    headline table's ladder and share rows is the meter's figure under the name a monitor logs it
    (analysis.json's metrics), row by row, and the ratios are the rungs' own."""
    md = (analyzed / "analysis.md").read_text()
    data = json.loads((analyzed / "analysis.json").read_text())
    m, rungs = data["metrics"], data["ladder"]["rungs"]
    first, last, final = rungs[0], rungs[-1], data["ladder"]["final"]
    shares = md_table(md, "## Dead-plane shares")
    assert [r["norm"] for r in shares] == [n.removeprefix("model.") for n in rungs]
    for row, name in zip(shares, rungs, strict=True):
        for column, stat in (("median", "share_median"), ("p90", "share_p90"), ("max", "share_max")):
            assert near(float(row[column]), m[f"lnmonitor/{stat}/{name}"]), (name, column, row)
        assert near(float(row["random max"]), m["lnmonitor/share_baseline/max"]), row
        assert int(row["rows"]) == data["rows"]
    ladder = md_table(md, "## The 1/sigma ladder")
    assert [r["norm"] for r in ladder] == [n.removeprefix("model.") for n in rungs]
    for row, name in zip(ladder, rungs, strict=True):
        for column, stat in (("rms", "rms"), ("sigma", "sigma"), ("1/sigma", "inv_sigma")):
            assert near(float(row[column]), m[f"lnmonitor/{stat}/{name}"]), (name, column, row)
        assert near(float(row["eps/v"]), m[f"lnmonitor/eps_over_var/{name}"]), (name, row)
    attenuation = m[f"lnmonitor/inv_sigma/{first}"] / m[f"lnmonitor/inv_sigma/{last}"]
    growth = m[f"lnmonitor/rms/{last}"] / m[f"lnmonitor/rms/{first}"]
    assert abs(attenuation - growth) > 0.002  # the two ratios are told apart
    line = next(ln for ln in md.splitlines() if ln.startswith("Attenuation 1/sigma(first)"))
    shown = numbers(line)[-2:]
    assert near(shown[0], attenuation) and near(shown[1], growth), line
    table = md_table(md, "## Headline figures, next to the study")
    headline = {r["quantity"]: r["this model"] for r in table}
    inv = numbers(headline["1/sigma, first -> last rung (ours: median row's sqrt(v + eps); attenuation)"])
    rms = numbers(headline["residual rms, first -> last rung (ours: median row; growth)"])
    assert near(inv[0], m[f"lnmonitor/inv_sigma/{first}"]) and near(inv[1], m[f"lnmonitor/inv_sigma/{last}"])
    assert near(rms[0], m[f"lnmonitor/rms/{first}"], 2) and near(rms[1], m[f"lnmonitor/rms/{last}"], 2)
    assert near(inv[2], attenuation, 1) and near(rms[2], growth, 1)
    medians = [m[f"lnmonitor/share_median/{n}"] for n in rungs]
    low, high, random = numbers(headline["median share, per norm"])
    assert near(low, min(medians)) and near(high, max(medians))
    assert near(random, m["lnmonitor/share_baseline/median"])
    final_max = numbers(headline["final norm max share"])
    assert near(final_max[0], m[f"lnmonitor/share_max/{final}"])
    assert near(final_max[1], m["lnmonitor/share_baseline/max"])


def test_analysis_json_is_strict_and_carries_the_findings(analyzed):
    data = json.loads((analyzed / "analysis.json").read_text(),
                      parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert data["config"]["width"] == 32 and data["step"] == 40
    assert data["rows"] == 2 * 32 * 16
    assert len(data["norms"]) == 5 and len(data["roles"]) == 5 and len(data["ladder"]["rungs"]) == 5
    assert data["ladder"]["final"] == "model.lnf" and data["roles"]["model.lnf"] == "final"
    # the figures under the names a monitor logs them, the ladder's among them
    assert data["metrics"]["lnmonitor/ladder/attenuation"] == data["ladder"]["attenuation"] > 1.0
    assert data["metrics"]["lnmonitor/ladder_position/model.lnf"] == 4.0
    for norm in data["norms"]:
        assert norm["max_abs_error"] <= 1e-13 * norm["max_abs_entry"]
        assert math.isfinite(norm["gain_spread"]) and norm["gain_spread"] >= 1.0
    for block in data["blocks"]:
        assert block["block_rank"] == 32 > block["branch_rank"]
        assert "numpy" in block["rank_rule"]
    assert [data["labels"][name] for name in data["ladder"]["rungs"]] == [
        "embedding", "after block 0 attention", "after block 0 MLP", "after block 1 attention",
        "after block 1 MLP",
    ]
    assert set(data["invariance"]["cases"]) == {"shift_5", "shift_1000", "scale_3", "scale_3_shift_5",
                                                "axis_5"}
    assert data["invariance"]["cases"]["axis_5"]["dloss"] != 0.0  # the control moves the loss
    assert data["headline"][0]["quantity"].startswith("validation loss")


def test_analyze_prints_the_compact_table(checkpoint, tmp_path, capsys):
    code = main(["analyze", str(checkpoint), "--batches", "1", "--out", str(tmp_path), "--no-figures",
                 "--position", "5"])
    assert code == 0
    out = capsys.readouterr().out
    assert "study" in out and "block rank at one position" in out
    assert "block vs branch Jacobian at position 5" in out and "numpy matrix_rank default" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["analysis.json", "analysis.md"]
    assert len(out.splitlines()) < 45
    # the per-norm table is the meter's figures (analysis.json's metrics), row by row
    data = json.loads((tmp_path / "analysis.json").read_text())
    m, rungs = data["metrics"], data["ladder"]["rungs"]
    lines = out.split("\nper norm (", 1)[1].split("\n\n", 1)[0].splitlines()[3:]
    assert [ln.split()[0] for ln in lines] == [n.removeprefix("model.") for n in rungs]
    columns = ("share_median", "share_p90", "share_max", None, None, "rms", "inv_sigma", "eps_over_var")
    for line, name in zip(lines, rungs, strict=True):
        cells = line.split()[2:]
        for cell, stat in zip(cells, columns, strict=False):
            if stat:
                assert near(float(cell), m[f"lnmonitor/{stat}/{name}"], 2 if stat == "rms" else 3), (
                    name, stat, line)
    # the block table: the ranks probed at --position 5
    rows = out.split("block vs branch Jacobian at position 5", 1)[1].splitlines()[3:]
    for row, block in zip(rows, data["blocks"], strict=False):
        assert row.split()[1] == f"{block['block_rank']}/{block['width']}" and data["position"] == 5


def test_analyze_defaults_to_the_checkpoint_folder(checkpoint, tmp_path):
    local = tmp_path / "last.ckpt"
    local.write_bytes(checkpoint.read_bytes())
    assert main(["analyze", str(local), "--batches", "1", "--no-figures"]) == 0
    assert (tmp_path / "analysis.md").is_file() and (tmp_path / "analysis.json").is_file()


def test_headline_rows_and_markdown_from_the_api(checkpoint):
    module, step = load_checkpoint(checkpoint)
    held_out = CharDataModule(load_corpus(), vocab=module.vocab, context=16).val_batches()
    a = analyze(module, held_out, batches=1, step=step, invariance=False)
    assert a.invariance is None and a.step == 40
    quantities = [q for q, _, _ in headline_rows(a)]
    assert "block rank at one position" in quantities and "dloss: shift 5 / scale 3" not in quantities
    assert [r.name for r in a.study] == a.result.figures.rungs and a.study_sequences == 8
    assert "residual rms, first -> last (study's: global rms, 8 sequences)" in quantities
    assert "block singular values, blocks.0 alone" in quantities
    assert "## Final-norm invariance" not in to_markdown(a)
    assert a.val_loss < math.log(len(module.vocab))


def test_the_study_statistics_are_the_global_rms_and_the_median_unbiased_row_std():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
    x = torch.randn(10, 5, 16)
    x[8:] *= 1000.0  # beyond the study's 8 sequences: must not count
    (rung,) = study_ladder(model, x, find_norms(model))
    h = model[0](x[:8]).detach().double().numpy()
    stds = np.sort(h.std(axis=-1, ddof=1).ravel())
    assert rung.rms == pytest.approx(np.sqrt(np.mean(h**2)), rel=1e-12)
    assert rung.std == pytest.approx(stds[(stds.size - 1) // 2], rel=1e-12)  # torch's median: the lower one


# ---------------------------------------------------------------------------
# bad input: exit code 2 and one line
# ---------------------------------------------------------------------------


def bad_checkpoints(checkpoint, tmp_path):
    ckpt = torch.load(checkpoint, weights_only=True)
    raw = checkpoint.read_bytes()
    (tmp_path / "truncated.ckpt").write_bytes(raw[: len(raw) // 2])
    (tmp_path / "noise.ckpt").write_bytes(bytes(range(256)) * 40)
    (tmp_path / "text.ckpt").write_text("not a checkpoint\n")
    (tmp_path / "empty.ckpt").write_bytes(b"")
    torch.save(ckpt["state_dict"], tmp_path / "state_dict.ckpt")
    torch.save([1, 2, 3], tmp_path / "list.ckpt")
    wrong = dict(ckpt, hyper_parameters=dict(ckpt["hyper_parameters"], width=64))
    torch.save(wrong, tmp_path / "wrong_width.ckpt")
    invalid = dict(ckpt, hyper_parameters=dict(ckpt["hyper_parameters"], heads=3))
    torch.save(invalid, tmp_path / "invalid_hparams.ckpt")
    novocab = dict(ckpt, hyper_parameters={k: v for k, v in ckpt["hyper_parameters"].items() if k != "vocab"})
    torch.save(novocab, tmp_path / "no_vocab.ckpt")
    nan = dict(ckpt, state_dict={k: v.clone() for k, v in ckpt["state_dict"].items()})
    nan["state_dict"]["model.lnf.weight"][0] = float("nan")
    torch.save(nan, tmp_path / "diverged.ckpt")
    torch.save({"obj": Recipe()}, tmp_path / "pickled_object.ckpt")  # refused by weights_only
    (tmp_path / "folder.ckpt").mkdir()
    return {
        "missing.ckpt": "does not exist",
        "folder.ckpt": "is not a file",
        "empty.ckpt": "is empty",
        "truncated.ckpt": "is truncated or corrupted",
        "noise.ckpt": "is not a PyTorch checkpoint",
        "text.ckpt": "is not a PyTorch checkpoint",
        "pickled_object.ckpt": "holds a Python object (lnmonitor.tiny.recipe.Recipe) that safe loading",
        "state_dict.ckpt": "not a train-tiny checkpoint",
        "list.ckpt": "not a train-tiny checkpoint",
        "wrong_width.ckpt": "do not match the configuration",
        "invalid_hparams.ckpt": "invalid hyperparameters",
        "no_vocab.ckpt": "no vocabulary",
        "diverged.ckpt": "non-finite weights (model.lnf.weight): the run diverged",
    }


def test_bad_checkpoints_exit_2_with_one_line(checkpoint, tmp_path, capsys):
    for name, message in bad_checkpoints(checkpoint, tmp_path).items():
        code = main(["analyze", str(tmp_path / name), "--no-figures"])
        err = capsys.readouterr().err
        assert code == 2, name
        assert err.startswith("lnmonitor analyze: error: checkpoint ") and message in err, (name, err)
        assert err.count("\n") == 1, (name, err)
    assert not (tmp_path / "analysis.md").exists()


def test_corrupted_checkpoint_from_the_shell_is_one_line_not_a_traceback(checkpoint, tmp_path):
    bad = tmp_path / "last.ckpt"
    bad.write_bytes(checkpoint.read_bytes()[:5000])
    proc = subprocess.run([sys.executable, "-m", "lnmonitor.commands.cli", "analyze", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("lnmonitor")]
    assert lines and "is truncated or corrupted" in lines[0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--position", "16"], "position must be an integer in [-16, 16)"),
        (["--batches", "0"], "--batches must be a positive integer"),
        (["--rtol", "2"], "--rtol must be in (0, 1)"),
    ],
)
def test_bad_options_exit_2(checkpoint, tmp_path, capsys, args, message):
    assert main(["analyze", str(checkpoint), "--out", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err


def test_text_outside_the_vocabulary_exits_2(checkpoint, tmp_path, capsys):
    data = tmp_path / "greek.txt"
    data.write_text("αβγδε " * 400, encoding="utf-8")
    assert main(["analyze", str(checkpoint), "--data", str(data), "--out", str(tmp_path)]) == 2
    assert "not in the model's vocabulary" in capsys.readouterr().err


def test_load_checkpoint_raises_usage_error(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.ckpt")


def test_the_figures_draw_the_meters_rungs_named_as_everything_else_and_every_panel_has_a_y_label(
        checkpoint, monkeypatch):
    from lnmonitor.experiments import analysis_figures

    module, step = load_checkpoint(checkpoint)
    held_out = CharDataModule(load_corpus(), vocab=module.vocab, context=module.config.context).val_batches()
    a = analyze(module, held_out, batches=1)
    figures = {}
    monkeypatch.setattr(analysis_figures, "save_png", lambda fig, path: figures.update({path.name: fig}))
    analysis_figures.write_figures(a, checkpoint.parent)
    ladder = figures["analysis_ladder.png"].axes[0]
    labels = [t.get_text() for t in ladder.get_xticklabels()]
    assert labels == [a.short(r.name) for r in a.rungs]  # as the report's tables name them
    assert labels[0] == "blocks.0.ln1" and labels[-1] == "lnf"  # the LightningModule's model. gone
    # the points are the meter's rungs: rms of the stream and 1/sigma, in forward order
    meter = a.result.figures.by_name()
    rms, inv_sigma = (line.get_ydata() for line in ladder.lines)
    np.testing.assert_array_equal(rms, [meter[n].rms for n in a.result.figures.rungs])
    np.testing.assert_array_equal(inv_sigma, [meter[n].inv_sigma for n in a.result.figures.rungs])
    spectrum = figures["analysis_spectrum.png"].axes[0]
    assert spectrum.get_title().startswith(f"{a.short(a.result.figures.final)}:")  # the final norm's
    for name, fig in figures.items():
        for ax in fig.axes:
            assert ax.get_ylabel(), (name, ax.get_title())
