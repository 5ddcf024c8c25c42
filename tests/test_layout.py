"""docs/layout.md: the folders are import levels, each importing only the levels below it."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import lnmonitor

# bottom up; the integrations stand side by side on one level and import neither each other
LEVELS = [("core",), ("views",), ("lightning", "integrations"), ("tiny",), ("experiments",), ("commands",)]


def test_every_folder_imports_only_the_levels_below_it():
    root = Path(lnmonitor.__file__).parent
    below: set[str] = {"errors"}  # lnmonitor/errors.py: the exceptions every level may raise
    wrong = []
    for level in LEVELS:
        for folder in level:
            for path in sorted((root / folder).rglob("*.py")):
                for name in re.findall(r"^\s*(?:from|import) lnmonitor\.(\w+)", path.read_text(), re.M):
                    if name != folder and name not in below:
                        wrong.append(f"{path.relative_to(root)} imports lnmonitor.{name}")
        below |= set(level)
    assert not wrong, wrong


def test_the_package_imports_nothing_from_research():
    """research/ is not installed (pyproject packages only lnmonitor*): the package never imports it."""
    root = Path(lnmonitor.__file__).parent
    wrong = [str(path.relative_to(root)) for path in sorted(root.rglob("*.py"))
             if re.search(r"^\s*(?:from|import) research\b", path.read_text(), re.M)]
    assert not wrong, wrong


def test_the_meter_and_the_loop_monitor_import_and_run_without_lightning():
    script = textwrap.dedent("""
        import sys
        for name in ("lightning", "pytorch_lightning", "lightning_fabric"):
            sys.modules[name] = None  # any import of Lightning now fails
        import torch
        from lnmonitor.core.meter.meter import LadderMeter
        from lnmonitor.integrations.loop import LoopMonitor
        import lnmonitor.core.invariance.probe, lnmonitor.core.meter.heldout, lnmonitor.core.output.writers
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8),
                                    torch.nn.LayerNorm(8))
        meter = LadderMeter(model)
        with meter.step():
            model(torch.randn(5, 8)).square().sum().backward()
        result = meter.result()
        assert result.row_stats[0].rows == 5 and "lnmonitor/sigma/1" in result.metrics()
        print("ok", sorted(n for n in sys.modules if n.startswith("lightning")))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ok" in out.stdout


# what a training step does not need: pictures, readers of event files, the other integrations' frameworks
HEAVY = ("matplotlib", "scipy", "transformers", "tensorboard", "tensorboardX", "lightning",
         "pytorch_lightning")


def test_the_package_names_its_three_integrations_and_importing_the_loop_monitor_loads_nothing_heavy():
    assert {"LayerNormMonitor", "LoopMonitor", "LNMonitorCallback"} <= set(lnmonitor.__all__)
    assert "Trainer" in lnmonitor.__doc__ and "plain PyTorch loop" in lnmonitor.__doc__
    script = textwrap.dedent(f"""
        import sys
        import lnmonitor
        from lnmonitor import LoopMonitor
        from lnmonitor.integrations.loop import LoopMonitor as Same
        assert LoopMonitor is Same
        print(sorted({{n.split(".")[0] for n in sys.modules}} & set({HEAVY!r})))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_no_folder_holds_more_than_a_dozen_modules():
    """docs/layout.md: folders by job, each a part with a public face (its ``__init__``'s
    docstring names its modules) and at most a dozen modules."""
    root = Path(lnmonitor.__file__).parent
    crowded, faceless = [], []
    for init in sorted(root.rglob("__init__.py")):
        folder = init.parent
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > 12:
            crowded.append(f"{folder.relative_to(root)}: {len(modules)}")
        text = init.read_text()
        if folder.parent.name == "core" and not all(p.stem in text for p in modules):
            faceless.append(str(folder.relative_to(root)))
    assert not crowded, crowded
    assert not faceless, f"these parts' __init__ docstrings do not name all their modules: {faceless}"
