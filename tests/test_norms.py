"""lnmonitor.core.norms.find, .registry and .identify: which modules are norms, of which kind, eps and
gain (checked against their own output), and selection by glob."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import free_port
from torch import nn

from lnmonitor.core.maths.geometry import normalise
from lnmonitor.core.norms.find import discover_norms, find_norms, select_norms
from lnmonitor.core.norms.registry import register_norm, unregister_norm
from lnmonitor.core.norms.roles import assign_roles, expected_final

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
        assert foreign.gain() is model[5].scale
    finally:
        unregister_norm(ForeignNorm)
    assert "5" not in [f.name for f in find_norms(model)]


class GatedRMSNorm(DuckRMSNorm):
    """Mamba2's MambaRMSNormGated: rmsnorm(x * silu(gate)), without a gate a plain RMSNorm."""

    lnmonitor_norm_kind = "rms"  # declared too: a declaration does not make the gate go away

    def forward(self, x, gate=None):
        return super().forward(x if gate is None else x * nn.functional.silu(gate))


def test_a_norm_whose_forward_takes_more_than_its_input_is_left_out_and_named():
    # called without its gate it passes the float64 check; called with it, it normalises
    # x * silu(gate), and measured on its first argument it would be measured on the wrong tensor
    gated = GatedRMSNorm(8)
    x, gate = torch.randn(4, 8), torch.randn(4, 8)
    assert not torch.allclose(gated(x, gate), gated(x))
    found = discover_norms(nn.Sequential(DuckRMSNorm(8), gated))
    assert [n.name for n in found.norms] == ["0"]
    assert [(r.name, r.cls) for r in found.refused] == [("1", "GatedRMSNorm")]
    assert "more than the input it normalises (gate)" in found.refused[0].reason


def test_bad_declared_kind_and_registry_arguments():
    class Bad(nn.Module):
        lnmonitor_norm_kind = "batch"

    with pytest.raises(ValueError, match="lnmonitor_norm_kind"):
        find_norms(nn.Sequential(Bad()))
    with pytest.raises(ValueError, match="kind"):
        register_norm(ForeignNorm, "group")
    with pytest.raises(TypeError):
        register_norm(int, "rms")


FSDP2_UNITS = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from lnmonitor.core.maths.geometry import normalise
    from lnmonitor.core.norms.find import discover_norms
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.RMSNorm(8), nn.Linear(8, 4))
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 2.0)
        model[3].weight.uniform_(0.5, 2.0)
    x = torch.randn(5, 8, dtype=torch.float64)
    before = [model[i](x.float()).double() for i in (1, 3)]
    fully_shard(model[1])
    fully_shard([model[3], model[4]])  # torchtitan's grouping of the final norm with the head
    fully_shard(model)
    found = discover_norms(model)
    assert [(n.name, n.kind) for n in found.norms] == [("1", "layer"), ("3", "rms")], found
    assert not found.refused, found.refused
    for info, y in zip(found.norms, before):
        assert type(info.gain()) is torch.Tensor  # whole, not a shard
        assert torch.allclose(info.affine(normalise(x, info.eps(), info.kind).xhat), y, rtol=1e-5, atol=1e-5)
    print("ok")
""")


def test_norms_that_are_fsdp2_units_are_checked_on_their_gathered_weights():
    # fully_shard(norm) hooks the norm's forward to gather its shards: the float64 check calls
    # the norm's own forward on gathered float64 copies instead (a real process group of one)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
           "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", FSDP2_UNITS], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


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


class UnitOffset(nn.Module):
    """Gemma's RMSNorm: x / rms * (1 + weight), weight zero at initialisation."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def test_a_gain_of_one_plus_weight_is_found_by_its_output_even_at_initialisation():
    """Named like nothing lnmonitor knows, so declared; at weight = 0 a gain of `weight` would
    make every row look empty: the check picks 1 + weight from the output."""
    UnitOffset.lnmonitor_norm_kind = "rms"
    try:
        refused = discover_norms(nn.Sequential(UnitOffset(8)))
    finally:
        del UnitOffset.lnmonitor_norm_kind
    assert refused.norms == [] and "not reproduced as declared" in refused.refused[0].reason
    register_norm(UnitOffset, "rms", offset=1.0)
    try:
        (info,) = find_norms(nn.Sequential(UnitOffset(8)))
        assert info.kind == "rms" and torch.equal(info.gain(), torch.ones(8))
        register_norm(UnitOffset, "rms", gain=lambda m: 1.0 + m.weight)
        (info,) = find_norms(nn.Sequential(UnitOffset(8)))
        assert torch.equal(info.gain(), torch.ones(8))
        register_norm(UnitOffset, "rms", offset=0.0)  # a wrong declaration: refused, with numbers
        found = discover_norms(nn.Sequential(UnitOffset(8)))
        assert found.norms == [] and "max relative error" in found.refused[0].reason
        assert "register_norm(UnitOffset" in found.refused[0].reason
    finally:
        unregister_norm(UnitOffset)
    with pytest.raises(TypeError, match="offset"):
        register_norm(UnitOffset, "rms", offset="one")
    with pytest.raises(TypeError, match="gain"):
        register_norm(UnitOffset, "rms", gain=1.0)


def test_the_float64_reference_is_the_norms_own_output():
    torch.manual_seed(0)
    for module in (nn.LayerNorm(16), nn.RMSNorm(16, eps=1e-5), LitGPTRMSNorm(16)):
        with torch.no_grad():
            module.weight.uniform_(0.5, 1.5)
        (info,) = find_norms(nn.Sequential(module))
        x = torch.randn(5, 16, dtype=torch.float64)
        reference = copy.deepcopy(module).double()
        # as the invariance probe evaluates the final norm: its checked form on float64 rows
        ours = info.affine(normalise(x, info.eps(torch.float64), info.kind).xhat)
        torch.testing.assert_close(ours, reference(x), rtol=1e-12, atol=1e-12)


class LitGPTRMSNorm(nn.Module):
    """LitGPT's RMSNorm with add_unit_offset=True."""

    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.add_unit_offset = eps, True

    def forward(self, x):
        norm = torch.mean(x * x, dim=-1, keepdim=True)
        return x * torch.rsqrt(norm + self.eps) * (1 + self.weight)


def test_roles_from_what_the_gradient_does_at_each_input():
    norms = find_norms(nn.Sequential(*(nn.LayerNorm(8) for _ in range(5))))
    names = [n.name for n in norms]
    bypass = dict(zip(names, [0.9, 0.0, 0.5, 1e-7, 0.0], strict=True))
    roles = [n.role for n in assign_roles(norms, bypass)]
    assert roles == ["residual", "post", "residual", "post", "final"]
    qk = [n.with_role(None) for n in norms]
    object.__setattr__(qk[1], "name", "layers.0.attn.q_norm")
    assert assign_roles(qk, {**bypass, "layers.0.attn.q_norm": 0.0})[1].role == "qk"
    # a norm of the embeddings (BERT's embeddings.LayerNorm, BLOOM's word_embeddings_layernorm) is
    # its own role when no gradient goes around it; a model wrapped as `embedder` is not all embedding
    for name, role in (("bert.embeddings.LayerNorm", "embedding"), ("word_embeddings_layernorm", "embedding"),
                       ("embedder.layers.0.post_norm", "post")):
        renamed = [n.with_role(None) for n in norms]
        object.__setattr__(renamed[3], "name", name)
        assert assign_roles(renamed, {**bypass, name: 0.0})[3].role == role, name
    assert assign_roles(renamed, {**bypass, name: 0.5})[3].role == "residual"
    # no final norm: the last norm's input flows on, so it is only the last rung
    assert [n.role for n in assign_roles(norms, {**bypass, "4": 0.8})][-1] == "residual"
    # unmeasured (no gradient reached the input): a rung, not a branch
    assert [n.role for n in assign_roles(norms, {})] == ["residual"] * 4 + ["residual"]
    # ladder= names the rungs; the last of them is the final norm
    assert [n.role for n in assign_roles(norms, bypass, ladder=["0", "2"])] == [
        "residual", "post", "final", "post", "post"]


def test_the_final_norm_expected_before_a_step_is_assign_roles_rule_without_a_gradient():
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.LayerNorm(8) for _ in range(2))
    model.lnf = nn.LayerNorm(8)
    model.emb_norm = nn.LayerNorm(8)  # registered last, run first: named for the embeddings, no rung
    norms = find_norms(model)
    assert [n.name for n in norms][-1] == "emb_norm" and expected_final(norms) == "lnf"
    assert expected_final(norms, final_norm="blocks.1") == "blocks.1"  # named: that one
    assert expected_final(norms, ladder=["blocks.*"]) == "blocks.1"  # the ladder's last rung
    assert expected_final(norms[::-1]) == "blocks.0"  # the order given is the forward order
    assert expected_final([n for n in norms if n.name == "emb_norm"]) is None  # no rung, no final
