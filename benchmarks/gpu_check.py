"""Everything lnmonitor claims, checked once on a CUDA GPU, in one command (~15 minutes).

    PYTHONPATH=. python benchmarks/gpu_check.py --out gpu-check

1. ``pytest -m cuda``: the monitors under ``16-mixed`` with Lightning's real CUDA
   GradScaler, ``bf16-mixed`` and ``32-true`` against float64 of the step's own tensors,
   ``torch.compile``, FSDPStrategy / ModelParallelStrategy on the one GPU on a tiny
   GPT and a transformers GPT-2, and ModelParallelStrategy's tensor parallelism (sequence-
   parallel and replicated norms) on two GPUs, or on a mesh of one rank when there is one
   (NCCL runs one rank per device) (tests/test_cuda.py);
2. ``benchmarks/overhead.py --device cuda``: the train-tiny recipe and wider models
   (widths 512, 1024, 2048, context 256), every step and at the defaults, paired ratios
   with synchronised timing, peak memory from ``torch.cuda.max_memory_allocated``;
3. ``benchmarks/cost_model.py --device cuda``: the cost model, widths 128 to 4096 x
   depths 4, 12, 24 at context 256 (cells over 80% of the GPU's memory are skipped and
   named), and its figure ``cost_model_cuda.png``.

Writes ``gpu_check.json`` and ``gpu_check.md`` (versions, device, test counts and
failures, the overhead table, the cost model) under ``--out``.  Runs with whatever torch,
Lightning and transformers are installed (nothing is installed).  Without CUDA it says so
in one line and exits 0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OVERHEAD = ["--device", "cuda", "--widths", "128", "512", "1024", "2048", "--context", "256",
            "--batch-size", "32", "--steps", "16", "--rounds", "2"]
COST_MODEL = ["--device", "cuda", "--context", "256", "--batch-size", "32", "--steps", "16",
              "--cell-budget", "120"]


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for package in ("torch", "lightning", "transformers", "tensorboard", "numpy"):
        try:
            out[package] = md.version(package)
        except md.PackageNotFoundError:
            out[package] = "not installed"
    return out


def junit_counts(path: Path) -> dict:
    """Passed, failed, skipped counts and the failed tests' ids from a pytest junit XML."""
    root = ET.parse(path).getroot()
    cases = root.iter("testcase")
    counts = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            node = case.find("failure") if case.find("failure") is not None else case.find("error")
            counts["failures"].append({"test": name, "message": (node.get("message") or "")[:500]})
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def within(command: list[str], seconds: int) -> str:
    """Run ``command`` in the repository for at most ``seconds``; how it ended, in words
    (a run past its time is stopped, and the check goes on to write its report)."""
    try:
        return f"exit code {subprocess.run(command, cwd=ROOT, timeout=seconds).returncode}"
    except subprocess.TimeoutExpired:
        return f"stopped after {seconds} s"


def check_markdown(result: dict) -> str:
    """The markdown report of one check (``result`` as written to gpu_check.json)."""
    v, tests = result["versions"], result["tests"]
    lines = [f"# lnmonitor on {result['device']}", "",
             f"torch {v['torch']}, Lightning {v['lightning']}, transformers {v['transformers']}, "
             f"Python {v['python']}; {result['seconds']:.0f} s in all.", "",
             f"## CUDA tests: {tests['passed']} passed, {tests['failed']} failed, "
             f"{tests['skipped']} skipped", ""]
    lines += [f"- FAILED {f['test']}: {f['message']}" for f in tests["failures"]]
    lines += ["", "## Overhead", "", result.get("overhead_table") or "(not run: --skip-overhead)", ""]
    lines += ["## Cost model", "", result.get("cost_model_table") or "(not run: --skip-overhead)", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--skip-overhead", action="store_true",
                        help="only the CUDA tests: no overhead, no cost model")
    parser.add_argument("--test-timeout", type=int, default=300, help="seconds for the tests (default 300)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}); nothing to check")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    result = {"device": torch.cuda.get_device_name(0), "versions": versions()}
    xml = args.out / "cuda_tests.xml"
    tests_ran = within([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests/test_cuda.py",
                        f"--junitxml={xml}", "-p", "no:cacheprovider"], args.test_timeout)
    result["tests"] = junit_counts(xml) if xml.is_file() else {
        "passed": 0, "failed": 1, "skipped": 0, "failures": [{"test": "pytest", "message": tests_ran}]}
    if not args.skip_overhead:
        table = args.out / "overhead.md"
        ran = within([sys.executable, "benchmarks/overhead.py", *OVERHEAD, "--markdown", str(table)], 420)
        result["overhead_table"] = table.read_text() if table.is_file() else f"(not measured: {ran})"
        table, figure = args.out / "cost_model.md", args.out / "cost_model_cuda.png"
        ran = within([sys.executable, "benchmarks/cost_model.py", *COST_MODEL, "--markdown", str(table),
                      "--figure", str(figure)], 600)
        result["cost_model_table"] = table.read_text() if table.is_file() else f"(not measured: {ran})"
    result["seconds"] = time.monotonic() - start
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=2))
    (args.out / "gpu_check.md").write_text(check_markdown(result))
    print(check_markdown(result))
    return 1 if result["tests"]["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
