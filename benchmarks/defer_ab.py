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

import argparse
import itertools
import statistics
import sys
import time

import torch

from lnmonitor.core.maths.reductions import layernorm_backward_raw
from lnmonitor.core.meter.meter import LadderMeter
from lnmonitor.core.meter.taps import NormTap
from lnmonitor.tiny.model import GPTConfig, TinyGPT


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
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=65, width=width, depth=depth, heads=4, context=64))
    x = torch.randint(0, 65, (batch, 65))
    meter = LadderMeter(model, say=lambda _: None, warn=lambda *_: None, watch_growth=False)
    meter.start()  # the role-finding step, once, as a fit's first measured step
    model(x[:, :-1], x[:, 1:])[1].backward()
    meter.stop()
    meter.result()
    model.zero_grad(set_to_none=True)
    own = meter._tap
    taps = {"in the hook": NormTap(own.norms), "deferred": DeferredTap(own.norms),
            "batched": BatchedTap(own.norms)}

    def step(mode: str):
        t = time.perf_counter()
        rows = None
        if mode != "plain":
            meter._tap = taps[mode]
            meter.start()
        model(x[:, :-1], x[:, 1:])[1].backward()
        if mode != "plain":
            meter._unhook()
            rows = meter._tap.collect()
        took = time.perf_counter() - t
        model.zero_grad(set_to_none=True)
        return took, rows

    now, later, stacked = step("in the hook")[1], step("deferred")[1], step("batched")[1]
    if not (torch.equal(now.data, later.data) and now.records == later.records):
        raise SystemExit("the deferred tap leaves different rows")
    if not (torch.allclose(now.data, stacked.data, rtol=1e-4, atol=1e-6, equal_nan=True)
            and now.records == stacked.records):
        raise SystemExit("the batched tap leaves other rows")
    modes = ("plain", "in the hook", "deferred", "batched")
    times: dict[str, list[float]] = {m: [] for m in modes}
    orders = list(itertools.permutations(modes))
    for i in range(pairs):
        for mode in orders[i % len(orders)]:
            times[mode].append(step(mode)[0])
    meter._tap = own
    extra = {m: statistics.median(a - b for a, b in zip(times[m], times["plain"], strict=True))
             for m in modes[1:]}
    return (f"| {width} x {depth}, {batch} | {statistics.median(times['plain']) * 1e3:.1f} ms | "
            f"+{extra['in the hook'] * 1e3:.2f} ms | +{extra['deferred'] * 1e3:.2f} ms "
            f"({extra['deferred'] / extra['in the hook']:.2f}x) | +{extra['batched'] * 1e3:.2f} ms "
            f"({extra['batched'] / extra['in the hook']:.2f}x) |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["64,2,12", "128,4,32"],
                        help="width,depth,batch of each TinyGPT (context 64)")
    parser.add_argument("--pairs", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{args.pairs} turns, torch threads {args.threads}\n")
    print("| width x depth, batch | forward + backward | in the hook | deferred | batched |")
    print("|---|---:|---:|---:|---:|")
    for shape in args.shapes:
        width, depth, batch = (int(v) for v in shape.split(","))
        print(compare(width, depth, batch, args.pairs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
