"""How lnmonitor touches a model without leaving a trace.

* :class:`Hooks`: the one door for every hook lnmonitor registers.  Its handles are
  kept together and removed together, on :meth:`Hooks.remove` or on leaving a ``with``
  block, also when the block raises (as TransformerLens's ``hooks()``).
* :func:`unmeasured`: forward passes run inside it are invisible to the norm taps (the
  invariance monitor's and the probes' own passes).
* :func:`eval_mode`: a module in eval mode for a while, every train flag restored after.
* :func:`restored`: a probe's passes leave no trace: eval mode, eager code, no tap, and the
  train flags and the RNG state back after.
* :func:`eager` and :func:`compiled`: ``torch.compile``-d code ignores hooks registered
  after it compiled, so lnmonitor runs such code eagerly while it measures.
* :func:`sharded`: whether a module's forward is a collective (FSDP), which every rank
  must join.
* :func:`float64_twin`: a module evaluated in float64 from a float64 copy of its
  parameters and buffers, without copying or changing the module itself, and without
  running any hook.
* :func:`unwrap`, :func:`user_name` and :func:`unknown_wrapper`: the user's model inside
  the wrappers of Fabric, DDP, ``torch.compile``, FSDP1 and activation checkpointing, and
  the norms' names as the user's model qualifies them, whatever wraps it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import Tensor, nn

from lnmonitor.core import dtensors, zero3

__all__ = [
    "WRAPPER_NAMES", "Hooks", "compiled", "eager", "eval_mode", "float64_state", "float64_twin", "fsdp1",
    "measuring", "model_class", "restored", "sharded", "unknown_wrapper", "unmeasured", "unwrap", "user_name",
]

# the attribute a wrapper whose forward is a plain call of the model keeps it in, by class name:
# Fabric's module (whose own forward adds precision and device moves), (Distributed)DataParallel,
# DeepSpeed's engine (ZeRO-3 gathers parameters in hooks on the model's own modules)
_OUTER_WRAPPERS = {"_FabricModule": "_forward_module", "DistributedDataParallel": "module",
                   "DataParallel": "module", "DeepSpeedEngine": "module"}
# what wrappers inside a model add to its qualified names: Fabric's module, torch.compile's
# OptimizedModule, FSDP1's units, activation checkpointing's wrapper
WRAPPER_NAMES = frozenset({"_forward_module", "_orig_mod", "_fsdp_wrapped_module",
                           "_checkpoint_wrapped_module"})


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
    ``fully_shard``, tensor parallelism; FSDP1; DeepSpeed ZeRO-3), so that its forward is a
    collective every rank must join."""
    return any(_distributed(p) for p in module.parameters()) or fsdp1(module) or zero3.holds(module)


def fsdp1(module: nn.Module) -> bool:
    """Whether ``module`` is or holds an FSDP1 unit (``FullyShardedDataParallel``: Lightning's
    ``FSDPStrategy``), whose units gather their parameters only inside the root's forward."""
    return any(type(m).__name__ == "FullyShardedDataParallel" for m in module.modules())


def float64_state(module: nn.Module) -> dict[str, Tensor]:
    """Float64 copies of ``module``'s floating-point parameters and buffers (on their
    device), by qualified name; a sharded ``DTensor`` or a partitioned ZeRO-3 parameter is
    gathered first (a collective: every rank must call this together)."""
    state = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        t = dtensors.unsharded(t).detach()
        state[name] = t.to(torch.float64) if t.is_floating_point() else t
    return state


def float64_twin(module: nn.Module) -> Callable[..., object]:
    """``twin(*args)``: ``module``'s forward evaluated with float64 copies of its parameters
    and buffers (``torch.func.functional_call``), invisible to the taps.  The module is
    neither copied nor changed, so this also works where ``deepcopy`` is refused (FSDP2).

    The twin calls ``module.forward`` itself, not the module: no hook registered on
    ``module`` runs (the user's forward hooks, the global module hooks, an FSDP2 unit's or a
    tensor-parallel norm's hooks that lay out tensors across ranks), so evaluating it has no
    side effect.  A sharded parameter (``DTensor``) is gathered into its copy first.
    Gradients flow to the inputs, not to the parameters."""
    state = {f"module.{name}": t for name, t in float64_state(module).items()}
    forward = _Forward(module)

    def twin(*args):
        with unmeasured():
            return torch.func.functional_call(forward, state, args)

    return twin


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside Fabric's ``_FabricModule``, ``DistributedDataParallel`` and DeepSpeed's
    ``DeepSpeedEngine`` (nested too: Fabric's DDP), which the user calls but whose forward only
    passes the call on.  Calling it runs the user's model without the wrapper's collectives (DDP's buffer
    broadcast) or precision.  ``torch.compile``'s and FSDP's wrappers stay (the model runs
    through them); :func:`user_name` takes their part out of the names."""
    while (attr := _OUTER_WRAPPERS.get(type(model).__name__)) and isinstance(getattr(model, attr, None),
                                                                             nn.Module):
        model = getattr(model, attr)
    return model


def model_class(model: nn.Module) -> str:
    """The class name of the user's model inside the wrappers of :func:`unwrap` and of
    :data:`WRAPPER_NAMES` (``torch.compile``'s ``OptimizedModule`` -> ``TinyGPT``): what a
    summary is titled with."""
    model = unwrap(model)
    inside = [m for name, m in model.named_children() if name in WRAPPER_NAMES]
    while inside:
        model = unwrap(inside[0])
        inside = [m for name, m in model.named_children() if name in WRAPPER_NAMES]
    return type(model).__name__


def user_name(name: str) -> str:
    """A qualified module name without the parts the wrappers of :data:`WRAPPER_NAMES` add
    (``_orig_mod.h.0._fsdp_wrapped_module.ln_1`` -> ``h.0.ln_1``): the same name on one device,
    compiled or not, and under FSDP1."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)


def unknown_wrapper(model: nn.Module) -> str | None:
    """``"Class.attribute"`` when ``model`` (unwrapped) looks like a wrapper lnmonitor does not
    know -- no parameter of its own and one child, kept in a private attribute -- whose name
    would then start every norm's name; else None."""
    children = list(model.named_children())
    if (len(children) == 1 and children[0][0].startswith("_") and children[0][0] not in WRAPPER_NAMES
            and next(model.parameters(recurse=False), None) is None):
        return f"{type(model).__name__}.{children[0][0]}"
    return None


def _caller_tensor(seen: object, passed: object) -> object:
    """``passed`` where ``seen`` is an alias of it, else ``seen``."""
    if (isinstance(seen, Tensor) and isinstance(passed, Tensor) and seen is not passed
            and seen.data_ptr() == passed.data_ptr() and seen.dtype == passed.dtype
            and seen.shape == passed.shape and seen.stride() == passed.stride()):
        return passed
    return seen


class _Forward(nn.Module):
    """``module.forward`` as a module of its own, called without any hook: neither those on
    ``module`` nor the global module hooks (its own ``__call__`` is its ``forward``)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module.forward(*args)

    def __call__(self, *args):
        return self.forward(*args)


def _distributed(t: Tensor) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (FSDP2, tensor parallelism)."""
    return hasattr(t, "full_tensor")

