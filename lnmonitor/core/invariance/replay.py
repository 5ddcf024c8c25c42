"""Replay the part of a forward that runs before one module, so that later passes skip it.

:class:`PrefixReplay` records, during one pass, the outputs of the calls that finish before ``stop`` starts
and are made directly by the code around it (the calls whose innermost enclosing call is one of ``stop``'s
ancestors, or that have none: a transformer's embeddings and blocks, an encoder-decoder's encoder), cloned
within a memory ``budget``; later passes return clones of them instead of running those calls.  The passes
must run the same batch deterministically.  :meth:`PrefixReplay.faithful` checks each time that a replayed
pass gives the recorded loss and logits to the bit; the probe replays only then.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import Tensor, nn

from lnmonitor.core.hooks import Hooks

__all__ = ["REPLAY_BUDGET", "PrefixReplay"]

# bytes of recorded outputs at most (on a GPU also at most a quarter of its free memory)
REPLAY_BUDGET = 1 << 30


def _clone(out):
    """``out`` with every tensor cloned: tuples (named too), lists and mappings (``ModelOutput`` too) are
    rebuilt, other objects shared."""
    if isinstance(out, Tensor):
        return out.clone()
    if isinstance(out, tuple):
        items = [_clone(v) for v in out]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    if isinstance(out, list):
        return [_clone(v) for v in out]
    if isinstance(out, Mapping):
        cloned = copy.copy(out)
        for key, value in out.items():
            cloned[key] = _clone(value)
        return cloned
    return out


def _bytes(out) -> int:
    if isinstance(out, Tensor):
        return out.numel() * out.element_size()
    if isinstance(out, (tuple, list)):
        return sum(_bytes(v) for v in out)
    if isinstance(out, Mapping):
        return sum(_bytes(v) for v in out.values())
    return 0


class PrefixReplay:
    """Record the calls of ``model`` that finish before ``stop`` first starts (``with replay.recording():
    run()``); replay them in later passes (``with replay.replaying(): run()``)."""

    def __init__(self, model: nn.Module, stop: nn.Module, budget: int = REPLAY_BUDGET) -> None:
        self.model, self.stop, self.budget = model, stop, budget
        self.outputs: dict[tuple[nn.Module, int], object] = {}  # (module, call) -> cloned output
        names = {m: n for n, m in model.named_modules()}
        stop_name = names.get(stop)
        self._around = set() if stop_name is None else {
            m for m, n in names.items() if n == "" or stop_name.startswith(n + ".")}

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record during the block: every submodule's calls are followed (two hooks each)."""
        self.outputs = {}
        open_calls: list[tuple[nn.Module, int]] = []
        counts: dict[nn.Module, int] = {}
        direct: set[tuple[nn.Module, int]] = set()  # calls made by the code around ``stop``
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        free = torch.cuda.mem_get_info(device)[0] // 4 if device.type == "cuda" else self.budget
        state = {"started": False, "left": min(self.budget, free)}

        def before(module, args) -> None:
            if module is self.stop:
                state["started"] = True
            call = (module, counts.get(module, 0))
            counts[module] = call[1] + 1
            if not (state["started"] or open_calls):  # ancestors are not followed: none is open
                direct.add(call)
            open_calls.append(call)

        def after(module, args, output) -> None:
            call = open_calls.pop() if open_calls else None
            if call not in direct or state["started"]:
                return
            try:
                size = _bytes(output)
                if size <= state["left"]:
                    self.outputs[call] = _clone(output)
                    state["left"] -= size
            except Exception:  # noqa: BLE001 - an output it cannot copy: that call runs in every pass
                pass

        with Hooks() as hooks:
            for module in self.model.modules():
                if module not in self._around:  # an ancestor of ``stop`` is never finished before it
                    hooks.forward_pre(module, before)
                    hooks.forward_post(module, after)
            yield

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """During the block (one pass), the recorded calls return (clones of) their recorded outputs."""
        patched: list[tuple[nn.Module, bool, object]] = []
        try:
            for module in {m for m, _ in self.outputs}:
                had = "forward" in module.__dict__
                patched.append((module, had, module.__dict__.get("forward")))
                module.forward = self._replayed(module, module.forward)
            yield
        finally:
            for module, had, forward in patched:
                if had:
                    module.forward = forward
                else:
                    del module.forward

    def _replayed(self, module: nn.Module, forward: Callable) -> Callable:
        calls = [0]

        def replayed(*args, **kwargs):
            call = (module, calls[0])
            calls[0] += 1
            if call in self.outputs:
                return _clone(self.outputs[call])
            return forward(*args, **kwargs)

        return replayed

    def faithful(self, run: Callable[[], tuple[Tensor, Tensor | None]],
                 recorded: tuple[Tensor, Tensor | None]) -> bool:
        """Whether ``run()`` (the recorded pass's ``(loss, logits)``) replayed gives ``recorded`` to the bit
        (and raises nothing); when not, the recorded outputs are dropped."""
        if not self.outputs:
            return False
        try:
            with self.replaying():
                loss, logits = run()
            base = recorded[1]  # torch.equal: False for different shapes
            same = torch.equal(loss, recorded[0]) and (
                logits is None if base is None else logits is not None and torch.equal(logits, base))
        except Exception:  # noqa: BLE001 - code that cannot run replayed runs whole
            same = False
        if not same:
            self.outputs = {}
        return same
