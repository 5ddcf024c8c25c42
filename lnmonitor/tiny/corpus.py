"""The text the tiny GPT learns from: the two corpora every CPython ships (nothing is downloaded) and the
checks on a user's file.  No torch is imported, so the command line can check ``--data`` first."""

from __future__ import annotations

import sysconfig
from collections.abc import Callable
from pathlib import Path

from lnmonitor.errors import UsageError

__all__ = ["BUILT_IN", "DEFAULT_CORPUS_NAME", "corpus_name", "default_corpus", "load_corpus", "python_source"]


def default_corpus() -> str:
    """The Python help topics, concatenated in sorted key order (about 465,000 characters)."""
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics))


def python_source() -> str:
    """The standard library's ``.py`` files (not ``site-packages``), concatenated in sorted path order,
    undecodable bytes replaced by U+FFFD (about 31.5 million characters on CPython 3.11.7)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.parts))
    return "".join(p.read_text(encoding="utf-8", errors="replace") for p in files)


# name on the command line -> (what a report calls it, the function that returns the text)
BUILT_IN: dict[str, tuple[str, Callable[[], str]]] = {
    "python-help": ("pydoc_data.topics (the Python help text shipped with CPython)", default_corpus),
    "python-source": ("the Python standard library's source (its .py files, sorted by path)", python_source),
}
DEFAULT_CORPUS_NAME = BUILT_IN["python-help"][0]


def corpus_name(data: str | Path | None) -> str:
    """What records and reports call the text ``--data`` chose: a built-in corpus's description, else the
    file's path."""
    if data is None or str(data) in BUILT_IN:
        return BUILT_IN[str(data or "python-help")][0]
    return str(data)


def load_corpus(path: str | Path | None = None, *, min_chars: int = 1000) -> str:
    """A UTF-8 text file, or a built-in corpus by its name in :data:`BUILT_IN` (None: ``python-help``; a
    file with such a name is read as ``./python-source``).  :class:`UsageError` for a missing, empty,
    non-UTF-8 or too-short file."""
    if path is None or str(path) in BUILT_IN:
        return BUILT_IN[str(path or "python-help")][1]()
    path = Path(path)
    where = f"data file {str(path)!r}"
    if not path.is_file():
        raise UsageError(f"{where} does not exist: pass a UTF-8 text file to --data, or a built-in corpus: "
                         f"{', '.join(BUILT_IN)}")
    raw = path.read_bytes()
    if not raw.strip():
        raise UsageError(f"{where} is empty: pass a UTF-8 text file with text in it")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(f"{where} is not UTF-8 (byte {err.start}): convert it to UTF-8 first") from None
    if len(text) < min_chars:
        raise UsageError(f"{where} has {len(text)} characters, fewer than the {min_chars} needed for a "
                         "training and a validation split: pass a longer text")
    return text
