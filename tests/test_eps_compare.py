"""lnmonitor eps-compare and lnmonitor report: orchestration, resume, shards, statistics, report."""

import contextlib
import io
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lnmonitor.commands.cli import main
from lnmonitor.commands.recipe_arguments import parse_shard
from lnmonitor.core.output import files
from lnmonitor.errors import UsageError
from lnmonitor.experiments.eps import report, store
from lnmonitor.experiments.eps.compare import run_experiment
from lnmonitor.experiments.eps.grid import Experiment, experiment_config, parse_eps, parse_seeds
from lnmonitor.tiny.corpus import load_corpus
from lnmonitor.tiny.recipe import Recipe
from lnmonitor.views.events import read_scalars

TINY = ["--width", "32", "--heads", "2", "--depth", "1", "--context", "16"]
TINY_RECIPE = dict(width=32, heads=2, depth=1, context=16)


def cli(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def snapshot(folder: Path) -> dict:
    """Every file under ``folder`` with its bytes and modification time."""
    return {
        p.relative_to(folder): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*")) if p.is_file()
    }


# ---------------------------------------------------------------------------
# the whole pipeline, once: two eps, one seed, a few dozen steps
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("eps") / "cmp"
    code, stdout, stderr = cli(
        "eps-compare", "--eps", "1e-5", "1e-1", "--seeds", "0", "--max-steps", "30", "--val-every", "10",
        *TINY, "--out", str(out), "--no-progress",
    )
    assert code == 0, stderr
    return out, stdout


def test_end_to_end_writes_results_report_and_figures(compared):
    out, stdout = compared
    assert stdout.count("starting (30 steps)") == 2 and stdout.count(": done, val loss") == 2
    results = json.loads((out / "results.json").read_text())
    assert [(r["eps"], r["seed"], r["steps"]) for r in results["runs"]] == [(1e-5, 0, 30), (0.1, 0, 30)]
    assert results["missing"] == []
    for run in results["runs"]:
        head = run["headline"]
        assert 0 < head["val_loss"] < math.log(len(set(load_corpus())))
        for key in ("dloss_scale_3", "dloss_scale_0.01",
                    "out_residual_scale_3", "final_eps_over_var", "final_transmission",
                    "attenuation", "growth", "final_share_median"):
            assert key in head and head[key] is not None and math.isfinite(head[key]), key
        # a slope where the sweep has three same-signed points in its window, else the reason
        fitted = head["scale_slope"] is not None and math.isfinite(head["scale_slope"])
        assert fitted or run["invariance"]["fit_note"].startswith("no fit:"), run["invariance"]["fit_note"]
        # the meter's result, as a monitor logs it, with its roles (record format /2)
        assert run["format"] == store.RECORD_FORMAT
        assert run["norm_order"] == run["rungs"] and len(run["norm_info"]) == 3
        assert run["final_norm"] == "model.lnf" == run["invariance"]["final_norm"]
        final = {q: run["metrics"][f"lnmonitor/{q}/model.lnf"] for q in ("eps_over_var", "transmission")}
        assert (head["final_eps_over_var"], head["final_transmission"]) == (
            final["eps_over_var"], final["transmission"])
        assert head["attenuation"] == run["metrics"]["lnmonitor/ladder/attenuation"]
        assert head["growth"] == run["metrics"]["lnmonitor/ladder/growth"]
        # every headline figure read from the norm it names (first rung, final norm, all norms)
        per = {q: {n: run["metrics"][f"lnmonitor/{q}/{n}"] for n in run["norm_order"]}
               for q in ("transmission", "share_median")}
        assert head["first_transmission"] == per["transmission"][run["rungs"][0]]
        assert head["max_transmission"] == max(per["transmission"].values())
        assert head["final_share_median"] == per["share_median"]["model.lnf"]
        assert head["mean_share_median"] == pytest.approx(sum(per["share_median"].values()) / 3, rel=1e-12)
        assert len(set(per["transmission"].values())) == 3 and len(set(per["share_median"].values())) == 3
        assert {"shift_5", "shift_1000", "scale_3", "scale_3_shift_5", "axis_5"} <= set(
            run["invariance"]["cases"]
        )
        assert run["train_seconds"] > 0 and run["measure_seconds"] > 0
        assert (out / f"eps={store.eps_label(run['eps'])}" / "seed=0" / "result.json").is_file()
    assert math.isfinite(results["runs"][0]["headline"]["scale_slope"])  # eps 1e-5: a clean power law
    # eps/var at the final norm grows with eps (same seed, same data)
    small, large = (r["headline"]["final_eps_over_var"] for r in results["runs"])
    assert large > small
    text = (out / "report.md").read_text()
    for run in results["runs"]:  # each eps's table holds its own run's figures
        section = text.split(f"## eps = {store.eps_label(run['eps'])}\n", 1)[1].split("\n## ", 1)[0]
        row = f"| validation loss (nats/char) | {run['val_loss']:.4f} | undefined (one seed) | 1 |"
        assert row in section, section
    assert "no difference is resolved at this number of seeds" in text  # one seed: no interval
    assert "## Over training" in text and "| 0.1 | " in text.split("## Over training")[1]
    assert "the runs occupied" in text
    for key, name in report.FIGURES.items():
        if key == "dose_response":  # two eps make no dose-response: the report says so
            assert not (out / name).exists() and "needs finished runs at three or more eps" in text
            continue
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"]({name})" in text


def test_eps_and_seed_sit_in_the_hparams_tab_next_to_the_final_metrics(compared):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    out, _ = compared
    acc = EventAccumulator(str(out / "eps=0.1" / "seed=0"))
    acc.Reload()  # keeps a run's first hparams session, as TensorBoard's HPARAMS tab does
    tags = acc.PluginTagToContent("hparams")
    session = plugin_data_pb2.HParamsPluginData.FromString(tags["_hparams_/session_start_info"])
    hparams = session.session_start_info.hparams
    assert hparams["eps"].number_value == 0.1 and hparams["seed"].number_value == 0
    experiment = plugin_data_pb2.HParamsPluginData.FromString(tags["_hparams_/experiment"]).experiment
    columns = {m.name.tag for m in experiment.metric_infos}
    assert {"final/val_loss", "final/scale_slope", "final/dloss_scale_3", "val/loss"} <= columns
    record = json.loads((out / "eps=0.1" / "seed=0" / "result.json").read_text())
    (final,) = acc.Scalars("final/val_loss")  # the value the HPARAMS tab shows in that column
    assert final.step == 30 and math.isclose(final.value, record["val_loss"], rel_tol=1e-6)
    curve = read_scalars(out / "eps=0.1" / "seed=0")["val/loss"]
    assert [step for step, _ in curve] == [9, 19, 29]


def test_second_invocation_skips_both_runs_and_rewrites_no_run_file(compared):
    out, _ = compared
    runs_before = {k: v for k, v in snapshot(out).items() if str(k).startswith("eps=")}
    code, stdout, stderr = cli(
        "eps-compare", "--eps", "1e-5", "1e-1", "--seeds", "0", "--max-steps", "30", "--val-every", "10",
        *TINY, "--out", str(out), "--no-progress",
    )
    assert code == 0, stderr
    assert stdout.count("skipped, finished before") == 2 and "starting" not in stdout
    runs_after = {k: v for k, v in snapshot(out).items() if str(k).startswith("eps=")}
    assert runs_after == runs_before  # no retraining, no new event file, records untouched


def test_report_command_rebuilds_report_and_figures_without_training(compared):
    out, _ = compared
    drawn = [name for key, name in report.FIGURES.items() if key != "dose_response"]  # two eps
    (out / "report.md").unlink()
    for name in drawn:
        (out / name).unlink()
    code, stdout, stderr = cli("report", str(out))
    assert code == 0, stderr
    assert "2 of 2 runs finished" in stdout
    assert (out / "report.md").is_file()
    assert all((out / name).is_file() for name in drawn)


# ---------------------------------------------------------------------------
# killed halfway: resumed from the checkpoint, not restarted
# ---------------------------------------------------------------------------

KILLER = textwrap.dedent(
    """
    import os, signal, sys
    from lightning.pytorch.callbacks import Callback
    from lnmonitor.experiments.eps.compare import run_experiment
    from lnmonitor.experiments.eps.grid import Experiment
    from lnmonitor.tiny.corpus import load_corpus
    from lnmonitor.tiny.recipe import Recipe

    class Kill(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 25:  # after the checkpoint at step 20
                os.kill(os.getpid(), signal.SIGKILL)

    recipe = Recipe(width=32, heads=2, depth=1, context=16, max_steps=40, val_every=10)
    run_experiment(Experiment(recipe, (1e-5,), (0,)), load_corpus(), sys.argv[1], callbacks=[Kill()],
                   progress=False)
    """
)


def test_a_run_killed_halfway_resumes_from_its_checkpoint(tmp_path):
    out = tmp_path / "cmp"
    killed = subprocess.run([sys.executable, "-c", KILLER, str(out)], capture_output=True, text=True,
                            timeout=300)
    assert killed.returncode == -9, killed.stderr
    folder = out / "eps=1e-05" / "seed=0"
    assert (folder / "checkpoints" / "last.ckpt").is_file()
    assert not (folder / "result.json").exists()  # not finished: no record
    assert json.loads((out / "results.json").read_text())["missing"] == [{"eps": 1e-5, "seed": 0}]

    lines: list[str] = []
    recipe = Recipe(**TINY_RECIPE, max_steps=40, val_every=10)
    results = run_experiment(Experiment(recipe, (1e-5,), (0,)), load_corpus(), out, progress=False,
                             echo=lines.append)
    assert any("resuming from step 20 of 40" in line for line in lines), lines
    assert not any("starting" in line for line in lines)
    (record,) = results["runs"]
    assert record["resumed_from_step"] == 20 and record["steps"] == 40
    # the second attempt's event file starts after the checkpoint, and the merged curve has each
    # validation step once: nothing lost, nothing duplicated
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted(folder.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns)
    acc = EventAccumulator(str(events[1]))
    acc.Reload()
    assert min(e.step for e in acc.Scalars("train/loss")) >= 20
    assert [step for step, _ in read_scalars(folder)["val/loss"]] == [9, 19, 29, 39]


# ---------------------------------------------------------------------------
# shards, force
# ---------------------------------------------------------------------------


def test_shards_split_the_grid_and_the_report_names_what_is_missing(tmp_path):
    out, text = tmp_path / "cmp", load_corpus()
    experiment = Experiment(Recipe(**TINY_RECIPE, max_steps=8, val_every=4), (1e-5, 1e-2), (0,))
    assert experiment.shard(0, 2) == [(1e-5, 0)] and experiment.shard(1, 2) == [(1e-2, 0)]
    first = run_experiment(experiment, text, out, shard=(0, 2), progress=False, echo=lambda s: None)
    assert [r["eps"] for r in first["runs"]] == [1e-5]
    assert first["missing"] == [{"eps": 1e-2, "seed": 0}]
    written = (out / "report.md").read_text()
    assert "**Missing**" in written and "eps=0.01 seed=0" in written
    second = run_experiment(experiment, text, out, shard=(1, 2), progress=False, echo=lambda s: None)
    assert [r["eps"] for r in second["runs"]] == [1e-5, 1e-2] and second["missing"] == []

    before = json.loads((out / "eps=0.01" / "seed=0" / "result.json").read_text())
    lines: list[str] = []
    run_experiment(experiment, text, out, shard=(1, 2), force=True, progress=False, echo=lines.append)
    after = json.loads((out / "eps=0.01" / "seed=0" / "result.json").read_text())
    assert any("starting" in line for line in lines) and after["finished"] >= before["finished"]
    assert after["resumed_from_step"] is None
    assert json.loads((out / "eps=1e-05" / "seed=0" / "result.json").read_text())["seed"] == 0


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_shards_are_disjoint_and_cover_the_grid(count):
    experiment = Experiment(Recipe(**TINY_RECIPE), (1e-5, 1e-3, 1e-1), (0, 1))
    parts = [experiment.shard(i, count) for i in range(count)]
    flat = [p for part in parts for p in part]
    assert sorted(flat) == sorted(experiment.pairs()) and len(flat) == len(set(flat)) == 6


# ---------------------------------------------------------------------------
# bad input: one line, exit 2, nothing written or overwritten
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--eps", "0"], "eps must be a finite number > 0"),
        (["--eps=-1e-5"], "eps must be a finite number > 0"),
        (["--eps", "1e-5", "nan"], "eps must be a finite number > 0"),
        (["--eps", "1e-5", "abc"], "is not a number"),
        (["--eps", "1e-5", "0.00001"], "given twice"),
        (["--eps"], "needs at least one value"),
        (["--seeds"], "needs at least one seed"),
        (["--seeds", "0", "0"], "given twice"),
        (["--seeds", "x"], "is not an integer"),
        (["--shard", "2/2"], "0 <= i < n"),
        (["--shard", "1"], "must look like i/n"),
        (["--max-steps", "0"], "max-steps must be a positive integer"),
        (["--devices", "2"], "one shard per device"),
        (["--data", "missing.txt"], "does not exist"),
        (["--jobs", "0"], "--jobs must be a positive integer"),
        (["--init", "xavier"], "invalid choice: 'xavier'"),
        (["--decay", "none"], "invalid choice: 'none'"),
    ],
)
def test_bad_arguments_are_one_line_exit_2_and_write_nothing(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    code, _, stderr = cli("eps-compare", *args, "--out", "out")
    assert code == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], stderr
    assert not (tmp_path / "out").exists()


def _previous(out: Path, **recipe) -> None:
    """A results.json as an earlier invocation with ``recipe`` would have left it."""
    config = experiment_config(Recipe(**{**TINY_RECIPE, **recipe}), load_corpus())
    out.mkdir(parents=True)
    files.atomic_write_json(out / "results.json", report.merge_results(out, config, [(1e-5, 0)]))


@pytest.mark.parametrize(
    "spoil, message",
    [
        (lambda out: (out / "results.json").write_text('{"format": "lnmonitor.eps-comp'), "corrupt"),
        (lambda out: (out / "results.json").write_text('{"format": "something else"}'), "not an eps-compare"),
        (lambda out: None, "different configuration (recipe.max_steps=30 there, 20 now)"),
        (lambda out: (out / "eps=1e-05" / "seed=0").mkdir(parents=True)
         or (out / "eps=1e-05" / "seed=0" / "result.json").write_text("{oops"), "run record"),
    ],
)
def test_a_corrupt_or_foreign_results_file_is_refused_and_left_alone(tmp_path, spoil, message):
    out = tmp_path / "cmp"
    _previous(out, max_steps=30)
    spoil(out)
    before = snapshot(out)
    max_steps = "20" if "different" in message else "30"
    code, _, stderr = cli("eps-compare", "--eps", "1e-5", "--seeds", "0", "--max-steps", max_steps, *TINY,
                          "--out", str(out))
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and message in stderr, stderr
    assert snapshot(out) == before
    if "different" not in message:
        code, _, stderr = cli("report", str(out))
        assert code == 2 and message in stderr and snapshot(out) == before


def test_a_results_file_from_other_data_is_refused(tmp_path):
    out = tmp_path / "cmp"
    _previous(out, max_steps=30)
    data = tmp_path / "other.txt"
    data.write_text("some other text, long enough for both splits. " * 100)
    code, _, stderr = cli("eps-compare", "--eps", "1e-5", "--seeds", "0", "--max-steps", "30", *TINY,
                          "--data", str(data), "--out", str(out))
    assert code == 2 and "data.sha256" in stderr


def test_parsers_keep_order_and_canonical_values():
    assert parse_eps(["1e-5", "0.1", 3]) == (1e-5, 0.1, 3.0)
    assert parse_seeds(["2", "0"]) == (2, 0)
    assert parse_shard(None) == (0, 1) and parse_shard("2/5") == (2, 5)
    assert store.eps_label(1e-5) == "1e-05" and store.eps_label(0.1) == "0.1"
    with pytest.raises(UsageError):
        parse_seeds(["-1"])


# ---------------------------------------------------------------------------
# statistics and the verdict
# ---------------------------------------------------------------------------


def test_a_grid_grows_over_invocations_and_jobs_run_side_by_side(tmp_path):
    """A second invocation with another eps adds its pairs to the grid asked for before (a
    dose-response beside a comparison); --jobs 2 trains them in two worker processes, with
    the same result as a run alone (one seed, one initialisation, one batch stream)."""
    out = tmp_path / "out"
    args = ["eps-compare", *TINY, "--max-steps", "4", "--val-every", "4", "--no-progress", "--out", str(out)]
    assert cli(*args, "--eps", "1e-5", "--seeds", "0")[0] == 0
    code, stdout, _ = cli(*args, "--eps", "1e-5", "0.1", "1", "--seeds", "0", "--jobs", "2")
    assert code == 0 and "2 runs side by side" in stdout
    results = json.loads((out / "results.json").read_text())
    assert results["grid"]["pairs"] == [[1e-5, 0], [0.1, 0], [1.0, 0]] and results["missing"] == []
    assert set(results["differences"]) == {"0.1", "1.0"}
    alone = tmp_path / "alone"
    assert cli(*args[:-1], str(alone), "--eps", "0.1", "--seeds", "0")[0] == 0
    single = json.loads((alone / "eps=0.1" / "seed=0" / "result.json").read_text())
    side = json.loads((out / "eps=0.1" / "seed=0" / "result.json").read_text())
    assert side["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)
    assert side["threads"] == max(1, single["threads"] // 2)
    assert "val/loss" in side["curves"] and "lnmonitor/transmission/model.lnf" in side["curves"]

    for figure in ("dose_response.png", "transmission_and_rms_over_training.png", "transmission_by_norm.png"):
        assert (out / figure).read_bytes()[:4] == b"\x89PNG", figure
    assert "![Dose-response" in (out / "report.md").read_text()
    # --remeasure measures the finished runs again from their checkpoints, training nothing
    code, stdout, _ = cli(*args, "--eps", "1e-5", "0.1", "1", "--seeds", "0", "--remeasure")
    assert code == 0 and stdout.count("measured again") == 3
    again = json.loads((out / "eps=0.1" / "seed=0" / "result.json").read_text())
    assert again["remeasured"] and again["curves"] == side["curves"] and again["train_seconds"] == side[
        "train_seconds"]
    assert again["val_loss"] == pytest.approx(side["val_loss"], rel=1e-6)
    assert cli(*args, "--eps", "0.1", "--seeds", "0", "--remeasure", "--force")[0] == 2
