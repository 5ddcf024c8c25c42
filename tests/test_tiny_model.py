import math

import pytest
import torch

from lnmonitor.tiny.model import GPTConfig, TinyGPT


def test_default_config_has_the_reference_parameter_count():
    model = TinyGPT(GPTConfig())
    assert sum(p.numel() for p in model.parameters()) == 816_128


def test_rms_variant_drops_only_the_norm_biases():
    layer = sum(p.numel() for p in TinyGPT(GPTConfig()).parameters())
    rms = sum(p.numel() for p in TinyGPT(GPTConfig(norm="rms")).parameters())
    assert layer - rms == 9 * 128  # nine norms, one bias vector each


def test_sdpa_and_explicit_attention_compute_the_same_function():
    torch.manual_seed(0)
    sdpa = TinyGPT(GPTConfig(width=32, heads=4, depth=2, context=16)).double()
    explicit = TinyGPT(GPTConfig(width=32, heads=4, depth=2, context=16, attention="explicit"))
    explicit = explicit.double()
    explicit.load_state_dict(sdpa.state_dict())
    idx = torch.randint(0, 65, (3, 16))
    torch.testing.assert_close(sdpa(idx)[0], explicit(idx)[0], rtol=0, atol=1e-12)


def test_attention_is_causal():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(width=32, heads=2, depth=2, context=16)).eval()
    idx = torch.randint(0, 65, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 65
    before, after = model(idx)[0], model(changed)[0]
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_loss_at_initialisation_is_the_uniform_guess_plus_half_the_logit_variance():
    # PyTorch's default head init, U(-1/sqrt(d), 1/sqrt(d)), on unit-variance lnf output
    # gives logits of variance 1/3, and small iid logits cost about var/2 nats over ln V.
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig())
    idx = torch.randint(0, 65, (8, 64))
    _, loss = model(idx, idx)
    assert abs(loss.item() - math.log(65) - 1 / 6) < 0.05


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"width": 130, "heads": 4}, "not divisible by heads"),
        ({"eps": 0.0}, "eps must be"),
        ({"eps": -1e-5}, "eps must be"),
        ({"eps": float("nan")}, "eps must be"),
        ({"norm": "batch"}, "norm must be"),
        ({"depth": 0}, "depth must be a positive integer"),
        ({"attention": "flash"}, "attention must be"),
    ],
)
def test_bad_configurations_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)


def test_too_long_input_is_rejected():
    model = TinyGPT(GPTConfig(width=16, heads=2, depth=1, context=8))
    with pytest.raises(ValueError, match="exceeds the context"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_gpt2_initialisation_starts_the_stream_small():
    """GPT-2's initialisation: weights N(0, 0.02), the residual projections 0.02 / sqrt(2 depth),
    biases 0; the embedding stream starts at rms ~0.028 (PyTorch's default: ~1.4)."""
    torch.manual_seed(0)
    gpt2 = TinyGPT(GPTConfig(init="gpt2"))
    torch.manual_seed(0)
    default = TinyGPT(GPTConfig())
    idx = torch.randint(0, 65, (8, 64))

    def stream(m):
        return (m.tok_emb(idx) + m.pos_emb(torch.arange(64))).pow(2).mean().sqrt().item()

    assert 0.025 < stream(gpt2) < 0.032 and stream(default) > 1.0
    assert gpt2.blocks[0].mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert gpt2.blocks[1].attn.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.03)
    assert gpt2.blocks[0].mlp.fc.bias.abs().max().item() == 0.0
    with pytest.raises(ValueError, match="init must be one of"):
        GPTConfig(init="xavier")


@pytest.mark.parametrize("decay, groups", [("all", [(0.1, 25)]), ("matrices", [(0.1, 11), (0.0, 14)])])
def test_weight_decay_on_every_parameter_as_the_study_or_on_matrices(decay, groups):
    from lnmonitor.tiny.module import TinyGPTModule

    module = TinyGPTModule("abcdefgh", width=16, depth=2, heads=2, context=8, decay=decay)
    optimizer = module.configure_optimizers()["optimizer"]
    assert [(g["weight_decay"], len(g["params"])) for g in optimizer.param_groups] == groups

