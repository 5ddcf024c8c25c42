"""The user's model inside the wrappers it runs in (Fabric, DDP, DeepSpeed, ``torch.compile``, FSDP,
tensor parallelism, activation checkpointing): the model, its names and class as the user wrote them,
whether compiled code drives it, whether its forward is a collective."""

from __future__ import annotations

from torch import nn

from lnmonitor.core import zero3

__all__ = [
    "WRAPPER_NAMES", "compiled", "fsdp1", "model_class", "sharded", "unknown_wrapper", "unwrap", "user_name",
]

# by class name, the attribute where a wrapper whose forward only passes the call on keeps the model
_OUTER_WRAPPERS = {"_FabricModule": "_forward_module", "DistributedDataParallel": "module",
                   "DataParallel": "module", "DeepSpeedEngine": "module"}
# what wrappers inside a model add to its qualified names (Fabric, torch.compile, FSDP1, checkpointing)
WRAPPER_NAMES = frozenset({"_forward_module", "_orig_mod", "_fsdp_wrapped_module",
                           "_checkpoint_wrapped_module"})


def compiled(module: nn.Module) -> bool:
    """Whether ``module`` is, contains or is driven by ``torch.compile``-d code (an ``OptimizedModule``,
    ``nn.Module.compile()``, Lightning's ``_compiler_ctx``)."""
    return bool(getattr(module, "_compiler_ctx", None)) or any(
        type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None
        for m in module.modules())


def sharded(module: nn.Module) -> bool:
    """Whether ``module`` holds parameters distributed across ranks (a ``DTensor``, FSDP1, ZeRO-3): its
    forward is then a collective every rank must join."""
    return any(hasattr(p, "full_tensor") for p in module.parameters()) or fsdp1(module) or zero3.holds(module)


def fsdp1(module: nn.Module) -> bool:
    """Whether ``module`` is or holds an FSDP1 ``FullyShardedDataParallel`` unit."""
    return any(type(m).__name__ == "FullyShardedDataParallel" for m in module.modules())


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside Fabric's module, (Distributed)DataParallel and DeepSpeed's engine (nested too),
    whose forwards only pass the call on; ``torch.compile``'s and FSDP's wrappers stay."""
    while (attr := _OUTER_WRAPPERS.get(type(model).__name__)) and isinstance(getattr(model, attr, None),
                                                                             nn.Module):
        model = getattr(model, attr)
    return model


def model_class(model: nn.Module) -> str:
    """The class name of the user's model inside every wrapper (``OptimizedModule`` -> ``TinyGPT``)."""
    model = unwrap(model)
    while inside := [m for name, m in model.named_children() if name in WRAPPER_NAMES]:
        model = unwrap(inside[0])
    return type(model).__name__


def user_name(name: str) -> str:
    """A qualified name without the parts :data:`WRAPPER_NAMES` add
    (``_orig_mod.h.0._fsdp_wrapped_module.ln_1`` -> ``h.0.ln_1``)."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)


def unknown_wrapper(model: nn.Module) -> str | None:
    """``"Class.attribute"`` when ``model`` looks like an unknown wrapper (no parameter of its own, one
    child in a private attribute), whose name would start every norm's; else None."""
    children = list(model.named_children())
    if (len(children) == 1 and children[0][0].startswith("_") and children[0][0] not in WRAPPER_NAMES
            and next(model.parameters(recurse=False), None) is None):
        return f"{type(model).__name__}.{children[0][0]}"
    return None
