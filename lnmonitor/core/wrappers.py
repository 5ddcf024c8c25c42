"""The user's model inside the wrappers it runs in: Fabric's module, DDP, DeepSpeed's engine,
``torch.compile``, FSDP1/FSDP2, tensor parallelism, activation checkpointing.

* :func:`unwrap`, :func:`user_name`, :func:`model_class` and :func:`unknown_wrapper`: the model
  the user wrote, its norms' names as it qualifies them, its class name, whatever wraps it;
* :func:`compiled`: whether ``torch.compile``-d code drives it (hooks need it run eagerly);
* :func:`sharded` and :func:`fsdp1`: whether its forward is a collective every rank must join.
"""

from __future__ import annotations

from torch import Tensor, nn

from lnmonitor.core import zero3

__all__ = [
    "WRAPPER_NAMES", "compiled", "fsdp1", "model_class", "sharded", "unknown_wrapper", "unwrap", "user_name",
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


def _distributed(t: Tensor) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (FSDP2, tensor parallelism)."""
    return hasattr(t, "full_tensor")
