"""How lnmonitor touches a model without leaving a trace.

* :class:`Hooks`: the one door for every hook lnmonitor registers.  Its handles are
  kept together and removed together, on :meth:`Hooks.remove` or on leaving a ``with``
  block, also when the block raises (as TransformerLens's ``hooks()``).
* :func:`unmeasured`: forward passes run inside it are invisible to the norm taps (the
  invariance monitor's and the probes' own passes).
* :func:`eval_mode`: a module in eval mode for a while, every train flag restored after.
* :func:`eager` and :func:`compiled`: ``torch.compile``-d code ignores hooks registered
  after it compiled, so lnmonitor runs such code eagerly while it measures.
* :func:`sharded`: whether a module's forward is a collective (FSDP), which every rank
  must join.
* :func:`float64_twin`: a module evaluated in float64 from a float64 copy of its
  parameters and buffers, without copying or changing the module itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

__all__ = [
    "Hooks", "compiled", "eager", "eval_mode", "float64_state", "float64_twin", "measuring", "sharded",
    "unmeasured",
]


class Hooks:
    """Handles of the hooks lnmonitor registered, removed together.

    ``with Hooks() as hooks: hooks.forward(module, fn); model(x)`` removes every hook on
    leaving the block, whatever happens inside; outside a ``with`` block call
    :meth:`remove` (idempotent).
    """

    def __init__(self) -> None:
        self._handles: list = []

    def forward(self, module: nn.Module, fn: Callable) -> None:
        """``fn(module, args, output)`` after each forward of ``module`` (what it returns
        replaces the output).  An input that a pre-hook replaced by an alias of itself (same
        storage, shape, strides and dtype: FSDP2 on the inputs of a module that is its own
        unit) reaches ``fn`` as the caller passed it: the same values, and the tensor whose
        gradient is all the model's, not only what comes back through ``module``."""
        calls: list[tuple] = []  # a stack: a call that raises leaves its entry, the next pops its own

        def before(_module, args) -> None:
            calls.append(args)

        def after(module, args, output):
            caller = calls.pop() if calls else ()
            if len(caller) == len(args):
                args = tuple(map(_caller_tensor, args, caller))
            return fn(module, args, output)

        self._handles.append(module.register_forward_pre_hook(before, prepend=True))
        self._handles.append(module.register_forward_hook(after))

    def forward_pre(self, module: nn.Module, fn: Callable) -> None:
        self._handles.append(module.register_forward_pre_hook(fn))

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def __bool__(self) -> bool:
        return bool(self._handles)

    def __enter__(self) -> Hooks:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


_QUIET = [0]


@contextlib.contextmanager
def unmeasured() -> Iterator[None]:
    """Forward passes run inside this context are invisible to every norm tap."""
    _QUIET[0] += 1
    try:
        yield
    finally:
        _QUIET[0] -= 1


def measuring() -> bool:
    """False inside :func:`unmeasured`: a tap's forward hook then ignores the call."""
    return _QUIET[0] == 0


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode for the duration; then every submodule's train flag back."""
    flags = [(m, m.training) for m in module.modules()]
    try:
        module.eval()
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def eager():
    """A context manager under which ``torch.compile``-d code runs eagerly, so that module
    hooks fire (``torch.compiler.set_stance("force_eager")``; a no-op context on a torch
    without it).  It takes effect when created and restores the previous stance on exit."""
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is None:  # pragma: no cover - torch < 2.6
        return contextlib.nullcontext()
    return set_stance("force_eager")


def compiled(module: nn.Module) -> bool:
    """Whether ``module`` is, contains or is driven by ``torch.compile``-d code that
    lnmonitor can see: an ``OptimizedModule``, ``nn.Module.compile()``, or a
    LightningModule compiled with ``torch.compile`` (Lightning's ``_compiler_ctx``)."""
    if getattr(module, "_compiler_ctx", None):
        return True
    for m in module.modules():
        if type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None:
            return True
    return False


def sharded(module: nn.Module) -> bool:
    """Whether ``module`` holds parameters distributed across ranks (a ``DTensor``: FSDP2's
    ``fully_shard``, tensor parallelism; or FSDP1), so that its forward is a collective every
    rank must join."""
    return (any(_distributed(p) for p in module.parameters())
            or any(type(m).__name__ == "FullyShardedDataParallel" for m in module.modules()))


def float64_state(module: nn.Module) -> dict[str, Tensor]:
    """Float64 copies of ``module``'s floating-point parameters and buffers (on their
    device), by qualified name; a sharded ``DTensor`` is gathered first (a collective:
    every rank must call this together)."""
    state = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if _distributed(t):
            t = t.full_tensor()
        t = t.detach()
        state[name] = t.to(torch.float64) if t.is_floating_point() else t
    return state


def float64_twin(module: nn.Module) -> Callable[..., object]:
    """``twin(*args)``: ``module``'s forward evaluated with float64 copies of its parameters
    and buffers (``torch.func.functional_call``), invisible to the taps.  The module is
    neither copied nor changed, so this also works where ``deepcopy`` is refused (FSDP2).
    A module whose parameters are distributed (``DTensor``: an FSDP2 unit, ``fully_shard(norm)``,
    or a tensor-parallel one such as a ``SequenceParallel`` norm) is called without its hooks,
    which lay out tensors across ranks (gather the shards the copies replace, shard the
    input): its own ``forward`` on the gathered copies.  Gradients flow to the inputs, not to
    the parameters."""
    state = float64_state(module)
    if any(_distributed(p) for p in module.parameters()):
        module = _Forward(module)
        state = {f"module.{name}": t for name, t in state.items()}

    def twin(*args):
        with unmeasured():
            return torch.func.functional_call(module, state, args)

    return twin


def _caller_tensor(seen: object, passed: object) -> object:
    """``passed`` where ``seen`` is an alias of it, else ``seen``."""
    if (isinstance(seen, Tensor) and isinstance(passed, Tensor) and seen is not passed
            and seen.data_ptr() == passed.data_ptr() and seen.dtype == passed.dtype
            and seen.shape == passed.shape and seen.stride() == passed.stride()):
        return passed
    return seen


class _Forward(nn.Module):
    """``module.forward`` as a module of its own: called without the hooks on ``module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module.forward(*args)


def _distributed(t: Tensor) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (FSDP2, tensor parallelism)."""
    return hasattr(t, "full_tensor")

