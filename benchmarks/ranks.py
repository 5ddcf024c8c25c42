"""What a measured step costs each rank as the processes grow: real DDP on gloo processes.

Every process trains the same deep, narrow TinyGPT under ``DistributedDataParallel`` (norms many,
compute small) on batches of its own, with a :class:`~lnmonitor.core.meter.meter.LadderMeter`
measuring every step, and for each measured step measures, on every rank:

* the bytes the merge's collectives hand back to the rank (the outputs of every ``c10d``
  operator that runs inside ``meter.result``, seen by a ``TorchDispatchMode``: DDP's own
  gradient all-reduce runs in the backward pass, outside it);
* the peak extra memory while the step is merged and read: glibc's bytes in use
  (``mallinfo2``), sampled after every torch operator, less what was in use when it began;
* the merge's time (``meter.result``: collectives, host copy, read), on steps timed without
  the dispatch mode;
* then, on as many unmeasured steps, the every-step growth's cost: ``meter.take_growth``, which
  of several processes all-reduces one maximum a step and reads it a step later (how many steps
  gave a reading, and its median time beside a step's forward and backward).

The table gives the largest rank's figures (bytes are the same on every rank), medians over the
measured steps.  docs/performance.md ("Past one machine") has the figures and the cost model built
on them.

    python benchmarks/ranks.py                       # 2, 4, 8 and 16 processes, depth 24
    python benchmarks/ranks.py --processes 2 --depth 1 --width 8 --context 4 --steps 1  # smoke run
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

KIB = 1024.0


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]


def _in_use() -> int:
    """Bytes glibc's malloc has handed out and not taken back (small blocks and mapped ones)."""
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _Mallinfo2


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


class Metered(TorchDispatchMode):
    """Counts the bytes every collective hands back (its first argument: the output tensors) and
    samples the memory in use after every operator."""

    def __enter__(self):
        self.received, self.collectives = 0, 0
        self.start = self.peak = _in_use()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d":
            self.collectives += 1
            self.received += sum(t.nbytes for t in _tensors(args[0]))
        self.peak = max(self.peak, _in_use())
        return out

    @property
    def extra(self) -> int:
        return self.peak - self.start


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        figures = _measure(rank, args)
        every: list = [None] * world
        dist.all_gather_object(every, figures)
        if rank == 0:
            Path(out).write_text(json.dumps(every))
    finally:
        dist.destroy_process_group()


def _measure(rank: int, args: argparse.Namespace) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from lnmonitor.core.meter.meter import LadderMeter
    from lnmonitor.tiny.model import GPTConfig, TinyGPT

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=65, width=args.width, depth=args.depth, heads=2, context=args.context)
    model = TinyGPT(config)
    ddp = DistributedDataParallel(model)
    meter = LadderMeter(ddp, info=lambda _: None, warn=lambda *_: None)
    batches = torch.Generator().manual_seed(1 + rank)
    received, extra, seconds, collectives = [], [], [], 0
    for step in range(1 + 2 * args.steps):  # the first finds the roles
        x = torch.randint(0, 65, (args.batch, args.context + 1), generator=batches)
        meter.start()
        ddp(x[:, :-1], x[:, 1:])[1].backward()
        meter.stop()
        model.zero_grad(set_to_none=True)
        dist.barrier()
        if step % 2:  # metered: bytes and memory
            with Metered() as metered:
                meter.result(merge=True)
            received.append(metered.received)
            extra.append(metered.extra)
            collectives = metered.collectives
        else:  # timed
            t = time.perf_counter()
            meter.result(merge=True)
            if step:
                seconds.append(time.perf_counter() - t)
    step_seconds, take_seconds, read = [], [], 0
    for step in range(2 * args.steps):  # unmeasured steps: the every-step growth's cost
        x = torch.randint(0, 65, (args.batch, args.context + 1), generator=batches)
        t = time.perf_counter()
        ddp(x[:, :-1], x[:, 1:])[1].backward()
        model.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        read += meter.take_growth(step) is not None
        step_seconds.append(t1 - t)
        take_seconds.append(time.perf_counter() - t1)
    meter.close()
    return dict(norms=len(meter.norms), received=statistics.median(received),
                extra=statistics.median(extra), merge_ms=1e3 * statistics.median(seconds),
                collectives=collectives, vector=4 * meter.layout.size, growth_read=read,
                take_us=1e6 * statistics.median(take_seconds), step_ms=1e3 * statistics.median(step_seconds))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(processes: int, args: argparse.Namespace) -> dict:
    """One run on ``processes`` gloo processes: per rank figures, the largest rank's kept."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        mp.spawn(_worker, args=(processes, _free_port(), args, str(out)), nprocs=processes,
                 join=True)
        ranks = json.loads(out.read_text())
    keys = ("received", "extra", "merge_ms", "take_us", "step_ms")
    first = ranks[0]
    same = ("norms", "collectives", "vector", "growth_read")
    return {"processes": processes, **{k: first[k] for k in same},
            **{k: max(r[k] for r in ranks) for k in keys}}


def table(rows: list[dict], steps: int) -> str:
    first = rows[0]
    lines = [f"{first['norms']} norms, a step vector of {first['vector'] / KIB:,.0f} KiB a rank",
             "| processes | received per rank (KiB) | vs the first | peak extra memory (KiB) | merge (ms)"
             " | collectives | every-step growth read | its cost a step (us) | a step (ms) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = r["received"] / first["received"]
        lines.append(f"| {r['processes']} | {r['received'] / KIB:,.1f} | {ratio:.2f}x"
                     f" | {r['extra'] / KIB:,.0f} | {r['merge_ms']:.2f} | {r['collectives']}"
                     f" | {r['growth_read']} of {2 * steps} | {r['take_us']:,.0f} | {r['step_ms']:.1f} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--depth", type=int, default=24, help="blocks (2 norms each, and the final)")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--context", type=int, default=16)
    p.add_argument("--batch", type=int, default=2, help="sequences a rank")
    p.add_argument("--steps", type=int, default=5, help="measured steps metered, and as many timed")
    p.add_argument("--json", help="write the rows here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if min(args.processes) < 2 or min(args.depth, args.width, args.context, args.batch, args.steps) < 1:
        parser().error("--processes: each at least 2; --depth, --width, --context, --batch, --steps: "
                       "at least 1")
    if args.width % 2:
        parser().error("--width must be even (2 heads)")
    rows = [measure(p, args) for p in args.processes]
    print(table(rows, args.steps))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
