"""core/monitor/after_step.py: the post-step sequence every monitor runs, on a real meter and real views."""

from __future__ import annotations

import torch

from lnmonitor.core.meter.meter import LadderMeter
from lnmonitor.core.monitor.after_step import AfterStep
from lnmonitor.views.run_views import RunViews


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8),
                               torch.nn.LayerNorm(8))


def _measure(meter, model):
    meter.start()
    model(torch.randn(6, 8)).square().sum().backward()


def test_positions_go_with_the_first_logged_step_and_the_views_keep_what_was_logged():
    model, said, warned = _model(), [], []
    meter = LadderMeter(model, info=said.append, warn=lambda k, t: warned.append(t))
    views = RunViews("Test", said.append, lambda k, t: warned.append(t), images=False, image_every_n_steps=1,
                     summary=True)
    after = AfterStep(meter, None, views, speaks=lambda: True, warn=lambda k, t: warned.append(t),
                      name="Test")
    logged, refuse = [], [True]

    def log(step, metrics, result):
        if refuse[0]:  # a logger that did not log (another rank's, or none yet)
            return False
        logged.append((step, dict(metrics)))
        return True

    _measure(meter, model)
    first = after.measured(0, log, lambda: None)
    assert any("ladder_position" in k for k in first) and logged == [] and not views.curves
    refuse[0] = False
    _measure(meter, model)
    second = after.measured(1, log, lambda: None)
    assert any("ladder_position" in k for k in second)  # the first step that was logged has them
    _measure(meter, model)
    third = after.measured(2, log, lambda: None)
    assert not any("ladder_position" in k for k in third) and [s for s, _ in logged] == [1, 2]
    assert after.last_result is not None and views.curves
    assert after.every_step(4, log, lambda: None, measured=False) is False  # no findings reader
    after.end(None, "Sequential, end of training")
    assert sum("lnmonitor summary: Sequential, end of training" in s for s in said) == 1


def test_a_failing_summary_is_said_and_the_run_goes_on():
    class Broken:
        def add(self, step, metrics):
            pass

        def step(self, write, result, step, last=False):
            pass

        def end(self, write, title, watched=None, start=None, settings=None):
            raise RuntimeError("no screen")

    warned = []
    model = _model()
    after = AfterStep(LadderMeter(model, info=lambda s: None), None, Broken(), speaks=lambda: True,
                      warn=lambda k, t: warned.append(t), name="Test")
    after.end(None, "title")
    assert warned == ["Test: no end-of-run summary or picture: RuntimeError('no screen')"]
    quiet = AfterStep(LadderMeter(model, info=lambda s: None), None, Broken(), speaks=lambda: False,
                      warn=lambda k, t: warned.append(t), name="Test")
    quiet.end(None, "title")  # not the process that speaks: nothing drawn, nothing said
    assert len(warned) == 1
