"""lnmonitor.core.meter.processes: a step merged over real gloo processes equals one process
holding every process's rows (replicas once, rows of their own added), without any process
holding another's vector: what a rank receives does not grow with the number of processes."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port, whole_and_parts

from lnmonitor.core.meter import row_stats as H
from lnmonitor.core.meter import row_stats as R
from lnmonitor.core.meter.row_stats import merge_processes, replicated
from lnmonitor.core.meter.taps import StepRows

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from ranks import Metered  # noqa: E402  (benchmarks/ranks.py's meter of the collectives)

LAYOUT = H.Layout(2)


def _rows():
    """The rows of one batch of 40, of its two parts (17 and 23), and of a step with none."""
    return (*whole_and_parts(), StepRows(None, [], [], {}))


def _stacked_reference(vectors: list[torch.Tensor]) -> torch.Tensor:
    """The merge's definition on vectors held together: each process's replicated norms'
    histograms and sums left out, the rest added, the maxima taken (a replica's are its
    original's)."""
    prints = torch.stack([v[LAYOUT.max_end :].clone().view(torch.float64) for v in vectors])
    kept = []
    for rank, v in enumerate(vectors):
        keep = (~replicated(prints, rank)).float()[:, None]
        v = v.clone()
        v[: LAYOUT.hist_size].view(LAYOUT.n_norms, -1).mul_(keep)
        v[LAYOUT.hist_size : LAYOUT.sum_end].view(LAYOUT.n_norms, -1).mul_(keep)
        kept.append(v)
    g = torch.stack(kept)
    return torch.cat((g[:, : LAYOUT.sum_end].sum(0), g[:, LAYOUT.sum_end : LAYOUT.max_end].amax(0)))


def _worker(rank: int, world: int, port: int, cases: dict, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        merged, received = {}, {}
        for name, vectors in cases.items():
            with Metered() as metered:
                merged[name] = merge_processes(vectors[rank].clone(), LAYOUT).clone()
            received[name] = metered.received
        if rank == 0:
            torch.save((merged, received), out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory):
    whole, a, b, none = _rows()
    fa, fb, fn = (R.histogram_rows(r, LAYOUT, "cpu", fingerprint=True) for r in (a, b, none))
    plain_a = R.histogram_rows(a, LAYOUT, "cpu")  # no fingerprint: every process counts
    cases = {
        # two tensor-parallel pairs, each holding the same rows
        "pairs": [fa, fa.clone(), fb, fb.clone()],
        # data parallelism with a rank that measured nothing
        "own rows": [fa, fb, fn, fn.clone()],
        "no fingerprints": [plain_a, plain_a.clone(), plain_a.clone(), plain_a.clone()],
    }
    out = tmp_path_factory.mktemp("merge") / "merged.pt"
    mp.spawn(_worker, args=(4, free_port(), cases, str(out)), nprocs=4, join=True)
    merged, received = torch.load(out)
    whole_vector = R.histogram_rows(whole, LAYOUT, "cpu")[: LAYOUT.max_end]
    return merged, cases, whole_vector, received


@pytest.mark.parametrize("case", ["pairs", "own rows", "no fingerprints"])
def test_the_merge_over_processes_is_its_definition_to_the_bit(four_processes, case):
    merged, cases, _, _ = four_processes
    torch.testing.assert_close(merged[case], _stacked_reference(cases[case]), rtol=0, atol=0,
                               equal_nan=True)


@pytest.mark.parametrize("case", ["pairs", "own rows"])
def test_replicas_count_once_and_rows_of_their_own_add_up_to_one_batch(four_processes, case):
    merged, _, whole, _ = four_processes
    for s1, s4 in zip(R.read(whole, LAYOUT), R.read(merged[case], LAYOUT), strict=True):
        assert s4.rows == s1.rows == 40  # not 80
        assert (s4.var_counts == s1.var_counts).all() and (s4.share_counts == s1.share_counts).all()
        assert abs(s4.share_max - s1.share_max) < 1e-6  # the parts round apart from the whole
        assert abs(s4.share_quantile(0.5) - s1.share_quantile(0.5)) <= 2 * H.SHARE_RESOLUTION


def test_without_fingerprints_every_process_counts(four_processes):
    merged, _, _, _ = four_processes
    assert [s.rows for s in R.read(merged["no fingerprints"], LAYOUT)] == [4 * 17, 4 * 17]


def test_a_rank_receives_its_occupied_bins_not_the_other_vectors(four_processes):
    _, cases, _, received = four_processes
    vector = 4 * LAYOUT.size
    for name, vectors in cases.items():
        maxima = torch.stack([v[LAYOUT.sum_end : LAYOUT.max_end] for v in vectors]).amax(0)
        packed = 4 * len(H.occupied(maxima.numpy(), LAYOUT)[0])
        # the fingerprints (8 bytes a norm and process), the maxima, the packed bins and sums
        assert received[name] == 8 * 4 * LAYOUT.n_norms + 4 * H.N_MAX * LAYOUT.n_norms + packed, name
        assert received[name] < vector / 10  # where the all_gather received four whole vectors


def test_one_process_merges_to_its_own_vector():
    _, a, _, _ = _rows()
    flat = R.histogram_rows(a, LAYOUT, "cpu")
    torch.testing.assert_close(merge_processes(flat.clone(), LAYOUT), flat[: LAYOUT.max_end],
                               rtol=0, atol=0, equal_nan=True)


def test_the_occupied_bins_hold_every_count_and_few_others():
    whole, a, b, _ = _rows()
    vectors = [R.histogram_rows(r, LAYOUT, "cpu") for r in (whole, a, b)]
    maxima = torch.stack([v[LAYOUT.sum_end : LAYOUT.max_end] for v in vectors]).amax(0)
    at, starts = H.occupied(maxima.numpy(), LAYOUT)
    outside = np.ones(LAYOUT.max_end, dtype=bool)
    outside[at] = False
    outside[LAYOUT.sum_end :] = False  # the maxima travel apart
    for v in vectors:
        assert (v[: LAYOUT.max_end].numpy()[outside] == 0).all()
    assert len(at) < LAYOUT.sum_end / 20  # a few hundred bins of 139,264
    assert len(at) == starts[-1] + LAYOUT.n_norms * H.N_SUMS  # the bins, then every sum
    for norm in range(LAYOUT.n_norms):  # each norm's bins between its start and the next
        mine = at[starts[norm] : starts[norm + 1]]
        assert len(mine) and (mine // LAYOUT.per_norm == norm).all()
    assert (at[starts[-1] :] == np.arange(LAYOUT.hist_size, LAYOUT.sum_end)).all()
    # a step without rows sends its sums alone
    empty = R.histogram_rows(StepRows(None, [], [], {}), LAYOUT, "cpu")
    sums_alone, _ = H.occupied(empty[LAYOUT.sum_end : LAYOUT.max_end].numpy(), LAYOUT)
    assert (sums_alone == np.arange(LAYOUT.hist_size, LAYOUT.sum_end)).all()


def _growth_worker(rank: int, world: int, port: int, out: str) -> None:
    """A meter on each process, its own batches: step 0 measured (the roles, merged), steps 1-5
    watched; at step 3 process 1's watch fails (its first rung called on integers), so both stop."""
    from lnmonitor.core.meter.growth_watch import GrowthWatch
    from lnmonitor.core.meter.meter import LadderMeter
    from lnmonitor.tiny.model import GPTConfig, TinyGPT

    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = TinyGPT(GPTConfig(vocab_size=65, width=16, depth=2, heads=2, context=8))
        meter = LadderMeter(model, info=lambda _: None, warn=lambda *_: None)
        batches = torch.Generator().manual_seed(1 + rank)
        with meter.step():
            model(*_windows(batches, 3))[1].backward()
        meter.result(merge=True)
        rungs = {n.name: n.module for n in meter.norms}
        own = GrowthWatch()  # this process's own growth, as one process would take it
        own.attach(rungs[meter.rungs()[0]], rungs[meter.rungs()[-1]])
        local, readings = [], []
        for step in range(1, 6):
            if (rank, step) == (1, 3):  # integer rows: the watch's hook raises (and the norm too)
                with contextlib.suppress(RuntimeError):
                    model.blocks[0].ln1(torch.zeros(2, 16, dtype=torch.long))
            model(*_windows(batches, 2 + step))[1].backward()
            local.append(own.take(step))
            readings.append(meter.take_growth(step))
        own.detach()
        hooked = bool(model.blocks[0].ln1._forward_pre_hooks)  # the meter's watch still on
        meter.close()
        every: list = [None] * world
        dist.all_gather_object(every, (local, readings, hooked))
        if rank == 0:
            torch.save(every, out)
    finally:
        dist.destroy_process_group()


def _windows(generator, batch: int):
    x = torch.randint(0, 65, (batch, 9), generator=generator)
    return x[:, :-1], x[:, 1:]


def test_the_every_step_growth_is_the_largest_over_processes_and_all_stop_together(tmp_path):
    out = tmp_path / "growth.pt"
    mp.spawn(_growth_worker, args=(2, free_port(), str(out)), nprocs=2, join=True)
    (local0, read0, hooked0), (local1, read1, hooked1) = torch.load(out)
    assert read0 == read1  # the same on every process
    for step in (1, 2):  # on the CPU read at once: the larger of the two processes' own growth
        taken = read0[step - 1]
        assert taken[0] == step
        assert taken[1] == pytest.approx(max(local0[step - 1][1], local1[step - 1][1]), rel=1e-6)
    assert local1[2] is None  # process 1's watch failed at step 3 ...
    assert read0[2] == (3, pytest.approx(local0[2][1], rel=1e-6))  # ... so step 3 is process 0's
    assert read0[3:] == [None, None] and not hooked0 and not hooked1  # and both stopped there


def _loss_worker(rank: int, world: int, port: int, out: str) -> None:
    """A plain loop on each of ``world`` gloo processes, rank 1's loss x2.5 from step 15 on."""
    import warnings

    from lnmonitor.integrations.loop import LoopMonitor
    from lnmonitor.tiny.model import GPTConfig, TinyGPT

    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = TinyGPT(GPTConfig(width=16, depth=2, heads=2, context=8))
        monitor = LoopMonitor(model, every_n_steps=100, invariance_every_n_steps=None, images=False,
                              summary=False, keep_history=True)
        x = torch.randint(0, 65, (2, 8), generator=torch.Generator().manual_seed(rank))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step in range(20):
                with monitor.step(step):
                    model(x, x)[1].backward()
                    monitor.add_loss(torch.tensor(5.0 if rank == 1 and step >= 15 else 2.0))
        finding = monitor.findings.raised.get("loss_blowup")
        measured = [h["step"] for h in monitor.history if "lnmonitor/ladder/growth" in h]
        torch.save((None if finding is None else (finding.step, finding.value), measured), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_the_loss_rule_judges_the_largest_ranks_loss_on_every_rank_alike(tmp_path):
    """Each rank hands its own loss; one 8-byte all-reduce a step gives every rank the largest, so
    rank 0, whose loss never moved, says rank 1's blow-up at the same step, and every rank measures
    the step after it together (a merge no rank may skip)."""
    out = str(tmp_path / "loss")
    mp.spawn(_loss_worker, args=(2, free_port(), out), nprocs=2, join=True)
    (found0, measured0), (found1, _) = (torch.load(f"{out}.{rank}") for rank in range(2))
    assert found0 == found1 == (15, 2.5)
    assert measured0 == [0, 16]  # every 100th, and the step after the rule fired
