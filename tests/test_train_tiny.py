import math
import subprocess
import sys

import pytest
import torch

from lnmonitor.commands.cli import main
from lnmonitor.tiny.checkpoint import load_checkpoint
from lnmonitor.tiny.corpus import load_corpus
from lnmonitor.tiny.recipe import Recipe
from lnmonitor.tiny.train import fit


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One short train-tiny run through the command line (eps 1e-4, not the default), shared by the
    tests below."""
    out = tmp_path_factory.mktemp("runs")
    code = main(["train-tiny", "--max-steps", "80", "--val-every", "40", "--eps", "1e-4", "--out", str(out)])
    assert code == 0
    return out


def test_short_run_learns_far_below_the_uniform_guess(trained, capsys):
    checkpoint = trained / "train-tiny" / "version_0" / "checkpoints" / "last.ckpt"
    module = load_checkpoint(checkpoint)[0]
    vocab = len(module.vocab)
    losses = []
    from lnmonitor.tiny.data import CharDataModule

    data = CharDataModule(load_corpus(), vocab=module.vocab)
    with torch.no_grad():
        for x, y in data.val_batches():
            losses.append(module(x, y)[1].item())
    val_loss = sum(losses) / len(losses)
    assert val_loss < math.log(vocab) - 1.0  # 4.63 nats for the default corpus


def test_run_writes_tensorboard_events_and_a_loadable_checkpoint(trained):
    run = trained / "train-tiny" / "version_0"
    assert list(run.glob("events.out.tfevents.*"))
    module = load_checkpoint(run / "checkpoints" / "last.ckpt")[0]
    # the options given, not the defaults (eps 1e-5, 3,000 steps), in the checkpoint and its norms
    assert module.hparams.eps == 1e-4 and module.hparams.max_steps == 80
    norms = [m for m in module.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 9 and {m.eps for m in norms} == {1e-4}
    assert not module.training


def test_checkpoint_round_trip_reproduces_the_logits(tmp_path):
    recipe = Recipe(width=32, heads=2, depth=1, context=16, max_steps=3, val_every=3)
    text = load_corpus()
    result = fit(recipe, text, tmp_path, progress=False)
    assert result.steps == 3
    module = load_checkpoint(result.checkpoint)[0]
    state = torch.load(result.checkpoint, weights_only=True)["state_dict"]
    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    idx = module.vocab.encode("def f(x): return")[None]
    again = load_checkpoint(result.checkpoint)[0]
    assert torch.equal(module(idx)[0], again(idx)[0])


def test_resume_continues_to_max_steps_without_retraining(tmp_path):
    text = load_corpus()
    short = Recipe(width=32, heads=2, depth=1, context=16, max_steps=4, val_every=2)
    fit(short, text, tmp_path, progress=False)
    longer = Recipe(width=32, heads=2, depth=1, context=16, max_steps=4, val_every=2)
    again = fit(longer, text, tmp_path, progress=False)
    assert again.steps == 4  # resumed at step 4: nothing left to do


def run_cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "lnmonitor.commands.cli", *args], cwd=cwd, capture_output=True, text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--eps", "0"], "eps must be a finite number > 0"),
        (["--eps=-1e-5"], "eps must be a finite number > 0"),
        (["--width", "130"], "not divisible by heads"),
        (["--max-steps", "0"], "max-steps must be a positive integer"),
        (["--max-steps=-5"], "max-steps must be a positive integer"),
        (["--data", "missing.txt"], "does not exist"),
        (["--data", "empty.txt"], "is empty"),
        (["--data", "latin1.txt"], "is not UTF-8"),
        (["--data", "short.txt"], "fewer than"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_leaves_out_untouched(tmp_path, args, message):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("café olé ".encode("latin-1") * 300)
    (tmp_path / "short.txt").write_text("tiny")
    result = run_cli("train-tiny", *args, "--out", "out", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "out").exists()



def test_progress_lines_come_every_n_steps_and_at_the_last_with_the_validation_they_show(capsys):
    from conftest import char_data, trainer

    from lnmonitor.tiny.progress import ProgressLines

    data, module = char_data(5)
    trainer(5, [ProgressLines(every_n_steps=2)], validate_every=2).fit(module, datamodule=data)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 2/5", "step 4/5", "step 5/5"]
    assert "train/loss" in lines[0] and "left" in lines[0]
    assert "val/loss" in lines[-1] and "(at step 4)" in lines[-1]


def test_a_fit_whose_output_is_not_a_terminal_prints_lines_not_a_bar(tmp_path, capsys):
    recipe = Recipe(width=32, heads=2, depth=1, context=16, max_steps=3, val_every=2)
    fit(recipe, load_corpus(), tmp_path, progress=True)
    out = capsys.readouterr().out
    assert "step 3/3: train/loss" in out
    assert "Epoch" not in out  # no bar written into a file


def test_the_end_of_fit_message_says_which_validation_is_which_and_where_the_charts_are(tmp_path, capsys):
    from lnmonitor.commands.train_tiny import CUSTOM_SCALARS

    small = ["--width", "32", "--heads", "2", "--depth", "1", "--context", "16", "--no-monitor"]
    assert main(["train-tiny", "--max-steps", "5", "--val-every", "4", *small, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    final = next(line for line in out.splitlines() if line.startswith("final validation loss"))
    assert "at step 5" in final and "the val/loss shown during training is the validation at step 4" in final
    assert f"tensorboard --logdir {tmp_path}, then {CUSTOM_SCALARS}" in out
    assert main(["train-tiny", "--max-steps", "4", "--val-every", "4", *small, "--out", str(tmp_path)]) == 0
    assert "shown during training" not in capsys.readouterr().out  # one validation, one figure
