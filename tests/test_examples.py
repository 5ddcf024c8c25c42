"""The examples/ scripts run as written (a few steps, tiny configs, random weights) and log
both monitors' metrics."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import events, free_port

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def logged(folder: Path) -> set[str]:
    return set(events(folder).Tags()["scalars"])


@pytest.mark.parametrize("script, name", [
    (["own_module.py"], "own_module"),
    (["transformers_causal_lm.py", "--family", "gpt2"], "transformers-gpt2"),
    (["transformers_causal_lm.py", "--family", "llama"], "transformers-llama"),
    (["transformers_causal_lm.py", "--family", "gemma"], "transformers-gemma"),
    pytest.param(["ddp_cpu.py"], "ddp_cpu", marks=pytest.mark.slow),
])
def test_example_runs_and_logs_both_monitors(tmp_path, script, name):
    run(str(EXAMPLES / script[0]), *script[1:], "--steps", "3", "--out", str(tmp_path), cwd=tmp_path)
    tags = logged(tmp_path / name / "version_0")
    assert any(t.startswith("lnmonitor/share_median/") for t in tags)
    assert "lnmonitor/ladder/attenuation" in tags
    assert "lnmonitor/invariance/axis_5/dloss" in tags  # the invariance monitor ran at its defaults


def test_read_back_prints_the_ladder_and_writes_a_figure(tmp_path):
    run(str(EXAMPLES / "own_module.py"), "--steps", "3", "--out", str(tmp_path), cwd=tmp_path)
    out = run(str(EXAMPLES / "read_back.py"), str(tmp_path / "own_module" / "version_0"), cwd=tmp_path).stdout
    assert "1/sigma" in out and "blocks.0.norm1" in out
    assert (tmp_path / "own_module" / "version_0" / "inv_sigma.png").read_bytes()[:4] == b"\x89PNG"


def test_the_sbatch_script_needs_no_folder_and_writes_a_fresh_one(tmp_path):
    """No SLURM here: the script runs as one array task would, with a stand-in `lnmonitor`
    that records its arguments. SLURM opens the log before the script runs (a missing folder
    fails the job silently), so the log must need no folder; the output must be a folder
    of this submission, not a committed one."""
    script = EXAMPLES / "eps_grid.sbatch"
    text = script.read_text()
    log = next(line.split("=", 1)[1] for line in text.splitlines() if line.startswith("#SBATCH --output="))
    assert Path(log).parent == Path(".")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "lnmonitor").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGS"\n')
    (bin_dir / "lnmonitor").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "ARGS": str(tmp_path / "args"),
           "SLURM_ARRAY_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "8"}
    env.pop("OUT", None)
    assert subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, timeout=60).returncode == 0
    args = (tmp_path / "args").read_text().splitlines()
    assert args[args.index("--shard") + 1] == "3/8"
    out = Path(args[args.index("--out") + 1])
    assert "4242" in out.name and not (EXAMPLES.parent / out).exists()  # this submission's own folder


@pytest.mark.parametrize("script, folder, tag", [
    (["plain_loop.py"], "plain_loop", "lnmonitor/ladder/attenuation"),
    (["transformers_trainer.py", "--family", "llama"], "trainer-llama", "train/lnmonitor/ladder/attenuation"),
])
def test_the_other_integrations_examples_run_and_log_the_ladder(tmp_path, script, folder, tag):
    """The plain loop (nanoGPT's shape, gradient accumulation) and the transformers.Trainer
    callback: the ladder reaches TensorBoard, and the Trainer's invariance probe too."""
    run(str(EXAMPLES / script[0]), *script[1:], "--steps", "3", "--out", str(tmp_path), cwd=tmp_path)
    tags = logged(tmp_path / folder)
    assert tag in tags
    assert any("lnmonitor/share_median/" in t for t in tags)
    if "trainer" in folder:
        assert "train/lnmonitor/invariance/axis_5/dloss" in tags
