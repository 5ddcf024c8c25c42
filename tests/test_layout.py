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
    root = Path(lnmonitor.__file__).parent
    crowded = [f"{init.parent.relative_to(root)}: {n}" for init in sorted(root.rglob("__init__.py"))
               if (n := len([p for p in init.parent.glob("*.py") if p.name != "__init__.py"])) > 12]
    assert not crowded, crowded


# -- docs/layout.md's claims, read from its text ------------------------------------------

LAYOUT = (Path(__file__).resolve().parent.parent / "docs" / "layout.md").read_text()
PACKAGE = Path(lnmonitor.__file__).parent


def _folders() -> dict[str, set[str]]:
    """Every folder of the package (``core/maths``) with its modules (no ``__init__``)."""
    return {str(init.parent.relative_to(PACKAGE)): {p.stem for p in init.parent.glob("*.py")} - {"__init__"}
            for init in PACKAGE.rglob("__init__.py") if init.parent != PACKAGE}


def test_the_layout_page_lists_every_folder_and_module_of_the_package():
    rows = re.findall(r"^\| `([\w/]+)` \| ([^|]+) \|", LAYOUT, re.M)
    listed = {folder: set(re.findall(r"`(\w+)`", modules)) for folder, modules in rows}
    assert listed == _folders()


def test_every_folders_docstring_names_its_modules():
    faceless = {folder: sorted(m for m in modules if m not in (PACKAGE / folder / "__init__.py").read_text())
                for folder, modules in _folders().items()}
    assert not {f: m for f, m in faceless.items() if m}, "their __init__ docstrings do not name these"


def test_the_levels_on_the_layout_page_are_the_ones_checked():
    levels = re.findall(r"^\d\. (`\w+`(?: and `\w+`)?)", LAYOUT, re.M)
    assert [tuple(re.findall(r"`(\w+)`", level)) for level in levels] == LEVELS


def test_the_path_of_one_number_names_real_code_and_counts_it():
    import importlib

    block = re.search(r"## The path of one number.*?```text\n(.*?)```", LAYOUT, re.S).group(1)
    names = block.split()
    modules = []
    for name in names:
        module, attr = name.rsplit(".", 1)
        assert hasattr(importlib.import_module(module), attr), name
        modules.append(module)
    modules = list(dict.fromkeys(modules))
    said = re.search(r"That is (\d+) modules, and the number takes (\d+) types on the way: (.*?)\. ",
                     LAYOUT, re.S)
    assert int(said.group(1)) == len(modules)
    types = re.findall(r"`(\w+)(?:\[[\w, ]+\])?`", said.group(3))
    assert int(said.group(2)) == len(types)
    defined = {name.rsplit(".", 1)[1] for name in names}
    assert [t for t in types if t not in defined and t not in ("Tensor", "ndarray", "dict")] == []
    meter_doc = importlib.import_module("lnmonitor.core.meter.meter").__doc__
    assert "docs/layout.md" in meter_doc  # the path where a reader of the meter starts


def test_commands_do_not_import_each_other():
    wrong = [f"{path.name} imports commands.{name}" for path in sorted((PACKAGE / "commands").glob("*.py"))
             for name in re.findall(r"^\s*from lnmonitor\.commands\.(\w+)", path.read_text(), re.M)
             if name not in ("recipe_arguments", path.stem) and path.stem != "cli"]
    assert not wrong, wrong


def test_every_code_name_in_the_glossary_exists():
    """The glossary's module paths (``lnmonitor/...py``) and dotted names (``lnmonitor.x.y``)."""
    import importlib

    glossary = (Path(__file__).resolve().parent.parent / "docs" / "glossary.md").read_text()
    root = PACKAGE.parent
    missing = [p for p in re.findall(r"`(lnmonitor/[\w/]+\.py)`", glossary) if not (root / p).exists()]
    for dotted in set(re.findall(r"`(lnmonitor(?:\.\w+)+)`", glossary)):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attr in parts[cut:]:
                obj = getattr(obj, attr, None)
            if obj is None:
                missing.append(dotted)
            break
    assert not missing, missing
