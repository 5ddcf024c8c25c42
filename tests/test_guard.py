"""Never fatal: every entry point of every monitor runs inside one guard.

An exception injected into the body of each entry point (the guarded body is the entry's
``__wrapped__``; the guard itself is the real one) must turn that monitor off with one warning
naming the cause and the entry point, leave no hook behind, and let the fit finish; the other
monitors of the same fit go on measuring.  A structural test makes sure no entry point is
left outside the guard, so a hook added later cannot crash a user's training.
"""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from conftest import gpt, loader
from lightning.pytorch.callbacks import Callback

from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor, StructureProbe
from lnmonitor.core.monitor.shared import History, Messages, entry_points, guarded
from lnmonitor.integrations.loop import LoopMonitor

STEPS = 4
LIGHTNING = (LayerNormMonitor, FinalNormInvarianceMonitor, StructureProbe)
CHECKPOINT_STATE = {"state_dict", "load_state_dict"}  # plain copies of ints and names


class Injected(RuntimeError):
    pass


def _inject(monkeypatch, cls, entry: str, calls: list) -> None:
    def boom(self, *args, **kwargs):
        calls.append(entry)
        raise Injected(f"injected into {entry}")

    monkeypatch.setattr(getattr(cls, entry), "__wrapped__", boom)


def _lightning_fit(callbacks) -> tuple[L.Trainer, list[str]]:
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=1, val_check_interval=2, check_val_every_n_epoch=None,
                        callbacks=callbacks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(gpt(STEPS), loader(32, 4), loader(8, 4, seed=1))
    return trainer, [str(w.message) for w in caught]


def _monitors():
    return [LayerNormMonitor(every_n_steps=1, keep_history=True, images=False, summary=False),
            FinalNormInvarianceMonitor(invariance_every_n_steps=2, keep_history=True, probe_size=4,
                                       summary=False, scales=()),
            StructureProbe()]


def _hooks(cls) -> set[str]:
    """The Lightning hooks ``cls`` defines itself (not Callback's empty defaults)."""
    return {name for name in dir(Callback) if not name.startswith("_") and callable(getattr(Callback, name))
            and getattr(cls, name) is not getattr(Callback, name)}


@pytest.mark.parametrize("cls", LIGHTNING, ids=lambda c: c.__name__)
def test_every_lightning_hook_of_every_callback_runs_inside_the_guard(cls):
    hooks = _hooks(cls) - CHECKPOINT_STATE
    assert hooks and hooks <= set(entry_points(cls)), hooks - set(entry_points(cls))


CASES = [(cls, entry) for cls in LIGHTNING for entry in sorted(_hooks(cls) - CHECKPOINT_STATE)]


@pytest.mark.parametrize("cls,entry", CASES, ids=[f"{c.__name__}.{e}" for c, e in CASES])
def test_an_exception_in_any_lightning_hook_turns_that_callback_off_and_the_fit_finishes(
        monkeypatch, cls, entry):
    calls: list[str] = []
    _inject(monkeypatch, cls, entry, calls)
    monitors = _monitors()
    trainer, said = _lightning_fit(monitors)
    assert trainer.global_step == STEPS  # the fit went on to its end
    if entry == "on_exception":  # an ordinary fit raises nothing: the hook never ran
        assert not calls and all(m.off_reason is None for m in monitors)
        return
    assert calls == [entry]  # off after the first: never called again
    broken = next(m for m in monitors if type(m) is cls)
    assert f"Injected: injected into {entry}" in broken.off_reason
    assert f"during {entry}" in broken.off_reason
    assert sum(f"{cls.__name__} is off for the rest of this run" in s for s in said) == 1
    if cls is not LayerNormMonitor and entry != "teardown":  # the others measure on
        ladder = monitors[0]
        assert ladder.off_reason is None and len(ladder.history) == STEPS
    if cls is LayerNormMonitor:  # no hook is left on the model
        assert not broken.meter or not broken.meter.measuring


def test_a_guarded_monitor_is_on_again_for_the_next_fit(monkeypatch):
    mon = LayerNormMonitor(every_n_steps=1, keep_history=True, images=False, summary=False)
    calls: list[str] = []
    _inject(monkeypatch, LayerNormMonitor, "on_train_batch_end", calls)
    _lightning_fit([mon])
    assert mon.off_reason is not None
    monkeypatch.undo()
    _lightning_fit([mon])
    assert mon.off_reason is None and len(mon.history) == STEPS


def test_a_refusal_still_stops_the_fit_before_it_starts():
    """Bad configuration is refused early, as Lightning's own callbacks refuse it."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match="final_norm"):
        _lightning_fit([LayerNormMonitor(final_norm="model.no_such_norm")])


def test_a_logger_that_raises_on_lnmonitor_metrics_turns_the_monitor_off_with_its_cause():
    """A real cause, not an injection: the logger fails on our metrics only."""
    from conftest import MemoryLogger

    class Picky(MemoryLogger):
        def log_metrics(self, metrics, step=None):
            if any(k.startswith("lnmonitor/") for k in metrics):
                raise OSError("disk full")
            super().log_metrics(metrics, step)

    mon = LayerNormMonitor(every_n_steps=1, images=False, summary=False)
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", logger=Picky(), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[mon])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(gpt(STEPS), loader(32, 4))
    assert trainer.global_step == STEPS
    assert mon.off_reason.startswith("OSError: disk full") and "during on_train_batch_end" in mon.off_reason
    assert sum("LayerNormMonitor is off" in str(w.message) for w in caught) == 1


# -- the plain loop --------------------------------------------------------------------


def test_every_public_method_of_the_loop_monitor_runs_inside_the_guard():
    public = {n for n, v in vars(LoopMonitor).items() if callable(v) and not n.startswith("_")}
    inside = set(entry_points(LoopMonitor))
    # detach is what the guard calls; the state is plain data to save and load, with nothing to trip
    assert public - {"step", "detach", "state_dict", "load_state_dict"} <= inside, public - inside


@pytest.mark.parametrize("entry", ["start", "stop"])
def test_an_exception_in_the_loop_monitor_turns_it_off_and_the_loop_goes_on(monkeypatch, entry):
    calls: list[str] = []
    _inject(monkeypatch, LoopMonitor, entry, calls)
    module = gpt(STEPS)
    monitor = LoopMonitor(module, every_n_steps=1, keep_history=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            with monitor.step(step):
                x, y = next(iter(loader(4, 4, seed=step)))
                module(x, y)[1].backward()
    assert calls == [entry] and f"during {entry}" in monitor.off_reason
    assert sum("LoopMonitor is off" in str(w.message) for w in caught) == 1
    assert not monitor.meter.measuring  # no hook left on the model


def test_the_users_exception_goes_through_and_the_loop_monitor_leaves_no_hook():
    module = gpt(STEPS)
    monitor = LoopMonitor(module, every_n_steps=1)
    with pytest.raises(Injected):
        with monitor.step(0):
            module(*next(iter(loader(4, 4))))[1].backward()
            raise Injected("the user's own")
    assert not monitor.meter.measuring and monitor.off_reason is None


# -- the transformers.Trainer callback -------------------------------------------------------


def _trainer_events(cls) -> set[str]:
    from transformers import TrainerCallback

    return {name for name in vars(TrainerCallback) if name.startswith("on_")
            and getattr(cls, name) is not getattr(TrainerCallback, name)}


def test_every_trainer_event_of_the_trainer_callback_runs_inside_the_guard():
    pytest.importorskip("transformers")
    from lnmonitor.integrations.transformers import LNMonitorCallback

    events = _trainer_events(LNMonitorCallback)
    inside = set(entry_points(LNMonitorCallback))
    assert events and events <= inside, events - inside


def _hf_fit(tmp_path, callback_factory):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    x = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": r, "labels": r} for r in x]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=STEPS, use_cpu=True,
        save_strategy="no", report_to=[], logging_steps=1, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:4])
    callback = callback_factory(trainer)
    trainer.add_callback(callback)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return trainer, callback, [str(w.message) for w in caught]


def _hf_events():
    try:
        from lnmonitor.integrations.transformers import LNMonitorCallback
    except ImportError:
        return []
    return sorted(_trainer_events(LNMonitorCallback))


@pytest.mark.parametrize("entry", _hf_events())
def test_an_exception_in_any_trainer_event_turns_the_callback_off_and_training_finishes(monkeypatch, tmp_path,
                                                                                        entry):
    from lnmonitor.integrations.transformers import LNMonitorCallback

    calls: list[str] = []
    _inject(monkeypatch, LNMonitorCallback, entry, calls)
    trainer, callback, said = _hf_fit(
        tmp_path, lambda t: LNMonitorCallback(t, every_n_steps=1, keep_history=True, probe_size=4))
    assert trainer.state.global_step == STEPS
    assert calls == [entry] and f"Injected: injected into {entry}" in callback.off_reason
    assert sum("LNMonitorCallback is off for the rest of this run" in s for s in said) == 1
    assert callback.meter is None or not callback.meter.measuring


# -- the parts -------------------------------------------------------------------------


def test_the_guard_names_the_cause_and_where_and_detaches_once():
    detached: list[int] = []

    class Monitor:
        configuration_errors = (KeyError,)

        def __init__(self):
            self.messages, self.off_reason, self.name = Messages(warn=said.append), None, "Monitor"

        def detach(self):
            detached.append(1)

        @guarded
        def entry(self, x):
            return {"a": 1}[x]

        @guarded(starts_run=True)
        def begin(self):
            return "on"

    said: list[str] = []
    monitor = Monitor()
    with pytest.raises(KeyError):  # a configuration error passes through and turns nothing off
        monitor.entry("b")
    assert monitor.off_reason is None
    monitor.entry([])  # a list is unhashable: TypeError, not a configuration error
    assert monitor.off_reason.startswith("TypeError") and "test_guard.py" in monitor.off_reason
    assert detached == [1] and len(said) == 1 and "Monitor is off" in said[0]
    assert monitor.entry("a") is None  # off
    assert monitor.begin() == "on" and monitor.off_reason is None  # a new run


def test_messages_warn_each_key_once_and_only_where_it_speaks():
    said: list[str] = []
    messages = Messages(info=said.append, warn=said.append)
    messages.warn("k", "one")
    messages.warn("k", "again")
    messages.info("info")
    messages.reset(speaks=False)
    messages.warn("k", "rank one")
    messages.info("rank one")
    assert said == ["one", "info"]


def test_history_keeps_rows_only_when_nothing_else_receives_them():
    kept = History(None)
    kept.reset(receivers=True)
    kept.add(0, {"a": 1.0})
    kept.reset(receivers=False)
    kept.add(0, {"a": 1.0})
    kept.add(0, {"b": 2.0}, extend=True)
    kept.add(1, {"a": 3.0}, extend=True)
    assert kept.rows == [{"step": 0, "a": 1.0, "b": 2.0}, {"step": 1, "a": 3.0}]
