"""lnmonitor.experiments.eps.run: a finished run measured again keeps its training and takes this
lnmonitor's record format, with nothing left of the older measurement."""

from __future__ import annotations

from pathlib import Path

from lnmonitor.core.output.files import read_json
from lnmonitor.experiments.eps import store
from lnmonitor.experiments.eps.run import remeasured

STORED = Path(__file__).resolve().parent.parent / "results" / "eps-compare" / "eps=0.1" / "seed=0"


def test_a_stored_record_measured_again_is_a_new_record_with_its_training_kept():
    old = read_json(STORED / store.RECORD_NAME, "run record")
    assert old["format"] == "lnmonitor.eps-compare.run/1" and "norms" in old
    measured = {"headline": {"val_loss": 1.25}, "metrics": {"lnmonitor/eps_over_var/model.lnf": 0.5},
                "norm_order": ["model.lnf"], "rungs": ["model.lnf"], "final_norm": "model.lnf",
                "norm_info": {"model.lnf": {"kind": "layer", "width": 128, "eps": 0.1, "role": "final",
                                            "dead_dim": 2}}}
    new = remeasured(old, measured)
    assert new["format"] == store.RECORD_FORMAT and new["val_loss"] == 1.25
    assert not {"norms", "ladder", "share_baseline"} & set(new)  # no figure of the old measurement
    assert new["curves"] == old["curves"] and new["steps"] == old["steps"] and new["config"] == old["config"]
    assert store.norm_value(new, "model.lnf", "eps_over_var") == 0.5
    assert store.record_rungs(new) == ["model.lnf"] and store.share_baseline(new) is None
