"""The plain-loop door, :class:`lnmonitor.integrations.loop.LoopMonitor`, with real parts: the
user's model inside Fabric (one device; DDP on two gloo processes, slow) and ``torch.compile``,
the user's own hooks on its norms, a real ``SummaryWriter`` read back."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from conftest import fit, gpt, loader
from lightning.pytorch import Callback

from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor
from lnmonitor.core.meter import LadderMeter
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


# -- no side effect when a door is built (item 7) ---------------------------------------


class _CallsAtTrainStart(Callback):
    """What the user's hook had seen when training starts: after every monitor's setup."""

    def __init__(self, calls: list[str]) -> None:
        self.calls, self.seen = calls, None

    def on_train_start(self, trainer, pl_module) -> None:
        self.seen = list(self.calls)


def test_building_a_door_runs_no_hook_the_user_put_on_a_norm():
    """The float64 self-check of every norm (when a meter, a loop monitor or a Lightning
    monitor is set up) evaluates a float64 twin, never the user's module: a user's forward
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
                FinalNormInvarianceMonitor(every_n_steps=1, summary=False)]
    fit(module, loader(4, 4), [*monitors, recorder], 1)
    assert recorder.seen == []  # after LayerNormMonitor and FinalNormInvarianceMonitor set up
    assert calls  # then training ran the norms


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

    with pytest.warns(UserWarning, match=r"Shell looks like a wrapper lnmonitor does not know \(Shell._inner"):
        monitor = LoopMonitor(Shell(tiny()), every_n_steps=1)
    assert monitor.meter.norms[0].name == "_inner.blocks.0.ln1"  # measured all the same, under its name
