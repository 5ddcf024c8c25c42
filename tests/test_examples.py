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


def test_the_sbatch_script_is_valid_bash_and_shards_the_grid():
    """No SLURM here: the script is checked for syntax and for the array and shard it uses."""
    text = (EXAMPLES / "eps_grid.sbatch").read_text()
    assert "#SBATCH --array=" in text and '--shard "${SLURM_ARRAY_TASK_ID}/${SLURM_ARRAY_TASK_COUNT}"' in text
    assert subprocess.run(["bash", "-n", str(EXAMPLES / "eps_grid.sbatch")]).returncode == 0
