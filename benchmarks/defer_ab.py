"""The norms' backward work where it is done now (in each norm's hook) against deferred to the step's end.

Issue 36 asked whether the per-norm work of the backward would cost less done once at the step's end.
This runs the same TinyGPT forward and backward three ways, in turn (each in each place of the turn
equally often): ``plain`` (no tap), ``in the hook`` (:class:`NormTap` as it is: each LayerNorm's passes
over ``dL/dy`` and ``dL/dx`` run in its backward hook, while autograd has just written them) and
``deferred`` (the hook only keeps those tensors; the same passes run for every call in ``collect()``,
after the backward: the same rows to the bit, checked) and ``batched`` (kept the same way, then each
pass run once over all calls stacked: ``bmm`` for ``mv``, so the rows agree to float32 rounding,
checked).  Reported: each one's extra time over the plain pass of its turn, ``collect()`` included
(medians over turns), and each deferred one's ratio to the hook's.  Both deferred ways keep two
activation-sized tensors per norm until the step ends.

    python benchmarks/defer_ab.py --shapes 64,2,12 128,4,32 --pairs 300
"""

from __future__ import annotations

import sys

import torch

from lnmonitor.core.maths.reductions import layernorm_backward_raw
from lnmonitor.core.meter.taps import NormTap

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from side_by_side import in_turns, measured_model, shapes_of, shapes_parser, timed_step  # noqa: E402


class DeferredTap(NormTap):
    """:class:`NormTap` whose LayerNorm hooks keep ``dL/dy``, ``dL/dx`` and the saved statistics
    and whose :meth:`collect` runs the passes the hooks would have run, call by call, in order."""

    def __init__(self, norms) -> None:
        super().__init__(norms)
        self._kept: list[tuple] = []

    def _node_hook(self, index, info, pending):
        def hook(grad_inputs, grad_outputs) -> None:
            x, (mean, rstd), gain, keep = self._take(pending)
            g, dx = grad_outputs[0], grad_inputs[0]
            self._kept.append((index, info, g, dx, mean, rstd, gain, keep, x.shape[-1]))

        return hook

    def collect(self):
        for index, info, g, dx, mean, rstd, gain, keep, d in self._kept:
            eps = info.eps(g.dtype)
            self._eps[index] = eps
            args = (g, dx, mean, rstd, gain, self._scratch(1, g.numel() // d, d, g.device))
            self._run(layernorm_backward_raw, args, ("layernorm", eps, d), keep, index, d, eps, info)
        self._kept = []
        return super().collect()


class BatchedTap(DeferredTap):
    """:class:`DeferredTap` whose :meth:`collect` runs each pass once over every kept call, stacked
    (calls of one width and row count, as a TinyGPT's are)."""

    def collect(self):
        if self._kept:
            d = self._kept[0][8]
            g = torch.stack([k[2].reshape(-1, d) for k in self._kept])
            gains = torch.stack([k[6].detach().reshape(-1) for k in self._kept])
            sw = torch.bmm(g, gains.unsqueeze(-1)).squeeze(-1)
            wn = torch.linalg.vector_norm(g.mul_(gains.unsqueeze(1)), dim=-1)
            dxn = torch.linalg.vector_norm(torch.stack([k[3].reshape(-1, d) for k in self._kept]), dim=-1)
            rstd = torch.stack([k[5].reshape(-1) for k in self._kept])
            mean = torch.stack([k[4].reshape(-1) for k in self._kept])
            for j, (index, info, g, _, _, _, _, keep, d) in enumerate(self._kept):
                eps = info.eps(g.dtype)
                self._eps[index] = eps
                raw = (rstd[j], mean[j], sw[j], wn[j], dxn[j])
                self._keep_raw(raw, ("layernorm", eps, d), keep, index, d, eps, info)
        self._kept = []
        return NormTap.collect(self)


def compare(width: int, depth: int, batch: int, pairs: int) -> str:
    model, x, meter = measured_model(width, depth, batch)
    own = meter._tap
    taps = {"in the hook": NormTap(own.norms), "deferred": DeferredTap(own.norms),
            "batched": BatchedTap(own.norms)}

    def step(mode: str) -> tuple[float, object]:
        if mode == "plain":
            return timed_step(model, x, None)
        meter._tap = taps[mode]
        return timed_step(model, x, meter, collect_timed=True)  # the deferred work runs in collect()

    now, later, stacked = step("in the hook")[1], step("deferred")[1], step("batched")[1]
    if not (torch.equal(now.data, later.data) and now.records == later.records):
        raise SystemExit("the deferred tap leaves different rows")
    if not (torch.allclose(now.data, stacked.data, rtol=1e-4, atol=1e-6, equal_nan=True)
            and now.records == stacked.records):
        raise SystemExit("the batched tap leaves other rows")
    modes = ("plain", "in the hook", "deferred", "batched")
    plain, extra = in_turns(lambda mode: step(mode)[0], modes, pairs)
    meter._tap = own
    hook = extra["in the hook"]
    return (f"| {width} x {depth}, {batch} | {plain * 1e3:.1f} ms | +{hook * 1e3:.2f} ms | "
            f"+{extra['deferred'] * 1e3:.2f} ms ({extra['deferred'] / hook:.2f}x) | "
            f"+{extra['batched'] * 1e3:.2f} ms ({extra['batched'] / hook:.2f}x) |")


def main(argv: list[str] | None = None) -> int:
    args = shapes_parser(__doc__, 300).parse_args(argv)
    shapes = shapes_of(args)
    print(f"{args.pairs} turns, torch threads {args.threads}\n")
    print("| width x depth, batch | forward + backward | in the hook | deferred | batched |")
    print("|---|---:|---:|---:|---:|")
    for width, depth, batch in shapes:
        print(compare(width, depth, batch, args.pairs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
