"""The plain-loop monitor, :class:`lnmonitor.integrations.loop.LoopMonitor`, with real parts: the
user's model inside Fabric (one device; DDP on two gloo processes, slow) and ``torch.compile``,
the user's own hooks on its norms, a real ``SummaryWriter`` read back."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from conftest import fit, fsdp1_units, gpt, loader
from lightning.pytorch import Callback

import lnmonitor
from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor
from lnmonitor.core.invariance.runs import FSDP1_REFUSED
from lnmonitor.core.meter.meter import LadderMeter
from lnmonitor.integrations.loop import LoopMonitor
from lnmonitor.tiny.model import GPTConfig, TinyGPT

VOCAB, CONTEXT = 16, 8


def tiny(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(GPTConfig(vocab_size=VOCAB, width=16, depth=2, heads=2, context=CONTEXT))


def tokens(rows: int = 4, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, CONTEXT), generator=torch.Generator().manual_seed(seed))


def counted(model: torch.nn.Module) -> list[str]:
    """A forward hook of the user's own on every norm of ``model`` (found without lnmonitor,
    whose discovery would check them, and remember it, before the hooks are there): the calls
    it saw."""
    calls: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.register_forward_hook(lambda m, a, o, n=name: calls.append(n))
    return calls


def _sigma_tags(monitor: LoopMonitor) -> set[str]:
    return {k for k in monitor.history[0] if k.startswith("lnmonitor/sigma/")}


# -- no side effect when a monitor is built (item 7) ---------------------------------------


class _CallsAtTrainStart(Callback):
    """What the user's hook had seen when training starts: after every monitor's setup."""

    def __init__(self, calls: list[str]) -> None:
        self.calls, self.seen = calls, None

    def on_train_start(self, trainer, pl_module) -> None:
        self.seen = list(self.calls)


def test_building_a_monitor_runs_no_hook_the_user_put_on_a_norm(tmp_path):
    """The float64 self-check of every norm (when a meter, a loop monitor or a Lightning
    monitor is set up) evaluates a float64 forward, never the user's module: a user's forward
    hook on a norm sees nothing until the user's own forward runs."""
    for build in (LadderMeter, LoopMonitor):
        model = tiny()  # a fresh model each time: a norm is checked once, then remembered
        calls = counted(model)
        build(model)
        assert calls == [], build.__name__
        model(tokens())
        assert len(calls) == 5  # the hook works: the user's forward reaches it
    module = gpt(steps=1)
    calls = counted(module)
    recorder = _CallsAtTrainStart(calls)
    monitors = [LayerNormMonitor(every_n_steps=1, images=False, summary=False),
                FinalNormInvarianceMonitor(invariance_every_n_steps=1, summary=False)]
    fit(module, loader(4, 4), [*monitors, recorder], 1)
    assert recorder.seen == []  # after LayerNormMonitor and FinalNormInvarianceMonitor set up
    assert calls  # then training ran the norms
    _the_trainer_callback_runs_no_user_hook_when_training_begins(tmp_path)


def _the_trainer_callback_runs_no_user_hook_when_training_begins(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    from lnmonitor.integrations.transformers import LNMonitorCallback

    class Recorder(transformers.TrainerCallback):
        seen = None

        def on_train_begin(self, args, state, control, **kwargs):
            Recorder.seen = list(calls)

    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    calls = counted(model)
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, use_cpu=True,
                                          per_device_train_batch_size=4, report_to=[], save_strategy="no",
                                          disable_tqdm=True)
    data = [{"input_ids": r, "labels": r} for r in x]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   callbacks=[LNMonitorCallback(), Recorder()])
    trainer.train()
    assert Recorder.seen == []  # after the Trainer callback's on_train_begin (meter and probe built)
    assert calls


# -- names of wrapped models (item 6) -------------------------------------------------


def _one_step(model, monitor: LoopMonitor, backward=None) -> None:
    x = tokens()
    with monitor.step(0):
        _, loss = model(x, x)
        (backward or torch.Tensor.backward)(loss)


def test_a_norms_name_is_the_users_models_own_under_fabric_and_torch_compile():
    plain = LoopMonitor(tiny(), every_n_steps=1)
    _one_step(plain.meter.model, plain)
    names = _sigma_tags(plain)
    assert "lnmonitor/sigma/blocks.0.ln1" in names and len(names) == 5

    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = tiny()
    wrapped, _ = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert type(wrapped).__name__ == "_FabricModule"
    under_fabric = LoopMonitor(wrapped, every_n_steps=1)
    _one_step(wrapped, under_fabric, fabric.backward)
    assert _sigma_tags(under_fabric) == names

    compiled = torch.compile(tiny(), backend="eager")
    under_compile = LoopMonitor(compiled, every_n_steps=1)
    _one_step(compiled, under_compile)
    assert _sigma_tags(under_compile) == names
    for tag in names:  # the same weights, the same numbers
        assert under_fabric.history[0][tag] == pytest.approx(plain.history[0][tag], rel=1e-6)
        assert under_compile.history[0][tag] == pytest.approx(plain.history[0][tag], rel=1e-6)


def test_a_wrapper_it_does_not_know_is_said_once_by_name():
    class Shell(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self._inner = inner

        def forward(self, *args):
            return self._inner(*args)

    said = r"Shell looks like a wrapper lnmonitor does not know \(Shell\._inner"
    with pytest.warns(UserWarning, match=said):
        monitor = LoopMonitor(Shell(tiny()), every_n_steps=1)
    assert monitor.meter.norms[0].name == "_inner.blocks.0.ln1"  # measured all the same, under its name


# -- parity with the other integrations (item 5) ---------------------------------------------


def _train(monitor: LoopMonitor, model, steps: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        monitor.start(step)
        x = tokens(seed=step)
        _, loss = model(x, x)
        loss.backward()
        monitor.stop()
        optimizer.step()
        optimizer.zero_grad()


def test_notes_and_the_summary_are_seen_by_default_and_logged_where_logging_shows_them(capsys, caplog):
    """Printed (standard error) when logging would not show them: pytest's own handler on the
    root logger, at WARNING, is such a configuration."""
    model = tiny()
    monitor = LoopMonitor(model, every_n_steps=2, max_steps=3, probe_batch=(tokens(2, seed=9),) * 2)
    _train(monitor, model, 3)
    out = capsys.readouterr().err
    assert out.count("LoopMonitor: the ladder has 5 rungs") == 1  # the rungs, said once
    assert out.count("lnmonitor summary: TinyGPT, end of training") == 1  # after the last step
    assert "final-norm invariance at step 2" in out and "scale sweep" in out  # the end point, swept
    monitor.close()  # the last step ended the run: nothing more
    assert capsys.readouterr().err == ""
    with caplog.at_level("INFO", logger="lnmonitor"):  # logging shows lnmonitor's notes: there, once
        model = tiny()
        _train(LoopMonitor(model, every_n_steps=2, max_steps=1, invariance_every_n_steps=None), model, 1)
    assert capsys.readouterr().err == ""
    assert sum("the ladder has 5 rungs" in r.getMessage() for r in caplog.records) == 1


def test_close_ends_a_run_of_unknown_length_at_the_point_after_its_last_update(capsys):
    model = tiny()
    monitor = LoopMonitor(model, every_n_steps=2, invariance_every_n_steps=2,
                          probe_batch=(tokens(2, seed=9),) * 2, keep_history=True)
    _train(monitor, model, 3)
    assert "lnmonitor summary" not in capsys.readouterr().err  # no end known yet
    monitor.close()
    monitor.close()
    assert capsys.readouterr().err.count("lnmonitor summary: TinyGPT, end of training") == 1
    probed = [h["step"] for h in monitor.history if "lnmonitor/invariance/shift_5/dloss" in h]
    assert probed == [0, 2, 3]  # every second step, and after the last update (3 updates done)
    assert "lnmonitor/invariance/scale_rounding_points" in monitor.history[-1]  # with the sweep
    assert monitor.last_invariance.sweep and monitor.invariance_off_reason is None


def test_a_probe_that_fails_is_said_once_and_training_goes_on():
    def broken(model, batch):
        raise KeyError("labels")

    model = tiny()
    monitor = LoopMonitor(model, every_n_steps=1, max_steps=3, invariance_every_n_steps=1,
                          probe_batch=(tokens(2),), loss_fn=broken, keep_history=True, summary=False)
    said = r"invariance probe is off for the rest of this run: KeyError: 'labels'"
    with pytest.warns(UserWarning, match=said) as caught:
        _train(monitor, model, 3)
    assert sum("invariance probe is off" in str(w.message) for w in caught) == 1
    assert [h["step"] for h in monitor.history] == [0, 1, 2]  # the ladder went on
    assert "KeyError" in monitor.invariance_off_reason


def test_an_fsdp1_model_turns_the_loop_monitors_probe_off_saying_why_and_the_ladder_goes_on():
    # the same refusal as the Lightning callback's (Fabric's FSDPStrategy wraps blocks in FSDP1 units)
    model = tiny()
    with fsdp1_units(model.blocks), pytest.warns(UserWarning, match="FSDP1 units") as caught:
        monitor = LoopMonitor(model, every_n_steps=1, max_steps=2, invariance_every_n_steps=1,
                              probe_batch=(tokens(2, seed=9),) * 2, keep_history=True, summary=False)
        _train(monitor, model, 2)
    assert monitor.invariance_off_reason == FSDP1_REFUSED
    assert sum(FSDP1_REFUSED in str(w.message) for w in caught) == 1
    assert [h["step"] for h in monitor.history] == [0, 1]  # the ladder went on, every norm in it
    assert all(f"lnmonitor/sigma/{name}" in monitor.history[-1] for name in (
        "blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2", "lnf"))


# -- nanoGPT's shape (item 9) ------------------------------------------------------


def test_the_example_in_nanogpts_shape_measures_its_last_iter_num(tmp_path):
    """nanoGPT runs iter_num 0..max_iters inclusive: with max_steps=max_iters + 1 its last step,
    iter_num == max_iters, is measured and probed with the sweep."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import events

    example = Path(__file__).parent.parent / "examples" / "plain_loop.py"
    proc = subprocess.run([sys.executable, str(example), "--max-iters", "4", "--out", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    acc = events(tmp_path / "plain_loop")
    steps = lambda tag: [e.step for e in acc.Scalars(tag)]  # noqa: E731
    assert steps("train/loss") == [0, 1, 2, 3, 4]
    assert steps("lnmonitor/ladder/attenuation") == [0, 4]  # every 4th, and the last: iter_num 4
    assert steps("lnmonitor/invariance/scale_rounding_points") == [4]  # the end point has the sweep
    assert steps("lnmonitor/invariance/axis_5/dloss") == [0, 4]
    assert [e.step for e in acc.Images("lnmonitor/ladder_over_training")] == [4]
    assert proc.stderr.count("lnmonitor summary: TinyGPT, end of training") == 1


def _fabric_script(out, processes: int) -> dict:
    """tests/fabric_ddp_script.py in one process, or in ``processes`` under torchrun (gloo)."""
    from conftest import run_script

    return run_script("fabric_ddp_script.py", out, processes)


@pytest.mark.slow
def test_under_fabric_ddp_the_names_and_numbers_are_one_processs(tmp_path):
    """Fabric DDP on two gloo processes, four rows each: the tags are the model's own names (not
    ``_forward_module.module....``), every measured step merges the 8 rows, the numbers are one
    process's on all 8, and rank zero's invariance probe (on the model inside DDP, alone) neither
    hangs nor fails."""
    two = _fabric_script(tmp_path / "two.json", 2)
    one = _fabric_script(tmp_path / "one.json", 1)
    assert two["world"] == 2 and one["world"] == 1
    assert two["off"] is None and two["invariance_off_reason"] is None
    assert two["rows"] == one["rows"] == [8 * CONTEXT] * 5
    assert [h["step"] for h in two["history"]] == [h["step"] for h in one["history"]]
    for a, b in zip(two["history"], one["history"], strict=True):
        assert a.keys() == b.keys()
        assert not any("_forward_module" in k or ".module." in k for k in a)
        for tag, value in a.items():
            if tag != "step":
                assert b[tag] == pytest.approx(value, rel=1e-2, abs=1e-3), tag
    assert any("lnmonitor/sigma/blocks.0.ln1" in h for h in two["history"])
    assert any("lnmonitor/invariance/axis_5/dloss" in h for h in two["history"])


# -- skipped_rows means faults (item 8) ------------------------------------------------


def test_a_healthy_causal_lm_skips_no_row_and_counts_its_last_tokens_apart(capsys):
    """GPT-2 with labels: the last token of each sequence has no target, so every norm's row
    there gets exactly zero gradient, as at the final norm. Those rows are zero_grad_rows (one per
    sequence, said once), and skipped_rows, the faults, is 0."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    monitor = LoopMonitor(model, every_n_steps=1, invariance_every_n_steps=None, keep_history=True)
    x = torch.randint(0, 64, (6, 16), generator=torch.Generator().manual_seed(1))
    for step in range(2):
        with monitor.step(step):
            model(input_ids=x, labels=x).loss.backward()
    norms = [n.name for n in monitor.meter.norms]
    assert len(norms) == 5
    for h in monitor.history:
        for name in norms:
            assert h[f"lnmonitor/skipped_rows/{name}"] == 0, name
            assert h[f"lnmonitor/zero_grad_rows/{name}"] == 6, name  # one per sequence
    for s in monitor.last_result.row_stats:
        assert s.share_rows == 6 * 15 and s.rows == 6 * 16
    assert capsys.readouterr().err.count("carry no gradient because their position has no target") == 1


def test_the_loop_monitor_refuses_nonsense_and_survives_a_failing_writer():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    with pytest.raises(ValueError, match="every_n_steps must be a positive integer"):
        LoopMonitor(model, every_n_steps=0)
    with pytest.raises(TypeError, match="writer must be a SummaryWriter, a callable"):
        LoopMonitor(model, writer="runs/x")

    def broken(metrics, step):
        raise OSError("disk full")

    monitor = LoopMonitor(model, broken, every_n_steps=1, keep_history=True)
    with pytest.warns(UserWarning, match="the writer failed.*disk full"):
        for step in range(2):
            with monitor.step(step):
                model(torch.randn(4, 8)).square().sum().backward()
    assert [h["step"] for h in monitor.history] == [0, 1]  # measuring went on


def test_under_torch_compile_the_summary_names_the_users_model_class(capsys):
    model = tiny()
    compiled = torch.compile(model, backend="eager")  # an OptimizedModule, compiled without inductor
    monitor = LoopMonitor(compiled, every_n_steps=1, max_steps=1, invariance_every_n_steps=None)
    _train(monitor, compiled, 1)
    out = capsys.readouterr().err
    assert "lnmonitor summary: TinyGPT, end of training" in out and "OptimizedModule" not in out


def test_the_probe_checks_the_meters_final_norm_among_the_meters_norms():
    """One final-norm rule: the probe takes the norm the meter's roles call final, among the norms
    the meter measures (``include``/``exclude`` apply to both); excluding the final norm leaves the
    probe a last norm whose input flows on past it, which it refuses, saying why."""
    model = tiny()
    monitor = LoopMonitor(model, every_n_steps=1, max_steps=2, invariance_every_n_steps=1,
                          probe_batch=(tokens(2, seed=9),) * 2, keep_history=True, summary=False)
    _train(monitor, model, 2)
    assert monitor.meter.final == "lnf" and monitor._runs.prober.final_norm == "lnf"
    names = [n.name for n in monitor._runs.prober.norms]
    assert names == [n.name for n in monitor.meter.norms] and monitor.invariance_off_reason is None
    model = tiny()
    monitor = LoopMonitor(model, every_n_steps=1, max_steps=2, invariance_every_n_steps=1, exclude="lnf",
                          probe_batch=(tokens(2, seed=9),) * 2, keep_history=True, summary=False)
    with pytest.warns(UserWarning, match="is not a final norm"):
        _train(monitor, model, 2)
    assert monitor.meter.final is None and "blocks.1.ln2" in monitor.invariance_off_reason
    assert not any("lnmonitor/invariance/shift_5/dloss" in h for h in monitor.history)


def test_beside_a_layernorm_monitor_the_invariance_monitor_probes_the_meters_final_norm():
    monitor = LayerNormMonitor(every_n_steps=1, exclude="model.blocks.0.*")
    invariance = FinalNormInvarianceMonitor(invariance_every_n_steps=1, probe_batch=(tokens(2, seed=9),) * 2)
    fit(gpt(), loader(8, 4), [monitor, invariance], 2)
    assert invariance._prober.meter is monitor.meter and invariance._prober.final_norm == monitor.meter.final
    assert not any(n.name.startswith("model.blocks.0.") for n in invariance._prober.norms)



def test_a_final_norm_the_invariance_monitor_names_is_probed_though_the_ladder_leaves_it_out():
    """The monitors with one meter refuse a named final norm that include/exclude leave out; in
    Lightning the invariance monitor names its own, and the probe measures it all the same."""
    monitor = LayerNormMonitor(every_n_steps=1, exclude="model.lnf")
    invariance = FinalNormInvarianceMonitor(invariance_every_n_steps=1, final_norm="model.lnf",
                                            probe_batch=(tokens(2, seed=9),) * 2)
    fit(gpt(), loader(8, 4), [monitor, invariance], 2)
    assert invariance.off_reason is None and invariance._prober.final_norm == "model.lnf"
    assert invariance.last_result is not None


def test_a_resumed_loop_logs_no_step_twice_and_raises_no_finding_twice():
    """nanoGPT's resume: the checkpoint saved at iter 2 holds ``monitor.state_dict()``; the new
    process's monitor loads it and runs iter 2 again.  Step 2, logged before the save, is not
    logged again; the finding raised before is not raised again, and the growth is still judged
    from the first run's step 0."""
    model, x = tiny(), tokens()
    seen: list = []

    def run(steps, state=None):
        monitor = LoopMonitor(model, every_n_steps=1, keep_history=True, invariance_every_n_steps=None,
                              findings={"stream_growth": 1e-3}, on_finding=seen.append, summary=False)
        if state is not None:
            monitor.load_state_dict(state)
        for step in steps:
            with monitor.step(step):
                model(x, x)[1].backward()
        return monitor

    with pytest.warns(lnmonitor.HealthWarning):
        first = run(range(3))
    saved = first.state_dict()
    assert saved["last_logged_step"] == 2 and saved["findings"]["start"][0] == 0
    resumed = run(range(2, 5), copy.deepcopy(saved))
    assert [h["step"] for h in resumed.history] == [3, 4]
    assert len(seen) == 1 and resumed.findings.start == first.findings.start
    assert resumed.state_dict()["last_logged_step"] == 4
    with pytest.raises(TypeError, match="takes the dict LoopMonitor.state_dict"):
        resumed.load_state_dict(None)
