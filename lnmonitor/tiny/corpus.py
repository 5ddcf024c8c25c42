"""The text the tiny GPT learns from: the default corpus and the checks on a user's file.

The default corpus is the English help text that every CPython installation carries in
``pydoc_data.topics``, so nothing is downloaded at run time.  This module imports no
torch, so the command line can check ``--data`` before loading it.
"""

from __future__ import annotations

from pathlib import Path

from lnmonitor.errors import UsageError

__all__ = ["DEFAULT_CORPUS_NAME", "default_corpus", "load_corpus"]

DEFAULT_CORPUS_NAME = "pydoc_data.topics (the Python help text shipped with CPython)"


def default_corpus() -> str:
    """The Python help topics, concatenated in sorted key order (about 465,000 characters)."""
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics))


def load_corpus(path: str | Path | None = None, *, min_chars: int = 1000) -> str:
    """Read a UTF-8 text file, or the default corpus when ``path`` is None.

    Raises :class:`UsageError` for a missing, empty, non-UTF-8 or too-short file.
    """
    if path is None:
        return default_corpus()
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"data file {str(path)!r} does not exist: pass a UTF-8 text file to --data")
    raw = path.read_bytes()
    if not raw.strip():
        raise UsageError(f"data file {str(path)!r} is empty: pass a UTF-8 text file with text in it")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(
            f"data file {str(path)!r} is not UTF-8 (byte {err.start}): convert it to UTF-8 first"
        ) from None
    if len(text) < min_chars:
        raise UsageError(
            f"data file {str(path)!r} has {len(text)} characters, fewer than the {min_chars} needed "
            "for a training and a validation split: pass a longer text"
        )
    return text
