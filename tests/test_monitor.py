"""core/monitor/monitor.py: the Monitor every callback drives -- its cadence, what follows a step,
its end -- on a real meter and real views."""

from __future__ import annotations

import torch

from lnmonitor.core.monitor.monitor import Monitor
from lnmonitor.core.monitor.settings import Settings
from lnmonitor.core.monitor.shared import Messages
from lnmonitor.views.run_views import RunViews


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8),
                               torch.nn.LayerNorm(8))


def _step(monitor, model, step, stop=lambda: None):
    monitor.start(step)
    model(torch.randn(6, 8)).square().sum().backward()
    return monitor.end_step(step, stop)


def test_the_cadence_measures_the_first_every_nth_and_the_last_step_once():
    model = _model()
    monitor = Monitor(Settings(every_n_steps=3, findings=False, images=False, summary=False), "Test",
                      Messages(info=lambda s: None), RunViews)
    monitor.begin(model, lambda step, metrics, result: True, speaks=lambda: True, last_step=7)
    measured = [step for step in range(8) if _step(monitor, model, step) is not None]
    assert measured == [0, 3, 6, 7]
    assert [s for s in range(8) if monitor.start(s)] == []  # logged already: a resumed run's steps


def test_positions_go_with_the_first_logged_step_and_the_views_keep_what_was_logged():
    model, said, warned = _model(), [], []
    monitor = Monitor(Settings(every_n_steps=1, findings=False, images=False), "Test",
                      Messages(info=said.append, warn=warned.append), RunViews)
    logged, refuse = [], [True]

    def log(step, metrics, result):
        if refuse[0]:  # a logger that did not log (another rank's, or none yet)
            return False
        logged.append((step, dict(metrics)))
        return True

    monitor.begin(model, log, speaks=lambda: True)
    first = _step(monitor, model, 0)
    assert any("ladder_position" in k for k in first) and logged == [] and not monitor.views.curves
    refuse[0] = False
    second = _step(monitor, model, 1)
    assert any("ladder_position" in k for k in second)  # the first step that was logged has them
    third = _step(monitor, model, 2)
    assert not any("ladder_position" in k for k in third) and [s for s, _ in logged] == [1, 2]
    assert monitor.last_result is not None and monitor.views.curves
    assert monitor.end_step(4, lambda: None) is None  # not measured, and no findings to log
    monitor.end()
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
    for speaks in (True, False):
        monitor = Monitor(Settings(), "Test", Messages(info=lambda s: None, warn=warned.append),
                          lambda *args, **kwargs: Broken())
        monitor.begin(_model(), lambda step, metrics, result: True, speaks=lambda speaks=speaks: speaks)
        monitor.end()  # not the process that speaks: nothing drawn, nothing said
    assert warned == ["Test: no end-of-run summary or picture: RuntimeError('no screen')"]
