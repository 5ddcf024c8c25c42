"""lnmonitor.core.hooks: one place for temporary hooks, eval mode restored, a float64 forward that leaves
the module as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import gpt
from torch import nn

from lnmonitor.core.float64 import float64_forward
from lnmonitor.core.hooks import Hooks, eval_mode, measuring, unmeasured


def test_hooks_are_removed_when_the_block_raises():
    lin = nn.Linear(2, 2)
    with pytest.raises(RuntimeError), Hooks() as hooks:
        hooks.forward(lin, lambda m, a, o: None)
        hooks.forward_pre(lin, lambda m, a: None)
        assert hooks and lin._forward_hooks and lin._forward_pre_hooks
        raise RuntimeError("the forward failed")
    assert not lin._forward_hooks and not lin._forward_pre_hooks and not hooks


def test_eval_mode_restores_every_flag_even_on_error():
    model = gpt(depth=2).model
    model.train()
    model.blocks[0].eval()
    with pytest.raises(ValueError), eval_mode(model):
        assert not any(m.training for m in model.modules())
        raise ValueError
    assert model.training and not model.blocks[0].training and model.blocks[1].training


def test_unmeasured_nests_and_recovers():
    assert measuring()
    with unmeasured():
        with unmeasured():
            assert not measuring()
        assert not measuring()
    assert measuring()


def test_the_float64_forward_is_the_module_in_float64_and_changes_nothing():
    torch.manual_seed(0)
    ln = nn.LayerNorm(16)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.normal_()
    state = copy.deepcopy(ln.state_dict())
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    y = float64_forward(ln)(x)
    ref = copy.deepcopy(ln).double()(x)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    (g,) = torch.autograd.grad(y.sum(), x)  # gradients reach the input
    assert torch.isfinite(g).all() and ln.weight.grad is None
    assert ln.weight.dtype == torch.float32
    assert all(torch.equal(v, state[k]) for k, v in ln.state_dict().items())


def test_the_float64_forward_runs_no_hook_of_the_module():
    # the self-check evaluates every norm once when a monitor is built: the user's own hooks on
    # the norm, and the global module hooks, must not see that call
    ln = nn.LayerNorm(8)
    calls = []
    ln.register_forward_pre_hook(lambda m, a: calls.append("pre"))
    ln.register_forward_hook(lambda m, a, o: calls.append("forward"))
    handle = nn.modules.module.register_module_forward_hook(lambda m, a, o: calls.append("global"))
    try:
        y = float64_forward(ln)(torch.randn(2, 8, dtype=torch.float64))
    finally:
        handle.remove()
    assert calls == [] and y.dtype == torch.float64


def test_a_forward_hook_sees_the_callers_tensor_where_a_pre_hook_passed_an_alias():
    # FSDP2 replaces a unit's input by an alias that carries only the gradient through the
    # unit; a hook that measures the input's whole gradient needs the caller's tensor. A pre-hook
    # that changes the values gives the module its input: the hook sees what the module got.
    x = torch.randn(3, 4, requires_grad=True)
    for pre, expected in ((lambda m, a: (a[0].view_as(a[0]),), x), (lambda m, a: (2 * a[0],), 2 * x)):
        norm = nn.LayerNorm(4)
        norm.register_forward_pre_hook(pre)
        seen = []
        with Hooks() as hooks:
            hooks.forward(norm, lambda m, args, out, seen=seen: seen.append(args[0]))
            norm(x)
        assert (seen[0] is x) == (expected is x)
        assert torch.equal(seen[0], expected)


def test_a_forward_hook_may_replace_the_output_and_is_removed_with_its_pre_hook():
    lin = nn.Linear(4, 4)
    with Hooks() as hooks:
        hooks.forward(lin, lambda m, args, out: out * 0)
        assert torch.equal(lin(torch.randn(2, 4)), torch.zeros(2, 4))
    assert not lin._forward_hooks and not lin._forward_pre_hooks



def test_every_module_hook_goes_through_the_one_place():
    """Only :class:`lnmonitor.core.hooks.Hooks` registers module hooks (its handles are
    removed together, also when a forward raises); tensor and autograd-node hooks die with
    their graph and are not module hooks."""
    import re
    from pathlib import Path

    import lnmonitor

    root = Path(lnmonitor.__file__).parent
    call = re.compile(r"\.register_(forward|forward_pre|full_backward|full_backward_pre|module_\w+)_hook\(")
    outside = [f"{path.relative_to(root)}:{n}" for path in sorted(root.rglob("*.py"))
               if path.name != "hooks.py"
               for n, line in enumerate(path.read_text().splitlines(), 1) if call.search(line)]
    assert not outside, f"module hooks registered beside Hooks: {outside}"


def test_model_class_is_the_users_class_inside_compile_and_the_outer_wrappers():
    from lnmonitor.core.wrappers import model_class

    class TinyNet(nn.Sequential):
        pass

    model = TinyNet(nn.Linear(4, 4), nn.LayerNorm(4))
    assert model_class(model) == "TinyNet"
    assert model_class(torch.compile(model, backend="eager")) == "TinyNet"
    assert model_class(nn.DataParallel(torch.compile(model, backend="eager"))) == "TinyNet"
