"""lnmonitor.core.invariance.measure: the final-norm cases behave as the maths of docs/design.md says."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    gpt,
    windows,
)
from torch import nn

from lnmonitor.core.invariance.final_norm import find_final_norm
from lnmonitor.core.invariance.loss_contract import default_loss, split_output
from lnmonitor.core.invariance.measure import final_norm_invariance
from lnmonitor.core.invariance.results import CASES, SWEEP_SCALES
from lnmonitor.core.meter.taps import NormTap
from lnmonitor.core.norms.find import find_norms


def tiny(norm="layer", eps=1e-5, seed=0):
    """The bare TinyGPT (a plain nn.Module) of :func:`conftest.gpt`."""
    return gpt(seed=seed, norm=norm, eps=eps).model


def batch(seed=0, n=6):
    return windows(n, seed)


def capture_final_input(model, xb):
    box = {}
    handle = model.lnf.register_forward_hook(lambda m, a, o: box.setdefault("h", a[0].detach()))
    with torch.no_grad():
        model(*xb)
    handle.remove()
    return box["h"].reshape(-1, box["h"].shape[-1]).double()


def test_cases_layernorm_eps_1e5():
    model, xb = tiny(), batch()
    res = final_norm_invariance(model, xb)
    assert res.final_norm == "lnf" and res.kind == "layer" and res.eps == 1e-5
    assert res.rows == 6 * 16
    for case in ("shift_5", "shift_1000"):
        c = res.cases[case]
        assert c.dloss == 0.0 and c.max_dlogit == 0.0, case  # exactly, in float32
        assert c.out_residual < 1e-12 and c.expected_residual == 0.0
    control = res.cases["axis_5"]
    assert abs(control.dloss) > 1e-3 and control.max_dlogit > 1e-2 and control.out_residual > 0.1
    assert control.expected_residual is None

    # the float64 output residual equals |a sigma / sigma_a - 1| per row
    h = capture_final_input(model, xb)
    v = ((h - h.mean(1, keepdim=True)) ** 2).mean(1)
    for case in ("scale_3", "scale_3_shift_5"):
        c = res.cases[case]
        expected = (3 * torch.sqrt(v + 1e-5) / torch.sqrt(9 * v + 1e-5) - 1).abs()
        assert c.out_residual == pytest.approx(float(expected.median()), rel=1e-9)
        assert c.out_residual_max == pytest.approx(float(expected.max()), rel=1e-9)
        assert c.expected_residual == pytest.approx(c.out_residual, rel=1e-9)
        assert c.dloss != 0.0  # eps/v is ~1e-2 in an untrained model
    assert res.cases["scale_3"].dloss == res.cases["scale_3_shift_5"].dloss


def test_sweep_points_fit_and_rounding_flags():
    model, xb = tiny(), batch()
    res = final_norm_invariance(model, xb)
    assert [p.scale for p in res.sweep] == list(SWEEP_SCALES)
    h = capture_final_input(model, xb)
    v_med = float(((h - h.mean(1, keepdim=True)) ** 2).mean(1).median())
    for p in res.sweep:
        assert p.eps_over_var == pytest.approx(1e-5 / (p.scale**2 * v_med), rel=1e-9)
        assert p.in_fit == (1e-5 < p.eps_over_var < 10 and p.dloss != 0)
        assert p.rounding == (p.eps_over_var <= 1e-5 and p.dloss != 0)
    unit = [p for p in res.sweep if p.scale == 1.0][0]
    assert unit.dloss == 0.0 and not unit.in_fit
    xs = [math.log(p.eps_over_var) for p in res.sweep if p.in_fit]
    ys = [math.log(abs(p.dloss)) for p in res.sweep if p.in_fit]
    slope, intercept = np.polyfit(xs, ys, 1)
    assert res.slope == pytest.approx(slope) and res.constant == pytest.approx(math.exp(intercept))
    metrics = res.metrics()
    assert metrics["lnmonitor/invariance/scale_slope"] == res.slope
    assert set(metrics) >= {f"lnmonitor/invariance/{c}/dloss" for c in CASES}


def test_eps_one_tenth_moves_scale_more():
    small = final_norm_invariance(tiny(eps=1e-5), batch(), cases=("scale_3",), scales=())
    large = final_norm_invariance(tiny(eps=1e-1), batch(), cases=("scale_3",), scales=())
    assert large.cases["scale_3"].out_residual > 10 * small.cases["scale_3"].out_residual
    assert large.sweep == [] and math.isnan(large.slope)


def test_large_eps_effect_removed_by_scaling_up_is_not_called_rounding():
    # At eps = 0.1 the unscaled input already has eps/v >> 1e-5, so a = 1e3 moves the loss
    # by removing that eps effect: real, not float32 rounding, whatever eps/(a^2 v) is.
    res = final_norm_invariance(tiny(eps=1e-1), batch(), cases=(), scales=(1e3, 1.0, 1e-2))
    big = next(p for p in res.sweep if p.scale == 1e3)
    assert big.eps_over_var <= 1e-5 and abs(big.dloss) > 1e-4
    assert not big.rounding and res.rounding_scales == []


def test_rmsnorm_scale_is_the_only_invariance():
    res = final_norm_invariance(tiny("rms"), batch())
    assert res.kind == "rms"
    assert res.cases["shift_5"].dloss != 0.0  # shifts are not an RMSNorm invariance
    assert res.cases["shift_5"].expected_residual is None
    c = res.cases["scale_3"]
    assert c.expected_residual == pytest.approx(c.out_residual, rel=1e-9)


class NotCentred(nn.Module):
    """Declares itself a LayerNorm but forgets to subtract the mean."""

    lnmonitor_norm_kind = "layer"

    def __init__(self, d):
        super().__init__()
        self.eps = 1e-5
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def test_a_norm_declared_as_what_it_does_not_compute_is_refused_not_measured():
    """NotCentred declares itself a LayerNorm but does not centre: its declaration does not
    reproduce its output, so it is refused with the mismatch; declared as the RMSNorm it is,
    its shift case moves the loss (shifts are not an RMSNorm invariance)."""
    from lnmonitor.core.norms.find import discover_norms

    model = tiny()
    model.lnf = NotCentred(32)
    found = discover_norms(model)
    assert "lnf" not in [n.name for n in found.norms]
    (refusal,) = [r for r in found.refused if r.name == "lnf"]
    assert "not reproduced as declared" in refusal.reason and "layer norm" in refusal.reason
    with pytest.raises(ValueError, match="not a normalisation layer"):
        final_norm_invariance(model, batch(), "lnf", cases=("shift_5",), scales=())
    NotCentred.lnmonitor_norm_kind = "rms"
    try:
        res = final_norm_invariance(model, batch(), "lnf", cases=("shift_5", "scale_3"), scales=())
    finally:
        NotCentred.lnmonitor_norm_kind = "layer"
    assert res.kind == "rms"
    assert res.cases["shift_5"].dloss != 0.0 and res.cases["shift_5"].max_dlogit > 1e-3


def test_restores_mode_and_rng_and_custom_loss_fn():
    model = tiny()
    model.train()
    model.blocks[0].eval()  # a mixed state must come back as it was
    torch.manual_seed(123)
    before = torch.get_rng_state()
    seen = []

    def loss_fn(module, b):
        seen.append(module.training)
        torch.rand(3)  # consumes RNG inside: must not leak
        logits, _ = module(b[0])
        return F.cross_entropy(logits.flatten(0, 1), b[1].flatten())

    res = final_norm_invariance(model, batch(), loss_fn=loss_fn)
    assert not any(seen)
    assert model.training and not model.blocks[0].training and model.blocks[1].training
    assert torch.equal(torch.get_rng_state(), before)
    assert res.cases["shift_5"].max_dlogit is None  # a scalar loss: no logits
    assert res.cases["shift_5"].dloss == 0.0


def test_find_final_norm_and_errors():
    assert find_final_norm(tiny(), batch()) == "lnf"
    with pytest.raises(ValueError, match="loss_fn"):
        final_norm_invariance(nn.Sequential(nn.LayerNorm(4)), torch.randn(2, 4))
    with pytest.raises(ValueError, match="not a normalisation layer"):
        final_norm_invariance(tiny(), batch(), "head")
    with pytest.raises(ValueError, match="unknown invariance cases"):
        final_norm_invariance(tiny(), batch(), cases=("shift_7",))
    with pytest.raises(ValueError, match="no normalisation layer"):
        find_final_norm(nn.Linear(2, 2), torch.randn(1, 2))


def test_split_output_forms():
    loss = torch.tensor(1.0)
    logits = torch.zeros(2, 3)
    assert split_output(loss) == (loss, None)
    assert split_output((logits, loss))[1] is logits
    assert split_output({"loss": loss, "logits": logits})[1] is logits
    with pytest.raises(ValueError):
        split_output((logits, None))
    model = tiny()
    out = default_loss(model, batch())
    assert isinstance(out, tuple) and out[1].ndim == 0


def test_a_failure_entering_the_probe_context_undoes_what_it_entered(monkeypatch):
    """If entering one part of ``restored`` raises, the parts entered before it are undone at
    once, even while a handler keeps the traceback alive: the taps listen again."""
    import lnmonitor.core.hooks as hooks

    model = tiny()
    model.train()
    monkeypatch.setattr(hooks, "eager", lambda: (_ for _ in ()).throw(RuntimeError("no stance")))
    with pytest.raises(RuntimeError) as raised:
        final_norm_invariance(model, batch())
    monkeypatch.undo()
    assert raised.value is not None  # the traceback is still alive here
    assert model.training
    tap = NormTap(find_norms(model))
    tap.attach()
    model(*batch())[1].backward()
    tap.detach()
    assert tap.collect().data is not None


def _points(*pairs):
    from lnmonitor.core.invariance.results import SweepPoint

    return [SweepPoint(a, dl, ev, True, False) for a, dl, ev in pairs]


def test_the_sweep_is_fitted_on_one_sign_and_at_least_three_points():
    from lnmonitor.core.invariance.sweep import fit_sweep, fitted

    law = _points(*[(a, 0.05 * ev, ev) for a, ev in ((0.1, 1e-4), (0.01, 1e-2), (0.003, 0.1), (0.001, 1.0))])
    slope, constant, note = fit_sweep(law)
    assert slope == pytest.approx(1.0) and constant == pytest.approx(0.05) and note.startswith("fitted on 4")
    # scaling down first lowers the held-out loss (negative), then raises it: fit the longer run
    mixed = _points((0.1, -2e-6, 1e-4), (0.01, -2e-4, 1e-2), (0.003, -2e-3, 0.1), (0.001, 0.3, 1.0))
    slope, _, note = fit_sweep(mixed)
    assert slope == pytest.approx(1.0) and "changes sign" in note and "negative" in note
    assert [p.in_fit for p in fitted(mixed)] == [True, True, True, False]
    assert not any(p.in_fit for p in mixed)  # fitting computes in_fit on new points, it mutates none
    two = _points((10.0, 1e-4, 1e-4), (0.1, 0.05, 1.0))  # eps = 0.1: two points in the window
    slope, constant, note = fit_sweep(two)
    assert math.isnan(slope) and math.isnan(constant) and "2 point(s) in the window" in note
    split = _points((0.1, -1e-6, 1e-4), (0.01, 1e-4, 1e-2), (0.003, -1e-3, 0.1), (0.001, 0.3, 1.0))
    assert "changes sign" in fit_sweep(split)[2] and math.isnan(fit_sweep(split)[0])
