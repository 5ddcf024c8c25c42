"""How lnmonitor touches a model without leaving a trace: :class:`Hooks` (every hook it registers, removed
together), :func:`unmeasured` (passes the norm taps ignore), :func:`eval_mode`, :func:`eager`
(``torch.compile``-d code ignores hooks added after it compiled) and :func:`restored` (a probe's passes:
all of these, with the train flags and the RNG state back after)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import Tensor, nn

__all__ = ["Hooks", "eager", "eval_mode", "measuring", "restored", "unmeasured"]


class Hooks:
    """Handles of the hooks lnmonitor registered, removed together by :meth:`remove` (idempotent) or
    on leaving a ``with Hooks() as hooks:`` block, whatever happens inside."""

    def __init__(self) -> None:
        self._handles: list = []

    def forward(self, module: nn.Module, fn: Callable) -> None:
        """``fn(module, args, output)`` after each forward of ``module`` (its return replaces the
        output), with an input that a pre-hook replaced by an alias of itself (FSDP2) as the caller
        passed it: the tensor whose gradient is all the model's."""
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

    def forward_pre(self, module: nn.Module, fn: Callable, prepend: bool = False,
                    with_kwargs: bool = False) -> None:
        """``fn(module, args)`` (``with_kwargs``: ``fn(module, args, kwargs)``) before each forward of
        ``module``; ``prepend``: before the hooks it has already (tensor parallelism's)."""
        self._handles.append(module.register_forward_pre_hook(fn, prepend=prepend, with_kwargs=with_kwargs))

    def forward_post(self, module: nn.Module, fn: Callable) -> None:
        """``fn(module, args, output)`` after each forward of ``module``, with the arguments it got."""
        self._handles.append(module.register_forward_hook(fn))

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
    """A context manager under which ``torch.compile``-d code runs eagerly, so that hooks fire (a no-op
    on a torch without ``set_stance``); it takes effect when created."""
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is None:  # pragma: no cover - torch < 2.6
        return contextlib.nullcontext()
    return set_stance("force_eager")


@contextlib.contextmanager
def restored(module: nn.Module, batch) -> Iterator[None]:
    """Eval mode, eager code and no tap for the duration; then the train flags and the RNG state (CPU
    and the batch's CUDA devices) back, each part undone even when entering a later one raises."""
    devices = sorted({t.device.index or 0 for t in _tensors(batch) if t.device.type == "cuda"})
    with eval_mode(module), torch.random.fork_rng(devices=devices), unmeasured(), eager():
        yield


def _tensors(batch):
    if isinstance(batch, Tensor):
        yield batch
    elif isinstance(batch, (Mapping, tuple, list)):
        for v in batch.values() if isinstance(batch, Mapping) else batch:
            yield from _tensors(v)


def _caller_tensor(seen: object, passed: object) -> object:
    """``passed`` where ``seen`` is an alias of it, else ``seen``."""
    if (isinstance(seen, Tensor) and isinstance(passed, Tensor) and seen is not passed
            and seen.data_ptr() == passed.data_ptr() and seen.dtype == passed.dtype
            and seen.shape == passed.shape and seen.stride() == passed.stride()):
        return passed
    return seen
