"""One rule for the invariance probe's runs, in every monitor: a step probed once (its sweep
added when asked for and missing), a non-finite loss said once and the next step tried, a sweep
without a slope noted once with the reason (on the logger, not as a warning), a probe that cannot
run turned off with its cause and where it was raised, naming loss_fn= when the default call of
the model failed."""

from __future__ import annotations

import logging
import math
import warnings

import torch
from conftest import gpt, windows

from lnmonitor.core.invariance.probe import InvarianceProbe
from lnmonitor.core.invariance.runs import LOSS_FN_ADVICE, InvarianceRuns
from lnmonitor.core.monitor.shared import Messages


def _runs(loss_fn=None, scales=(1e-1, 1e-2, 1e-3), model=None,
          advice="") -> tuple[InvarianceRuns, list[str]]:
    said: list[str] = []
    model = model if model is not None else gpt().model
    runs = InvarianceRuns("Monitor", Messages(warn=said.append), advice=advice)
    runs.begin(InvarianceProbe(model, loss_fn, scales=scales), windows(4))
    return runs, said


def test_a_step_is_probed_once_and_its_missing_sweep_is_added_to_it():
    runs, said = _runs()
    metrics, extend = runs.take(0, sweep=False)
    assert not extend and "lnmonitor/invariance/axis_5/dloss" in metrics
    assert runs.take(0, sweep=False) is None  # taken
    sweep, extend = runs.take(0, sweep=True)  # the sweep alone, added to the point
    assert extend and "lnmonitor/invariance/scale_slope" in sweep
    assert "lnmonitor/invariance/axis_5/dloss" not in sweep
    assert runs.take(0, sweep=True) is None and not said


def test_a_non_finite_loss_is_said_once_and_the_next_step_is_probed():
    calls = []

    def loss_fn(model, batch):
        calls.append(1)
        logits, loss = model(*batch)
        return loss * (math.nan if len(calls) <= 20 else 1.0)

    runs, said = _runs(loss_fn, scales=())
    assert runs.take(0, sweep=False) is None and runs.take(1, sweep=False) is None
    assert len(said) == 1 and "no invariance point at step 0" in said[0] and runs.off_reason is None
    calls.extend([1] * 20)
    assert runs.take(2, sweep=False) is not None


def test_a_probe_that_cannot_run_turns_off_with_its_cause_and_location_said_once():
    def loss_fn(model, batch):
        return batch["no such key"]

    runs, said = _runs(loss_fn)
    assert runs.take(0, sweep=False) is None and runs.take(1, sweep=False) is None
    assert runs.off_reason.startswith(("TypeError", "KeyError"))
    assert "test_invariance_runs.py" in runs.off_reason
    assert len(said) == 1
    assert said[0].startswith("Monitor: the invariance probe is off for the rest of this run")


def test_a_sweep_without_a_slope_is_noted_once_on_the_logger_not_warned(caplog):
    runs, said = _runs(scales=(1e-1,))  # one sweep point: nothing to fit
    with caplog.at_level(logging.INFO, logger="lnmonitor"), warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to act on: no UserWarning
        runs.take(0, sweep=True)
        runs.take(1, sweep=True)
    notes = [r.getMessage() for r in caplog.records if "no scale-sweep slope" in r.getMessage()]
    assert math.isnan(runs.last.slope) and not said and len(notes) == 1
    assert "fewer than 3" in notes[0] and "fewer than 3" in runs.last.fit_note


class InputPos(torch.nn.Module):
    """LitGPT's ``GPT.forward(idx, input_pos=None)``: a second tensor is not a target."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx, input_pos=None):
        if input_pos is not None:
            raise TypeError("You need to call `gpt.set_kv_cache()`")
        return self.model(idx)


def test_when_calling_the_model_with_the_batch_fails_the_message_names_loss_fn():
    model = InputPos(gpt().model)
    runs, said = _runs(model=model, advice=LOSS_FN_ADVICE)
    assert runs.take(0, sweep=False) is None
    assert len(said) == 1 and "set_kv_cache" in said[0] and "pass loss_fn=lambda model, batch" in said[0]
    # a loss_fn of the user's that fails: the cause alone, no advice to pass what was passed
    runs, said = _runs(lambda m, b: m(*b), model=model, advice=LOSS_FN_ADVICE)
    runs.take(0, sweep=False)
    assert len(said) == 1 and "set_kv_cache" in said[0] and "loss_fn" not in said[0]


def test_a_monitor_whose_probe_is_the_monitor_turns_itself_off():
    reasons: list[str] = []
    runs = InvarianceRuns("Monitor", Messages(warn=reasons.append),
                          on_off=lambda reason: reasons.append("off: " + reason))
    runs.begin(InvarianceProbe(gpt().model, lambda m, b: torch.tensor(1.0) + b.foo), windows(4))
    runs.take(0, sweep=False)
    assert len(reasons) == 1 and reasons[0].startswith("off: AttributeError")
