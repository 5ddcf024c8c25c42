import numpy as np
import pytest
import torch

from lnmonitor.errors import UsageError
from lnmonitor.tiny.corpus import load_corpus
from lnmonitor.tiny.data import CharDataModule, CharVocab, RandomWindows, _spread_order, windows_at


def test_default_corpus_is_installed_text():
    text = load_corpus()
    assert len(text) > 100_000
    assert "class" in text and "def" in text


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        (b"", "is empty"),
        (b"  \n\t ", "is empty"),
        (b"\xff\xfe\x00bad" * 400, "is not UTF-8"),
        (b"short text", "fewer than"),
    ],
)
def test_bad_data_files_are_explained(tmp_path, content, message):
    path = tmp_path / "data.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UsageError, match=message):
        load_corpus(path)


def test_vocab_round_trip():
    vocab = CharVocab.from_text("hello, world")
    assert vocab.decode(vocab.encode("lol, word")) == "lol, word"
    with pytest.raises(UsageError, match="not in the model's vocabulary"):
        vocab.encode("Z")


def test_batches_are_reproducible_and_depend_on_seed_rank_and_index():
    tokens = torch.arange(10_000)
    a = RandomWindows(tokens, 8, 4, seed=1, total=10)
    b = RandomWindows(tokens, 8, 4, seed=1, total=10)
    assert torch.equal(a.batch(3)[0], b.batch(3)[0])
    assert not torch.equal(a.batch(3)[0], a.batch(4)[0])
    assert not torch.equal(a.batch(3)[0], RandomWindows(tokens, 8, 4, seed=2, total=10).batch(3)[0])
    assert not torch.equal(a.batch(3)[0], RandomWindows(tokens, 8, 4, 1, 10, rank=1).batch(3)[0])
    x, y = a.batch(0)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next characters


def test_resumed_stream_continues_where_it_stopped():
    tokens = torch.arange(10_000)
    full = [x for x, _ in RandomWindows(tokens, 8, 4, seed=0, total=6)]
    resumed = [x for x, _ in RandomWindows(tokens, 8, 4, seed=0, total=6, start=4)]
    assert len(resumed) == 2
    assert all(torch.equal(p, q) for p, q in zip(full[4:], resumed, strict=True))


def test_validation_windows_are_fixed_and_held_out():
    text = load_corpus()
    one = CharDataModule(text, seed=0)
    two = CharDataModule(text, seed=7)
    first, second = one.val_batches(), two.val_batches()
    assert len(first) == len(second) and len(first) > 1
    assert all(torch.equal(p[0], q[0]) for p, q in zip(first, second, strict=True))
    assert one.val_tokens.numel() == pytest.approx(0.1 * len(text), abs=1)


def test_text_too_short_for_the_context():
    with pytest.raises(UsageError, match="too short for context"):
        CharDataModule("abcdefghij" * 100, context=128)


def test_every_prefix_of_the_held_out_windows_spreads_over_the_held_out_text():
    """The held-out windows come in an order whose every prefix is spread over the whole
    held-out text (the first ones are the invariance probe's rows)."""
    order = _spread_order(512)
    assert sorted(order.tolist()) == list(range(512))
    for n in (8, 64, 200):
        gaps = np.diff(np.sort(order[:n].numpy()))
        assert gaps.max() <= 2 * 512 / n, n  # within twice the even spacing: no block, no hole
    data = CharDataModule(load_corpus(), val_windows=512)
    x = torch.cat([b[0] for b in data.val_batches()])
    high = len(data.val_tokens) - data.context - 1
    offsets = torch.linspace(0, high, 512).long()[order]
    expected, _ = windows_at(data.val_tokens, offsets, data.context)
    assert torch.equal(x, expected)
