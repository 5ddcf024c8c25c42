"""lnmonitor.experiments.eps.store: one reader for a run record's held-out figures, format /1 (the
stored grids' hand-built norms table) and /2 (the meter's metrics and roles)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lnmonitor.core.output import files
from lnmonitor.errors import UsageError
from lnmonitor.experiments.eps import store
from lnmonitor.experiments.eps.over_training import ladder_ends

STORED = Path(__file__).resolve().parent.parent / "results" / "eps-compare"


def new_record() -> dict:
    """A /2 record of a model whose first norm normalises the embeddings and whose third
    normalises a branch's output: neither is a rung."""
    metrics = {"lnmonitor/eps_over_var/emb": 3.0, "lnmonitor/eps_over_var/ln1": 0.25,
               "lnmonitor/eps_over_var/post": 9.0, "lnmonitor/eps_over_var/lnf": 0.01,
               "lnmonitor/inv_sigma/ln1": 2.0,
               "lnmonitor/share_baseline/median": 0.15}
    info = {name: {"kind": "layer", "width": 64, "eps": 1e-5, "role": role, "dead_dim": 2}
            for name, role in (("emb", "embedding"), ("ln1", "residual"), ("post", "post"),
                               ("lnf", "final"))}
    return {"format": store.RECORD_FORMAT, "metrics": metrics, "norm_order": ["emb", "ln1", "post", "lnf"],
            "norm_info": info, "rungs": ["ln1", "lnf"], "final_norm": "lnf"}


def old_record() -> dict:
    return {"format": "lnmonitor.eps-compare.run/1", "norm_order": ["a", "b"],
            "norms": {"a": {"eps_over_var": 0.5, "inv_sigma": 1.5}, "b": {"eps_over_var": 2.0}},
            "share_baseline": {"d": 128, "k": 2, "median": 0.1046}}


def test_a_new_record_is_read_through_its_metrics_and_its_roles():
    r = new_record()
    assert store.record_norms(r) == ["emb", "ln1", "post", "lnf"]
    assert store.record_rungs(r) == ["ln1", "lnf"] and store.record_final(r) == "lnf"
    assert ladder_ends(r) == ("ln1", "lnf")
    assert store.norm_value(r, "post", "eps_over_var") == 9.0
    assert store.norm_value(r, "post", "inv_sigma") is None
    assert store.share_baseline(r) == {"median": 0.15, "d": 64, "k": 2}


def test_an_old_record_reads_as_before_every_norm_a_rung():
    r = old_record()
    assert store.record_rungs(r) == ["a", "b"] == store.record_norms(r) and store.record_final(r) == "b"
    assert store.norm_value(r, "a", "inv_sigma") == 1.5 and store.norm_value(r, "b", "inv_sigma") is None
    assert store.share_baseline(r)["median"] == 0.1046


@pytest.mark.parametrize("fmt", [*store.RECORD_FORMATS, "lnmonitor.eps-compare.run/0"])
def test_both_record_formats_are_read_and_others_refused(tmp_path, fmt):
    config = {"recipe": {}}
    path = store.run_dir(tmp_path, 0.1, 0) / store.RECORD_NAME
    files.atomic_write_json(path, {"format": fmt, "config": config, "eps": 0.1, "seed": 0, "steps": 1,
                                   "val_loss": 1.0})
    if fmt in store.RECORD_FORMATS:
        assert store.read_record(path, config)["format"] == fmt
    else:
        with pytest.raises(UsageError, match="has format"):
            store.read_record(path, config)


def test_the_stored_grid_is_read_through_the_one_reader():
    results = store.load_results(STORED)
    records = store.scan_records(STORED, results["config"])
    assert len(records) >= 14
    for r in records.values():
        first = store.record_rungs(r)[0]
        assert first == "model.blocks.0.ln1" and store.record_final(r) == "model.lnf"
        assert store.norm_value(r, first, "eps_over_var") == r["norms"][first]["eps_over_var"] > 0
