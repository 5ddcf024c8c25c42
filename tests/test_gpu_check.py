"""The GPU check's plumbing, on CPU: one line and exit 0 without CUDA, its arguments, and
its report read from a real pytest junit report."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_it_says_so_in_one_line_and_exits_0(tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.count("\n") == 1
    assert proc.stdout.startswith("gpu_check: no CUDA device here") and not out.exists()


def test_out_is_required(capsys):
    with pytest.raises(SystemExit) as done:
        gpu_check.main([])
    assert done.value.code == 2 and "--out" in capsys.readouterr().err


def test_report_from_a_real_junit_report(tmp_path):
    (tmp_path / "test_three.py").write_text(
        "import pytest\n"
        "def test_ok():\n    pass\n"
        "def test_bad():\n    assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='no')\ndef test_skipped():\n    pass\n"
    )
    xml = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    str(tmp_path / "test_three.py"), f"--junitxml={xml}"], capture_output=True, cwd=tmp_path)
    counts = gpu_check.junit_counts(xml)
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (1, 1, 1)
    failure = counts["failures"][0]
    assert failure["test"].endswith("::test_bad") and "one is not two" in failure["message"]
    result = {"device": "a GPU", "versions": gpu_check.versions(), "tests": counts, "seconds": 12.0,
              "overhead_table": "| width |\n|---|"}
    text = gpu_check.check_markdown(result)
    assert "1 passed, 1 failed, 1 skipped" in text and "FAILED" in text and "| width |" in text
    assert f"torch {torch.__version__.split('+')[0]}" in text or f"torch {torch.__version__}" in text


def test_a_step_past_its_time_is_stopped_and_said():
    assert gpu_check.within([sys.executable, "-c", "pass"], 60) == "exit code 0"
    assert gpu_check.within([sys.executable, "-c", "import time; time.sleep(30)"], 1) == "stopped after 1 s"
