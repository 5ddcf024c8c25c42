"""The invariance probe's replay of what runs before the final norm (lnmonitor.core.invariance.replay).

Every pass of the probe after the first replays the calls that finished before the final
norm; the probe must give, to the bit, what it gives when every pass runs whole."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_compatibility import FAMILIES, data
from torch import nn

from lnmonitor.core.invariance.measure import final_norm_invariance
from lnmonitor.core.invariance.replay import PrefixReplay
from lnmonitor.core.invariance.results import CASES
from lnmonitor.tiny.model import GPTConfig, TinyGPT

SCALES = (10.0, 1.0, 0.1, 1e-3)


def probe(model, batch, final, loss_fn=None):
    return final_norm_invariance(model, batch, final, loss_fn=loss_fn, scales=SCALES)


def figures(result) -> list[float]:
    out = [result.base_loss]
    for case in CASES:
        c = result.cases[case]
        out += [c.dloss, c.max_dlogit, c.out_residual, c.out_residual_max]
    return out + [p.dloss for p in result.sweep]


def same(a: list[float], b: list[float]) -> bool:
    return all((x is None and y is None) or x == y or (x != x and y != y) for x, y in zip(a, b, strict=True))


@pytest.fixture
def replays(monkeypatch):
    """What each PrefixReplay.faithful answered (the real method, watched)."""
    answers: list[bool] = []
    faithful = PrefixReplay.faithful

    def watched(self, run, recorded):
        answers.append(faithful(self, run, recorded))
        return answers[-1]

    monkeypatch.setattr(PrefixReplay, "faithful", watched)
    return answers


def whole_passes(monkeypatch) -> None:
    monkeypatch.setattr(PrefixReplay, "faithful", lambda self, run, recorded: False)


def next_token_loss(module, ids):
    logits = module(ids)
    return logits, nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                               ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("family", FAMILIES, ids=[f.key for f in FAMILIES])
def test_every_family_replayed_is_every_pass_run_whole(family, replays, monkeypatch):
    """A padded batch (and, for an encoder-decoder, padded targets): the encoder, embeddings and
    blocks are replayed, and every figure of the cases and the sweep is the same to the bit."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = family.build()
    batch = next(iter(data(0, "right", family.decoder)))
    loss_fn = None
    if not family.hf:
        batch, loss_fn = batch["input_ids"], next_token_loss
    final = family.final.removeprefix("model.")
    replayed = figures(probe(model, batch, final, loss_fn))
    assert replays == [True]
    whole_passes(monkeypatch)
    assert same(replayed, figures(probe(model, batch, final, loss_fn)))


def tiny() -> tuple[TinyGPT, tuple]:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=32, width=16, depth=3, heads=2, context=8)).eval()
    x = torch.randint(0, 32, (4, 8))
    return model, (x, x)


def test_replayed_calls_do_not_run_and_each_pass_gets_its_own_copy():
    model, batch = tiny()
    replay = PrefixReplay(model, model.lnf)
    with torch.no_grad(), replay.recording():
        recorded = model(*batch)
    assert sorted(type(m).__name__ for m, _ in replay.outputs) == ["Block"] * 3 + ["Embedding"] * 2
    ran: list[str] = []
    for name, module in model.named_modules():
        module.register_forward_hook(lambda m, a, o, name=name: ran.append(name))
    for _ in range(2):
        ran.clear()
        with torch.no_grad(), replay.replaying():
            logits, loss = model(*batch)
        assert torch.equal(loss, recorded[1]) and torch.equal(logits, recorded[0])
        inside = [n for n in ran if n.startswith("blocks.") and n.count(".") > 1]
        assert inside == [] and "lnf" in ran and "head" in ran  # the blocks' insides never ran
        with replay.replaying():
            model.blocks[2](torch.zeros(4, 8, 16)).add_(1.0)  # a copy: the record is untouched
    assert not any("forward" in m.__dict__ for m in model.modules())  # nothing left patched


class Flagging(nn.Module):
    """A block that sets a flag the head reads: replayed, it would not set it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.flag = 0.0

    def forward(self, x):
        self.flag = 1.0
        return x + self.lin(x)


class SideEffect(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block, self.norm, self.head = Flagging(), nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x, y):
        self.block.flag = 0.0
        logits = self.head(self.norm(self.block(x))) * (1.0 + self.block.flag)
        return logits, nn.functional.cross_entropy(logits, y)


def test_a_call_whose_side_effect_the_pass_reads_is_not_replayed(replays, monkeypatch):
    torch.manual_seed(0)
    model, batch = SideEffect(), (torch.randn(16, 8), torch.randint(0, 3, (16,)))
    replayed = figures(probe(model, batch, "norm"))
    assert replays == [False]
    whole_passes(monkeypatch)
    assert same(replayed, figures(probe(model, batch, "norm")))


def test_the_budget_bounds_what_is_recorded():
    """A budget that holds the two embeddings' outputs and not a block's: the blocks run, and
    the replay is still faithful."""
    model, batch = tiny()
    embeddings = (4 * 8 + 8) * 16 * 4  # bytes: the tokens' (4, 8, 16) and the positions' (8, 16)
    replay = PrefixReplay(model, model.lnf, budget=embeddings)
    with torch.no_grad(), replay.recording():
        recorded = model(*batch)
    assert sorted(type(m).__name__ for m, _ in replay.outputs) == ["Embedding", "Embedding"]
    with torch.no_grad():
        assert replay.faithful(lambda: model(*batch)[::-1], recorded[::-1])
