from pathlib import Path

import numpy as np
import pytest
import torch

from lnmonitor.errors import UsageError
from lnmonitor.tiny.corpus import DEFAULT_CORPUS_NAME, corpus_name, load_corpus
from lnmonitor.tiny.data import CharDataModule, CharVocab, RandomWindows, _spread_order, windows_at


def test_default_corpus_is_installed_text():
    text = load_corpus()
    assert len(text) > 100_000
    assert "class" in text and "def" in text


def test_the_second_corpus_is_the_standard_librarys_source(tmp_path, monkeypatch):
    import json
    import sysconfig

    source = load_corpus("python-source")
    assert source != load_corpus() and len(source) > 10 * len(load_corpus())
    # the library's own files are in it, whole; the installed packages (torch's) are not
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert (stdlib / "json" / "decoder.py").read_text(encoding="utf-8") in source
    assert Path(json.__file__).read_text(encoding="utf-8") in source
    assert Path(torch.__file__).read_text(encoding="utf-8") not in source
    assert corpus_name("python-source").startswith("the Python standard library's source")
    assert corpus_name(None) == corpus_name("python-help") == DEFAULT_CORPUS_NAME
    # a file that has a built-in corpus's name is read as ./NAME, and is named by its path
    monkeypatch.chdir(tmp_path)
    (tmp_path / "python-source").write_text("my own text " * 200, encoding="utf-8")
    assert load_corpus("./python-source") == "my own text " * 200
    assert corpus_name("./python-source") == "./python-source"


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


def test_a_misspelt_built_in_corpus_is_told_the_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match="does not exist.*built-in corpus: python-help, python-source"):
        load_corpus("python-sauce")


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
