"""Where the structural probes look: a model's residual blocks (:func:`find_blocks`), the branch through a
block's first norm (:func:`resolve_branch`) and the sequences the blocks and norms read
(:class:`SequenceCapture`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor, nn

from lnmonitor.core.hooks import Hooks
from lnmonitor.core.norms.find import NormInfo

__all__ = ["Branch", "SequenceCapture", "find_blocks", "resolve_branch"]


def find_blocks(model: nn.Module, norms: Sequence[NormInfo],
                blocks: str | None = None) -> list[tuple[str, nn.Module]]:
    """The residual blocks of ``model`` as ``(qualified name, module)``: the children of the ``nn.ModuleList``
    ``blocks`` names, else of the one whose children are of one class and each contain one of ``norms`` (the
    one with the most parameters if several).  Raises ValueError when there is none."""
    norm_ids = {id(info.module) for info in norms}
    modules = dict(model.named_modules())
    if blocks is not None:
        if blocks not in modules:
            raise ValueError(f"model has no submodule {blocks!r} (the residual blocks' ModuleList)")
        chosen = modules[blocks]
        if not isinstance(chosen, (nn.ModuleList, nn.Sequential)) or len(chosen) == 0:
            raise ValueError(f"{blocks!r} is a {type(chosen).__name__}, not a non-empty ModuleList")
        best = blocks
    else:
        best, best_size = None, -1
        for name, module in modules.items():
            if not isinstance(module, nn.ModuleList) or len(module) == 0:
                continue
            children = list(module)
            if len({type(c) for c in children}) != 1 or not all(
                any(id(m) in norm_ids for m in c.modules()) for c in children
            ):
                continue
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = name, size
        if best is None:
            raise ValueError("found no ModuleList of repeated blocks that contain a norm; name the residual "
                             "blocks' ModuleList explicitly (blocks='...')")
    return [(f"{best}.{i}" if best else str(i), b) for i, b in enumerate(modules[best])]


Branch = Callable[[nn.Module, Tensor], Tensor]


def resolve_branch(block: nn.Module, norms: Sequence[NormInfo],
                   branch: Sequence[str] | Branch | None = None) -> tuple[str, Branch]:
    """``(label, fn)`` with ``fn(block, h) -> branch output`` for the branch through the first norm.
    ``branch``: a callable, child names applied in order (e.g. ``("ln1", "attn")``), or None: the block's
    first child that is one of ``norms``, then the child registered right after it."""
    if callable(branch):
        return getattr(branch, "__name__", "branch"), branch
    children = dict(block.named_children())
    if branch is None:
        names = list(children)
        norm_ids = {id(info.module) for info in norms}
        first = next((i for i, n in enumerate(names) if id(children[n]) in norm_ids), None)
        if first is None or first + 1 >= len(names):
            raise ValueError(f"cannot find the branch through the first norm of {type(block).__name__}: it "
                             "needs a norm child followed by the sublayer it feeds; pass branch=('ln1', "
                             "'attn') or a callable")
        branch = (names[first], names[first + 1])
    path = tuple(branch)
    missing = [n for n in path if n not in children]
    if missing or not path:
        child = missing[0] if missing else "(empty path)"
        raise ValueError(f"{type(block).__name__} has no child {child!r}; its children are {list(children)}")

    def run(blk: nn.Module, h: Tensor) -> Tensor:
        sub = dict(blk.named_children())
        for n in path:
            h = sub[n](h)
        return h

    return " -> ".join(path), run


class SequenceCapture:
    """Temporary forward pre-hooks that keep the first sequence each block and norm reads. ``with
    SequenceCapture(blocks, norms) as cap: model(x)`` (or :meth:`attach` / :meth:`detach`) fills
    ``cap.blocks[name]`` and ``cap.norms[name]`` with a detached copy of sequence 0 of the module's first
    input, shape (T, d), from its first call. ``blocks``: ``(name, module)`` pairs; ``norms``:
    ``NormInfo``."""

    def __init__(self, blocks: Sequence[tuple[str, nn.Module]] = (), norms: Sequence = ()) -> None:
        self._targets = [("blocks", n, m) for n, m in blocks] + [("norms", i.name, i.module) for i in norms]
        self.blocks: dict[str, Tensor] = {}
        self.norms: dict[str, Tensor] = {}
        self._hooks = Hooks()

    def attach(self) -> None:
        if not self._hooks:
            for kind, name, module in self._targets:
                self._hooks.forward_pre(module, self._hook(kind, name))

    def detach(self) -> None:
        self._hooks.remove()

    def __enter__(self) -> SequenceCapture:
        self.attach()
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def _hook(self, kind: str, name: str):
        store = getattr(self, kind)

        def hook(module, args):
            x = args[0] if args else None
            if name in store or not isinstance(x, Tensor) or x.ndim < 2:
                return
            store[name] = x.detach().reshape(-1, x.shape[-2], x.shape[-1])[0].clone()

        return hook
