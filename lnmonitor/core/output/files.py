"""Files the experiments write: atomically (a temporary file moved into place with ``os.replace``, so a
reader sees the old file or the new one, never half), with the mode the umask gives, and as strict JSON
(non-finite floats become ``null``).  Standard library only, like everything ``lnmonitor report`` needs.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from pathlib import Path

from lnmonitor.errors import UsageError

__all__ = ["atomic_write_bytes", "atomic_write_json", "atomic_write_text", "finite", "read_json", "to_json"]


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    # 0o666 through the umask, as open() does (tempfile.mkstemp would make it 0600)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def to_json(obj) -> str:
    """Strict JSON (no NaN/Infinity tokens: non-finite floats become null), sorted keys."""
    return json.dumps(finite(obj), indent=2, sort_keys=True, allow_nan=False) + "\n"


def finite(obj):
    """``obj`` ready for strict JSON: non-finite floats become None, numpy scalars python numbers, tuples
    lists, keys strings."""
    if hasattr(obj, "dtype") and hasattr(obj, "item"):  # a numpy scalar
        obj = obj.item()
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_text(path, to_json(obj))


def read_json(path: Path, what: str) -> dict:
    """Parse a JSON object, or raise :class:`UsageError` saying which file is corrupt."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"{what} {str(path)!r} is unreadable or corrupt ({type(err).__name__}: {err}); "
                         "move it away or choose another --out") from None
    if not isinstance(obj, dict):
        raise UsageError(f"{what} {str(path)!r} is corrupt (not a JSON object); move it away")
    return obj
