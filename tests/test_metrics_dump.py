"""tools/metrics_dump.py: the dump of what the three integrations log, and its comparison bit for bit."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "metrics_dump.py"


def _tool():
    spec = importlib.util.spec_from_file_location("metrics_dump", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_names_every_value_that_differs_in_its_last_bit_and_every_missing_tag():
    tool = _tool()
    before = {"loop": {"values": {"all": {"0": {"a": (0.1).hex(), "b": (1.0).hex()}}}, "said": ["x"]}}
    after = {"loop": {"values": {"all": {"0": {"a": (0.1 + 2**-56 * 2).hex(), "c": (1.0).hex()}}},
                      "said": ["x"]}}
    assert tool.compare(before, before) == []
    found = tool.compare(before, after)
    assert len(found) == 3 and found[0].startswith("/loop/values/all/0/a: ")
    assert "/loop/values/all/0/b: only before" in found and "/loop/values/all/0/c: only after" in found


@pytest.mark.slow
def test_the_dump_holds_every_integration_and_is_the_same_twice(tmp_path):
    pytest.importorskip("transformers")
    tool = _tool()
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    assert tool.main([str(first)]) == 0 and tool.main([str(second)]) == 0
    assert tool.main(["--compare", str(first), str(second)]) == 0
    import json

    dump = json.loads(first.read_text())
    for integration, part in (("lightning", "ladder"), ("lightning", "invariance"), ("transformers", "all"),
                             ("loop", "all")):
        steps = dump[integration]["values"][part]
        assert steps and all(steps.values()), (integration, part)
    assert any("lnmonitor summary" in line for line in dump["loop"]["said"])


def test_compare_names_each_printed_line_that_changed():
    tool = _tool()
    before = {"loop": {"values": {}, "said": ["a", "b"]}}
    after = {"loop": {"values": {}, "said": ["a", "c", "d"]}}
    assert tool.compare(before, after) == ["/loop/said[1]: 'b' -> 'c'", "/loop/said[2]: None -> 'd'"]
