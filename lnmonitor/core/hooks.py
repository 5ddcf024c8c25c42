"""How lnmonitor touches a model without leaving a trace.

* :class:`Hooks`: the one place every hook lnmonitor registers goes through.  Its handles are
  kept together and removed together, on :meth:`Hooks.remove` or on leaving a ``with``
  block, also when the block raises (as TransformerLens's ``hooks()``).
* :func:`unmeasured`: forward passes run inside it are invisible to the norm taps (the
  invariance monitor's and the probes' own passes).
* :func:`eval_mode`: a module in eval mode for a while, every train flag restored after.
* :func:`restored`: a probe's passes leave no trace: eval mode, eager code, no tap, and the
  train flags and the RNG state back after.
* :func:`eager`: ``torch.compile``-d code ignores hooks registered after it compiled, so
  lnmonitor runs such code eagerly while it measures.

What wraps a model is :mod:`lnmonitor.core.wrappers`; its float64 reference is
:mod:`lnmonitor.core.float64`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import Tensor, nn

__all__ = ["Hooks", "eager", "eval_mode", "measuring", "restored", "unmeasured"]

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

    def forward_pre(self, module: nn.Module, fn: Callable, prepend: bool = False,
                    with_kwargs: bool = False) -> None:
        """``fn(module, args)`` before each forward of ``module`` (``fn(module, args, kwargs)``
        ``with_kwargs``); ``prepend``: before the hooks it has already (tensor parallelism's,
        which lay its input out as a ``DTensor``)."""
        self._handles.append(module.register_forward_pre_hook(fn, prepend=prepend, with_kwargs=with_kwargs))

    def forward_post(self, module: nn.Module, fn: Callable) -> None:
        """``fn(module, args, output)`` after each forward of ``module``, with the arguments as
        the module got them (:meth:`forward` gives them as its caller passed them)."""
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
    """A context manager under which ``torch.compile``-d code runs eagerly, so that module
    hooks fire (``torch.compiler.set_stance("force_eager")``; a no-op context on a torch
    without it).  It takes effect when created and restores the previous stance on exit."""
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is None:  # pragma: no cover - torch < 2.6
        return contextlib.nullcontext()
    return set_stance("force_eager")


@contextlib.contextmanager
def restored(module: nn.Module, batch) -> Iterator[None]:
    """Eval mode, eager code and no tap for the duration; then every submodule's train
    flag and the torch RNG state (CPU and the batch's CUDA devices) back as they were.
    Each part is undone even when entering a later one raises."""
    devices = sorted({t.device.index or 0 for t in _tensors(batch) if t.device.type == "cuda"})
    with contextlib.ExitStack() as stack:
        stack.enter_context(eval_mode(module))
        stack.enter_context(torch.random.fork_rng(devices=devices))
        stack.enter_context(unmeasured())
        stack.enter_context(eager())
        yield


def _tensors(batch):
    if isinstance(batch, Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for v in batch.values():
            yield from _tensors(v)
    elif isinstance(batch, (tuple, list)):
        for v in batch:
            yield from _tensors(v)


def _caller_tensor(seen: object, passed: object) -> object:
    """``passed`` where ``seen`` is an alias of it, else ``seen``."""
    if (isinstance(seen, Tensor) and isinstance(passed, Tensor) and seen is not passed
            and seen.data_ptr() == passed.data_ptr() and seen.dtype == passed.dtype
            and seen.shape == passed.shape and seen.stride() == passed.stride()):
        return passed
    return seen
