"""The README's code runs as written: its Python snippets -- the three integrations and the
arguments -- executed from the README's own text (only the lengths of the runs are
shortened), and the shell commands of the README and docs/ name options that exist."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
from conftest import char_data, events

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))


def python_block(marker: str) -> str:
    """The README's one Python snippet that contains ``marker``."""
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", README, flags=re.S) if marker in b]
    return block


def test_the_quick_trainer_snippet_fits_and_logs_both_monitors(tmp_path, monkeypatch):
    snippet = python_block("L.Trainer(")
    assert "max_steps=3000" in snippet
    data, model = char_data(3)
    monkeypatch.chdir(tmp_path)
    exec(snippet.replace("max_steps=3000", "max_steps=3, limit_val_batches=1, enable_progress_bar=False"),
         {"model": model, "data": data})
    tags = set(events(tmp_path / "runs" / "my-model" / "version_0").Tags()["scalars"])
    assert "lnmonitor/inv_sigma/model.lnf" in tags
    assert "lnmonitor/invariance/axis_5/dloss" in tags


def test_the_arguments_snippet_runs_on_the_llama_it_names(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from transformers_causal_lm import build
    finally:
        sys.path.remove(str(ROOT / "examples"))
    import lightning as L

    module, train, val = build("llama")
    x, y = next(iter(val))
    scope = {"x": x, "y": y}
    exec(python_block("monitors = ["), scope)
    ln, inv = scope["monitors"]
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        limit_val_batches=1, callbacks=[ln, inv], enable_model_summary=False)
    trainer.fit(module, train, val)
    first, last = ln.history[0], ln.history[-1]
    assert first["lnmonitor/ladder_position/model.model.layers.0.input_layernorm"] == 0
    assert first["lnmonitor/ladder_position/model.model.layers.3.input_layernorm"] == 3
    assert not any("post_attention_layernorm" in key for h in ln.history for key in h)  # excluded
    assert "lnmonitor/ladder/attenuation" in last
    assert inv.off_reason is None
    assert abs(inv.history[-1]["lnmonitor/invariance/axis_5/dloss"]) > 0  # the loss_fn was used


def shell_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README + DOCS, flags=re.S)
    lines = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    parts = [part.strip() for line in lines for part in line.split("&&")]
    return [part for part in parts if part.startswith("lnmonitor ")]


@pytest.mark.parametrize("command", shell_commands())
def test_every_lnmonitor_command_in_the_readme_parses(command):
    """Its subcommand and options exist and take the values given (nothing is run)."""
    from lnmonitor.commands.cli import build_parser

    args = build_parser().parse_args(shlex.split(command)[1:])
    assert callable(args.func)


def test_the_readme_shows_every_subcommand():
    assert {c.split()[1] for c in shell_commands()} >= {"train-tiny", "eps-compare", "report", "analyze",
                                                        "summarize"}


def bash_lines() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    return [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]


def test_the_quick_start_installs_what_running_needs_and_ci_runs_the_readme_test_command():
    """The main job's install carries no test tooling; the test command installs `.[dev]`, and
    `.ci/run` ends with exactly that README line."""
    lines = bash_lines()
    first_run = next(line for line in lines if "lnmonitor train-tiny" in line)
    assert first_run.split("&&")[0].strip() == "pip install -e ."
    ci_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert "[dev]" in ci_command and "pytest" in ci_command
    assert ci_command in lines


def test_the_readme_gives_pytorchs_cpu_wheel_index_before_the_first_install():
    lines = bash_lines()
    torch_line = next(line for line in lines if line.startswith("pip install torch"))
    assert shlex.split(torch_line)[-2:] == ["--index-url", "https://download.pytorch.org/whl/cpu"]
    assert lines.index(torch_line) < next(i for i, line in enumerate(lines) if "lnmonitor train-tiny" in line)


def test_every_image_under_docs_img_is_shown_or_made_by_the_docs():
    """No stale picture: each file is referenced by the README or docs/*.md, or written by
    docs/screenshots.py (which makes them)."""
    docs = ROOT / "docs"
    shown = README + DOCS
    made = (docs / "screenshots.py").read_text()
    unused = [p.name for p in sorted((docs / "img").iterdir())
              if f"img/{p.name}" not in shown and f'"{p.name}"' not in made]
    assert not unused


def test_the_trainer_callback_snippet_trains_and_reports(tmp_path, monkeypatch):
    """As a fine-tune script has it: lines of different lengths, a tokenizer (built here), the LM
    collator padding each batch to its longest line, the Trainer's default eval batch size."""
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from transformers_trainer import char_tokenizer
    finally:
        sys.path.remove(str(ROOT / "examples"))

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    lines = [("abcdefgh" * 4)[: 5 + (7 * i) % 24] for i in range(24)]
    tok = char_tokenizer("".join(lines))
    config = transformers.GPT2Config(vocab_size=len(tok), n_positions=32, n_embd=16, n_layer=2, n_head=2,
                                     pad_token_id=tok.pad_token_id)
    scope = {"model": transformers.GPT2LMHeadModel(config), "tok": tok,
             "train": [tok(line) for line in lines[:16]], "val": [tok(line) for line in lines[16:]]}
    snippet = python_block("LNMonitorCallback")
    assert 'TrainingArguments("out", max_steps=3000, logging_steps=50,' in snippet
    short = (f'"{tmp_path / "out"}", max_steps=2, logging_steps=1, per_device_train_batch_size=4, '
             'use_cpu=True, save_strategy="no", disable_tqdm=True,')
    exec(snippet.replace('"out", max_steps=3000, logging_steps=50,', short), scope)
    tags = set(events(tmp_path / "tb").Tags()["scalars"])
    assert "train/lnmonitor/ladder/attenuation" in tags and "train/lnmonitor/invariance/axis_5/dloss" in tags


def test_the_loop_monitor_snippet_runs_as_written(tmp_path, monkeypatch):
    import torch
    from torch.utils.tensorboard import SummaryWriter

    from lnmonitor.tiny.model import GPTConfig, TinyGPT

    monkeypatch.chdir(tmp_path)
    model = TinyGPT(GPTConfig(vocab_size=16, width=16, depth=2, heads=2, context=8))

    def micro_batches():
        for _ in range(2):
            x = torch.randint(0, 16, (4, 8))
            yield x, x

    def get_batch(split):  # nanoGPT's names: the snippet may be in its shape
        x = torch.randint(0, 16, (4, 8))
        return x, x

    scope = {"model": model, "SummaryWriter": SummaryWriter, "max_steps": 3, "micro_batches": micro_batches,
             "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "max_iters": 3, "get_batch": get_batch,
             "gradient_accumulation_steps": 2}
    block = python_block("LoopMonitor")
    exec(block, scope)
    tags = set(events(tmp_path / "runs" / "my-loop").Tags()["scalars"])
    assert "lnmonitor/ladder/attenuation" in tags and "lnmonitor/sigma/lnf" in tags
    if "probe_batch" in block:  # the invariance probe, with its sweep at the end
        assert {"lnmonitor/invariance/axis_5/dloss", "lnmonitor/invariance/scale_rounding_points"} <= tags
