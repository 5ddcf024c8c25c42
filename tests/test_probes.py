"""Structural probes and StructureProbe on a freshly trained tiny GPT (issue #5)."""

import copy
import math

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader

from lnmonitor import geometry
from lnmonitor.probe_callback import StructureProbe
from lnmonitor.probes import (
    SequenceCapture,
    find_blocks,
    measure_norm_rows,
    numerical_rank,
    probe_block_rank,
    probe_norm_jacobian,
    resolve_branch,
    share_table,
    sigma_ladder,
)
from lnmonitor.taps import find_norms
from lnmonitor.tiny.data import CharDataModule, load_corpus
from lnmonitor.tiny.module import TinyGPTModule
from lnmonitor.tiny.train import Recipe, fit, load_module

WIDTH = 64


class MemoryLogger(Logger):
    """Keeps every logged metric in memory."""

    def __init__(self):
        super().__init__()
        self.logged: list[tuple[int, dict]] = []

    @property
    def name(self):
        return "memory"

    @property
    def version(self):
        return 0

    def log_metrics(self, metrics, step=None):
        self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny GPT trained for 60 steps with the probe attached, and its held-out batches."""
    probe = StructureProbe()
    logger = MemoryLogger()
    recipe = Recipe(width=WIDTH, depth=2, heads=2, context=32, max_steps=60, val_every=30)
    text = load_corpus()
    result = fit(recipe, text, tmp_path_factory.mktemp("probe"), callbacks=[probe], logger=logger,
                 progress=False)
    module = load_module(result.checkpoint)
    data = CharDataModule(text, vocab=module.vocab, context=recipe.context)
    return {"module": module, "batches": data.val_batches()[:2], "probe": probe, "logger": logger}


def captured(module, batch):
    norms, blocks = find_norms(module), find_blocks(module)
    with torch.no_grad(), SequenceCapture(blocks, norms) as cap:
        module(batch[0][:1])
    return norms, blocks, cap


# ---------------------------------------------------------------------------
# the findings
# ---------------------------------------------------------------------------


def test_every_norm_jacobian_matches_autograd_to_float64_precision(trained):
    module = trained["module"]
    norms, _, cap = captured(module, trained["batches"][0])
    assert len(norms) == 5  # 2 blocks x (ln1, ln2) + lnf
    for info in norms:
        for position in (0, -1):
            p = probe_norm_jacobian(info, cap.norms[info.name][position])
            assert p.max_abs_error <= 1e-13 * p.max_abs_entry, (info.name, p.max_abs_error)
            assert p.rank == WIDTH - 1 and p.rank_eps0 == WIDTH - 2, info.name  # scale passes eps/(v+eps)
            assert 0 < p.transmission < 0.1
            assert p.singular_values[-2] == pytest.approx(p.transmission * p.inv_sigma, rel=0.5)


def test_residual_restores_full_rank_the_branch_does_not(trained):
    module = trained["module"]
    _, blocks, cap = captured(module, trained["batches"][0])
    assert [name for name, _ in blocks] == ["model.blocks.0", "model.blocks.1"]
    for name, block in blocks:
        for position in (0, 17, -1):
            p = probe_block_rank(block, cap.blocks[name], position=position, name=name)
            assert p.branch == "ln1 -> attn"
            assert p.block_rank == WIDTH and p.block_sv_min > 1e-3, (name, position, p.block_sv_min)
            assert p.branch_rank < WIDTH, (name, position)
            assert p.branch_sv_min < 1e-12 * p.branch_sv_max  # ln1 deletes the 1 direction exactly
            assert "numpy" in p.rank_rule and p.block_tol == pytest.approx(
                p.block_sv_max * WIDTH * np.finfo(np.float64).eps)


def test_gain_spread_is_finite_reported_and_moved_by_training(trained):
    module = trained["module"]
    norms, _, cap = captured(module, trained["batches"][0])
    for info in norms:
        p = probe_norm_jacobian(info, cap.norms[info.name][-1])
        assert math.isfinite(p.gain_spread) and 1.0 < p.gain_spread < 10.0, info.name
        g = info.weight().detach().double().abs()
        assert p.gain_spread <= float(g.max() / g.min()) * (1 + 1e-9)  # P cannot add spread
    fresh = TinyGPTModule(module.vocab.chars, width=WIDTH, depth=2, heads=2, context=32)
    info = find_norms(fresh)[0]
    p = probe_norm_jacobian(info, torch.randn(WIDTH))
    assert p.gain_spread == pytest.approx(1.0, abs=1e-12)  # gain of ones: a flat spectrum


def test_probe_logs_rank_and_gain_spread_under_lnmonitor_probe(trained):
    probe, logger = trained["probe"], trained["logger"]
    logged = [m for _, m in logger.logged if any(k.startswith("lnmonitor/probe/") for k in m)]
    assert len(logged) == 2  # two validation runs (steps 30 and 60), no sanity check
    last = logged[-1]
    assert last["lnmonitor/probe/block_rank/model.blocks.0"] == WIDTH
    assert last["lnmonitor/probe/branch_rank/model.blocks.1"] < WIDTH
    for key in ("block_sv_min", "block_sv_max", "branch_sv_min", "branch_sv_max"):
        assert f"lnmonitor/probe/{key}/model.blocks.1" in last
    spreads = {k: v for k, v in last.items() if k.startswith("lnmonitor/probe/gain_spread/")}
    assert set(spreads) == {f"lnmonitor/probe/gain_spread/{i.name}" for i in find_norms(trained["module"])}
    assert all(math.isfinite(v) and v >= 1.0 for v in spreads.values())
    assert probe.last is not None and probe.last.position == 31 and probe.last.step == 60


# ---------------------------------------------------------------------------
# the block Jacobian itself
# ---------------------------------------------------------------------------


def test_block_jacobian_equals_a_direct_autograd_jacobian(trained):
    module = trained["module"]
    _, blocks, cap = captured(module, trained["batches"][0])
    name, block = blocks[1]
    h = cap.blocks[name].double()
    twin = copy.deepcopy(block).double()
    pos = 20

    def at(row):
        seq = torch.cat([h[:pos], row[None], h[pos + 1:]])
        return twin(seq[None])[0, pos]

    direct = torch.autograd.functional.jacobian(at, h[pos].clone())
    p = probe_block_rank(block, cap.blocks[name], position=pos)
    np.testing.assert_allclose(p.block_singular_values, torch.linalg.svdvals(direct).numpy(),
                               rtol=1e-10, atol=1e-14)
    assert block.ln1.weight.dtype == torch.float32  # the model was not touched


def test_block_without_a_residual_loses_rank():
    class Bare(nn.Module):  # ln -> linear, no residual: rank at most d - 1
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(16)
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return self.fc(self.ln(x))

    class Residual(Bare):
        def forward(self, x):
            return x + self.fc(self.ln(x))

    torch.manual_seed(0)
    h = torch.randn(5, 16)
    bare = probe_block_rank(Bare(), h, position=2)
    assert bare.block_rank == 15 and bare.branch_rank == 15 and bare.branch == "ln -> fc"
    res = probe_block_rank(Residual(), h, position=2)
    assert res.block_rank == 16 and res.branch_rank == 15


def test_numerical_rank_states_its_tolerance():
    sv = torch.tensor([2.0, 1.0, 1e-9, 1e-20], dtype=torch.float64)
    assert numerical_rank(sv) == (3, 2.0 * 4 * np.finfo(np.float64).eps)
    assert numerical_rank(sv, rtol=1e-6) == (2, 2e-6)


def test_find_blocks_and_branch_resolution(trained):
    module = trained["module"]
    assert [n for n, _ in find_blocks(module, "model.blocks")] == ["model.blocks.0", "model.blocks.1"]
    with pytest.raises(ValueError, match="no submodule"):
        find_blocks(module, "model.layers")
    with pytest.raises(ValueError, match="not a non-empty ModuleList"):
        find_blocks(module, "model.lnf")
    with pytest.raises(ValueError, match="ModuleList of repeated blocks"):
        find_blocks(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
    block = module.model.blocks[0]
    assert resolve_branch(block)[0] == "ln1 -> attn"
    assert resolve_branch(block, ("ln2", "mlp"))[0] == "ln2 -> mlp"
    with pytest.raises(ValueError, match="no child 'norm'"):
        resolve_branch(block, ("norm", "attn"))
    with pytest.raises(ValueError, match="cannot find the branch"):
        resolve_branch(nn.Linear(4, 4))


# ---------------------------------------------------------------------------
# shares and the ladder on held-out batches
# ---------------------------------------------------------------------------


def test_shares_match_a_direct_autograd_computation_and_grads_stay_untouched(trained):
    module = trained["module"]
    batches = trained["batches"][:1]
    rows = measure_norm_rows(module, batches, lambda m, b: m(*b)[1])
    assert all(p.grad is None for p in module.parameters())
    names = [r.name for r in rows]
    assert names == ["model.blocks.0.ln1", "model.blocks.0.ln2", "model.blocks.1.ln1",
                     "model.blocks.1.ln2", "model.lnf"]  # call order

    # direct: retain the final norm's input and output gradient, w = g * dL/dy
    lnf = module.model.lnf
    kept = {}

    def hook(mod, args, out):
        kept["x"] = args[0].detach()
        out.register_hook(lambda g: kept.__setitem__("g", g))

    handle = lnf.register_forward_hook(hook)
    with torch.enable_grad():
        module(*batches[0])[1].backward()
    handle.remove()
    module.zero_grad(set_to_none=True)
    x = kept["x"].reshape(-1, WIDTH).double()
    w = (lnf.weight.detach().double() * kept["g"].reshape(-1, WIDTH).double())
    u1 = torch.full((WIDTH,), WIDTH**-0.5, dtype=torch.float64)
    xc = x - x.mean(-1, keepdim=True)
    u2 = xc / xc.norm(dim=-1, keepdim=True)
    direct = torch.sqrt((w @ u1) ** 2 + (w * u2).sum(-1) ** 2) / w.norm(dim=-1)
    np.testing.assert_allclose(rows[-1].share, direct.numpy(), rtol=1e-9)

    table = share_table(rows)
    n = batches[0][0].numel()
    for row in table:
        assert row.rows + row.skipped == n
        assert row.baseline_median == pytest.approx(geometry.share_median(WIDTH, 2))
        assert row.baseline_max == pytest.approx(geometry.max_share_median(WIDTH, 2, row.rows))
        assert row.deletion_cost == pytest.approx(1 - math.sqrt(1 - row.median**2))


def test_ladder_reads_the_residual_stream_points_of_the_tiny_gpt(trained):
    """Model-specific check: the norms' inputs are embedding, after each attention, after each MLP."""
    module = trained["module"]
    batch = trained["batches"][0]
    rows = measure_norm_rows(module, [batch], lambda m, b: m(*b)[1])
    gpt = module.model
    with torch.no_grad():
        x = gpt.tok_emb(batch[0]) + gpt.pos_emb(torch.arange(batch[0].shape[1]))
        points = [x]
        for block in gpt.blocks:
            x = x + block.attn(block.ln1(x))
            points.append(x)
            x = x + block.mlp(block.ln2(x))
            points.append(x)
    assert len(points) == len(rows)
    for r, p in zip(rows, points, strict=True):
        p = p.reshape(-1, WIDTH).double()
        np.testing.assert_allclose(r.rms, p.pow(2).mean(-1).sqrt().numpy(), rtol=1e-5)
        sigma = torch.sqrt(p.var(-1, unbiased=False) + 1e-5)
        np.testing.assert_allclose(r.sigma, sigma.numpy(), rtol=1e-5)
    ladder, attenuation, growth = sigma_ladder(rows, {"model.blocks.0.ln1": "embedding"})
    assert ladder[0].point == "embedding" and ladder[1].point == "input of model.blocks.0.ln2"
    assert attenuation == pytest.approx(ladder[0].inv_sigma / ladder[-1].inv_sigma)
    assert growth == pytest.approx(ladder[-1].rms / ladder[0].rms)


def test_rmsnorm_model_has_a_one_dimensional_dead_subspace():
    torch.manual_seed(1)
    module = TinyGPTModule("abcdefgh", width=16, depth=1, heads=2, context=8, norm="rms").eval()
    idx = torch.randint(0, 8, (2, 8))
    norms, blocks, cap = captured(module, (idx, idx))
    p = probe_norm_jacobian(norms[0], cap.norms[norms[0].name][3])
    assert p.kind == "rms" and p.rank == 16 and p.rank_eps0 == 15
    assert p.max_abs_error <= 1e-13 * p.max_abs_entry
    b = probe_block_rank(blocks[0][1], cap.blocks[blocks[0][0]], position=3)
    # RMSNorm deletes only the scale direction, and passes eps/(ms+eps) of it: numerically full
    # rank at numpy's tolerance, one short at a relative 1e-3.
    assert b.block_rank == 16 and b.branch_rank == 16 and b.branch_sv_min < 1e-3 * b.branch_sv_max
    loose = probe_block_rank(blocks[0][1], cap.blocks[blocks[0][0]], position=3, rtol=1e-3)
    assert loose.block_rank == 16 and loose.branch_rank == 15 and loose.rank_rule == "sv > 0.001 * s_max"
    rows = measure_norm_rows(module, [(idx, idx)], lambda m, bt: m(*bt)[1])
    assert share_table(rows)[0].baseline_median == pytest.approx(geometry.share_median(16, 1))


# ---------------------------------------------------------------------------
# StructureProbe as a Lightning callback
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"every_n_validations": 0}, "positive integer"),
        ({"every_n_validations": 1.5}, "positive integer"),
        ({"position": "last"}, "integer sequence position"),
        ({"blocks": 3}, "qualified name"),
        ({"branch": "ln1"}, "sequence of child names"),
        ({"rtol": 0.0}, r"float in \(0, 1\)"),
        ({"rtol": 2}, r"float in \(0, 1\)"),
        ({"norms": "yes"}, "True or False"),
    ],
)
def test_probe_rejects_bad_arguments_early(kwargs, message):
    with pytest.raises(MisconfigurationException, match=message):
        StructureProbe(**kwargs)


def small_module():
    return TinyGPTModule("abcdefgh", width=16, depth=1, heads=2, context=8, max_steps=4)


def small_loader(n=2):
    idx = torch.randint(0, 8, (n, 4, 8), generator=torch.Generator().manual_seed(0))
    return DataLoader([(x, x) for x in idx], batch_size=None)


def trainer(**kwargs):
    defaults = dict(max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
    defaults.update(kwargs)
    return L.Trainer(**defaults)


def test_probe_setup_says_what_to_do_when_the_model_has_no_blocks():
    class NoBlocks(TinyGPTModule):
        def __init__(self):
            super().__init__("abcdefgh", width=16, depth=1, heads=2, context=8)
            self.model.blocks = nn.Sequential(*self.model.blocks)  # not a ModuleList

    with pytest.raises(MisconfigurationException, match="blocks='...'"):
        trainer(callbacks=[StructureProbe()]).validate(NoBlocks(), small_loader(), verbose=False)
    with pytest.raises(MisconfigurationException, match="no submodule 'model.layers'"):
        trainer(callbacks=[StructureProbe(blocks="model.layers")]).validate(
            small_module(), small_loader(), verbose=False)


def test_probe_cadence_sanity_check_and_no_hooks_left():
    probe = StructureProbe(every_n_validations=2, position=3)
    logger = MemoryLogger()
    module = small_module()
    t = trainer(callbacks=[probe], logger=logger, val_check_interval=1, check_val_every_n_epoch=None,
                num_sanity_val_steps=1, log_every_n_steps=1)
    t.fit(module, small_loader(4), small_loader())
    steps = [s for s, m in logger.logged if "lnmonitor/probe/block_rank/model.blocks.0" in m]
    assert steps == [1, 3]  # validations after steps 1..4, every second one; not the sanity check
    assert probe.state_dict() == {"validations": 4}
    assert probe.state_key == "StructureProbe{'every_n_validations': 2, 'position': 3, 'blocks': None}"
    for m in module.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks
    assert probe.last.blocks[0].position == 3


def test_probe_resumes_its_cadence_from_a_checkpoint(tmp_path):
    first = StructureProbe(every_n_validations=2)
    t = trainer(callbacks=[first], max_steps=3, val_check_interval=1, check_val_every_n_epoch=None,
                num_sanity_val_steps=0)
    t.fit(small_module(), small_loader(4), small_loader())
    t.save_checkpoint(tmp_path / "three.ckpt")
    resumed, logger = StructureProbe(every_n_validations=2), MemoryLogger()
    t = trainer(callbacks=[resumed], logger=logger, max_steps=4, val_check_interval=1,
                check_val_every_n_epoch=None, num_sanity_val_steps=0, log_every_n_steps=1)
    t.fit(small_module(), small_loader(4), small_loader(), ckpt_path=tmp_path / "three.ckpt")
    steps = [s for s, m in logger.logged if "lnmonitor/probe/block_rank/model.blocks.0" in m]
    assert resumed.state_dict() == {"validations": 4} and steps == []  # 4th validation: not due


def test_probe_runs_under_trainer_validate_inference_mode():
    probe = StructureProbe()
    module = small_module()
    trainer(callbacks=[probe]).validate(module, small_loader(), verbose=False)
    assert probe.last.blocks[0].block_rank == 16 and probe.last.blocks[0].branch_rank < 16
    assert len(probe.last.norms) == 3


def test_structure_probe_is_exported():
    import lnmonitor

    assert lnmonitor.StructureProbe is StructureProbe
