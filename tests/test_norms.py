"""lnmonitor.norms: which modules are norms, of which kind, eps and gain, and selection by glob."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lnmonitor.norms import find_norms, register_norm, select_norms, unregister_norm

# ---------------------------------------------------------------------------
# discovery
# ---------------------------------------------------------------------------


class DuckNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.normalized_shape = (d,)
        self.eps = 1e-6
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return nn.functional.layer_norm(x, self.normalized_shape, self.weight, None, self.eps)


class DuckRMSNorm(DuckNorm):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class DeclaredNorm(nn.Module):
    lnmonitor_norm_kind = "rms"

    def __init__(self, d):
        super().__init__()
        self.variance_epsilon = 1e-6
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * self.weight


class ForeignNorm(nn.Module):  # like HF's LlamaRMSNorm: no normalized_shape
    def __init__(self, d):
        super().__init__()
        self.my_eps = 1e-4
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.my_eps) * self.scale


class OptedOut(nn.LayerNorm):
    lnmonitor_norm_kind = None


def test_discovery_kinds_order_and_protocol():
    model = nn.Sequential(
        nn.LayerNorm(8),
        nn.RMSNorm(8),
        DuckNorm(8),
        DuckRMSNorm(8),
        DeclaredNorm(8),
        ForeignNorm(8),
        OptedOut(8),
        nn.GroupNorm(2, 8),
        nn.BatchNorm1d(8),
    )
    found = find_norms(model)
    assert [(f.name, f.kind) for f in found] == [
        ("0", "layer"), ("1", "rms"), ("2", "layer"), ("3", "rms"), ("4", "rms"),
    ]
    assert found[4].eps() == 1e-6
    assert found[1].eps(torch.float32) == torch.finfo(torch.float32).eps  # nn.RMSNorm eps=None
    assert found[1].eps(torch.bfloat16) == torch.finfo(torch.bfloat16).eps
    register_norm(ForeignNorm, "rms", eps="my_eps", weight="scale")
    try:
        found = find_norms(model)
        foreign = [f for f in found if f.name == "5"][0]
        assert foreign.kind == "rms" and foreign.eps() == 1e-4 and foreign.width == 8
        assert foreign.weight() is model[5].scale
    finally:
        unregister_norm(ForeignNorm)
    assert "5" not in [f.name for f in find_norms(model)]


def test_bad_declared_kind_and_registry_arguments():
    class Bad(nn.Module):
        lnmonitor_norm_kind = "batch"

    with pytest.raises(ValueError, match="lnmonitor_norm_kind"):
        find_norms(nn.Sequential(Bad()))
    with pytest.raises(ValueError, match="kind"):
        register_norm(ForeignNorm, "group")
    with pytest.raises(TypeError):
        register_norm(int, "rms")


def test_select_by_glob():
    from lnmonitor.tiny.model import GPTConfig, TinyGPT

    model = TinyGPT(GPTConfig(width=32, depth=3, heads=2, context=8))
    found = find_norms(model)
    assert [f.name for f in found] == [
        "blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2",
        "blocks.2.ln1", "blocks.2.ln2", "lnf",
    ]
    names = [f.name for f in select_norms(found, include="*.ln1")]
    assert names == ["blocks.0.ln1", "blocks.1.ln1", "blocks.2.ln1"]
    names = [f.name for f in select_norms(found, include=["blocks.*"], exclude="*ln2")]
    assert names == ["blocks.0.ln1", "blocks.1.ln1", "blocks.2.ln1"]
    assert select_norms(found, include="nothing*") == []


def test_width_below_dead_dimension_raises_in_geometry_terms():
    info = find_norms(nn.Sequential(nn.LayerNorm(2)))[0]
    assert info.width == 2 and info.dead_dim == 2
