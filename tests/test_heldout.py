"""lnmonitor.core.meter.heldout: the held-out tools measure through the meter -- one checkpoint gives
the monitors' numbers, to the bit on the same rows; the model is left as it was."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import PROBE_WIDTH
from torch import nn

from lnmonitor.core.meter.heldout import held_out_result
from lnmonitor.core.meter.meter import LadderMeter
from lnmonitor.core.meter.row_stats import SHARE_RESOLUTION
from lnmonitor.core.norms.roles import FINAL, POST
from lnmonitor.experiments.analysis import analyze
from lnmonitor.integrations.loop import LoopMonitor


def tiny_loss(model, batch):
    return model(*batch)[1]


def test_one_checkpoint_through_a_monitor_and_through_analyze_gives_the_same_numbers(trained):
    """The same rows through the LoopMonitor (a training step, no update) and through
    ``analyze``: the same rungs, final norm, ladder, every norm's figures and the baselines,
    bit for bit (before, analyze's float64 medians differed from the monitor's in the 4th digit)."""
    module = trained["module"]
    batch = trained["batches"][0]
    monitor = LoopMonitor(module, every_n_steps=1)
    with monitor.step(0):
        tiny_loss(module, batch).backward()
    module.zero_grad(set_to_none=True)
    logged = {k: v for k, v in monitor.history[0].items() if k != "step"}

    a = analyze(module, [batch], batches=1, invariance=False)
    figures = a.result.figures
    assert figures.rungs == monitor.meter.rungs() == [n.name for n in a.rungs]
    assert figures.final == "model.lnf" == next(n.name for n in monitor.meter.norms if n.role == FINAL)
    assert a.result.metrics(positions=True) == logged  # every tag, every bit
    assert [r.name for r in a.study] == figures.rungs
    first, last = a.rungs[0], a.rungs[-1]
    assert figures.attenuation == first.inv_sigma / last.inv_sigma
    assert figures.growth == last.rms / first.rms
    assert figures.baseline("model.lnf") == (logged["lnmonitor/share_baseline/median"],
                                             logged["lnmonitor/share_baseline/max"])


def test_the_model_is_left_as_it_was(trained):
    module = trained["module"]
    module.train()
    module.model.lnf.eval()
    grads = {n: torch.full_like(p, 0.5) for n, p in module.named_parameters()}
    for n, p in module.named_parameters():
        p.grad = grads[n].clone()
    torch.manual_seed(3)
    expected_draw = torch.rand(4)
    torch.manual_seed(3)
    seen = []
    held_out_result(LadderMeter(module), trained["batches"][:1],
                    lambda m, b: (seen.append(m.training), tiny_loss(m, b))[1])
    assert seen == [False]  # eval mode during the passes
    assert module.training and not module.model.lnf.training and module.model.blocks[0].training
    assert all(torch.equal(p.grad, grads[n]) for n, p in module.named_parameters())
    assert torch.equal(torch.rand(4), expected_draw)
    module.zero_grad(set_to_none=True)
    module.eval()


def test_shares_are_the_meters_and_agree_with_a_direct_autograd_computation(trained):
    """The final norm's shares of w = g * dL/dy: the max exactly as float64 autograd gives it
    (to float32), the median within the histogram's resolution."""
    module = trained["module"]
    batch = trained["batches"][0]
    result = held_out_result(LadderMeter(module), [batch], tiny_loss)
    lnf = module.model.lnf
    kept = {}

    def hook(mod, args, out):
        kept["x"] = args[0].detach()
        out.register_hook(lambda g: kept.__setitem__("g", g))

    handle = lnf.register_forward_hook(hook)
    with torch.enable_grad():
        tiny_loss(module, batch).backward()
    handle.remove()
    module.zero_grad(set_to_none=True)
    x = kept["x"].reshape(-1, PROBE_WIDTH).double()
    w = lnf.weight.detach().double() * kept["g"].reshape(-1, PROBE_WIDTH).double()
    u1 = torch.full((PROBE_WIDTH,), PROBE_WIDTH**-0.5, dtype=torch.float64)
    xc = x - x.mean(-1, keepdim=True)
    u2 = xc / xc.norm(dim=-1, keepdim=True)
    direct = (torch.sqrt((w @ u1) ** 2 + (w * u2).sum(-1) ** 2) / w.norm(dim=-1)).numpy()
    s = result.figures.by_name()["model.lnf"].stats
    assert s.share_rows + s.skipped_rows == batch[0].numel()
    assert s.share_max == pytest.approx(direct.max(), rel=1e-5)
    assert abs(s.share_median - np.median(direct)) <= SHARE_RESOLUTION


class PostNormNet(nn.Module):
    """A pre-norm block whose branch ends in its own norm (OLMo2-style ``post``), then a final
    norm: three norms, two of which read the residual stream."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, d)
        self.ln1 = nn.LayerNorm(d)
        self.branch = nn.Linear(d, d)
        self.post = nn.LayerNorm(d)
        self.lnf = nn.LayerNorm(d)
        self.head = nn.Linear(d, 11)

    def forward(self, x, y):
        h = self.emb(x)
        h = 4.0 * h + self.post(self.branch(self.ln1(h)))
        logits = self.head(self.lnf(h))
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def test_a_branch_norm_is_no_rung_on_held_out_batches_as_in_the_monitor():
    """Before, the held-out path made every norm a rung (the post norm too, so attenuation
    and growth ended or started at the wrong norm); now its roles are the meter's."""
    torch.manual_seed(0)
    model = PostNormNet()
    x = torch.randint(0, 11, (4, 16))
    batch = (x, x.roll(1, -1))
    monitor = LoopMonitor(model, every_n_steps=1)
    with monitor.step(0):
        tiny_loss(model, batch).backward()
    model.zero_grad(set_to_none=True)
    result = held_out_result(LadderMeter(model), [batch], tiny_loss)
    roles = {n.name: n.role for n in result.norms}
    assert roles["post"] == POST and roles["lnf"] == FINAL
    assert result.figures.rungs == ["ln1", "lnf"] == monitor.meter.rungs()
    assert result.metrics(positions=True) == {k: v for k, v in monitor.history[0].items() if k != "step"}
    by_name = result.figures.by_name()
    assert math.isclose(result.figures.attenuation, by_name["ln1"].inv_sigma / by_name["lnf"].inv_sigma,
                        rel_tol=0, abs_tol=0)


def test_a_loss_without_a_graph_is_refused_and_the_meter_unhooked(trained):
    module = trained["module"]
    meter = LadderMeter(module)
    with pytest.raises(ValueError, match="scalar tensor with a graph"):
        held_out_result(meter, trained["batches"][:1], lambda m, b: torch.tensor(1.0))
    assert not meter.measuring and all(p.grad is None for p in module.parameters())
