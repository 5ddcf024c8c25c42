"""research.stability.testbed and ``python -m research.stability``: a run records every step, the
command tabulates and skips it, and shards split the testbed."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from lnmonitor.tiny.corpus import default_corpus
from research.stability.__main__ import main
from research.stability.testbed import TESTBED, run_testbed, testbed_runs


def test_a_testbed_run_records_every_step_and_the_command_tabulates_and_skips_it(tmp_path):
    config = TESTBED["qk-lr3e-2-nowarmup"]
    small = replace(config.recipe, width=32, heads=2, depth=2, context=16, max_steps=12, val_every=6)
    TESTBED["tiny-test"] = replace(config, name="tiny-test", recipe=small, seeds=(0,))
    try:
        text = default_corpus()[:20000]
        paths = run_testbed(text, tmp_path, names=["tiny-test"], echo=lambda _: None)
        record = json.loads(paths[0].read_text())
        assert len(record["loss"]) == len(record["grad_norm"]) == 12 and record["steps"] == 12
        assert [m["step"] for m in record["measured"]] == [0, 5, 10]
        assert len(record["measured"][0]["attention_per_layer"]) == 2  # one per layer
        assert [v[0] for v in record["val"]] == [5, 11] and math.isfinite(record["final_val_loss"])
        said = []
        run_testbed(text, tmp_path, names=["tiny-test"], echo=said.append)
        assert "tiny-test seed=0: finished before, skipped" in said
    finally:
        del TESTBED["tiny-test"]
    doc = tmp_path / "doc.md"
    doc.write_text("x\n<!-- stability-table:start -->\nSTALE\n<!-- stability-table:end -->\ny\n")
    assert main(["--out", str(tmp_path), "--table-only", "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "STALE" not in text and "| tiny-test | 0 |" in text and text.endswith("-->\ny\n")
    assert main(["--out", str(tmp_path / "empty"), "--table-only"]) == 2


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_testbed_shards_are_disjoint_cover_it_and_start_with_seed_zero(count):
    every = testbed_runs()
    assert sorted(every) == sorted((n, s) for n, c in TESTBED.items() for s in c.seeds)
    assert [s for _, s in every[:len(TESTBED)]] == [0] * len(TESTBED)  # seed 0 of each first
    shards = [testbed_runs(shard=(i, count)) for i in range(count)]
    assert sorted(r for shard in shards for r in shard) == sorted(every)  # disjoint and covering
    assert sum(map(len, shards)) == len(every)
    assert main(["--shard", f"{count}/{count}", "--table-only"]) == 2
