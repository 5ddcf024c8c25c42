"""Checkpoints of the tiny GPT recipe, loaded with ``torch.load(weights_only=True)`` (a checkpoint cannot
run code); anything wrong with a file is a one-line :class:`~lnmonitor.errors.UsageError`."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from lnmonitor.errors import UsageError

__all__ = ["checkpoint_file", "checkpoint_state", "load_checkpoint"]

NOT_TORCH = "is not a PyTorch checkpoint (neither a torch zip archive nor a pickle torch can read)"
# how a torch.save file begins: a zip archive's local header, or a pickle's PROTO opcode
TORCH_MAGIC = (b"PK\x03\x04", b"\x80")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else type(err).__name__


def _load_error(err: BaseException) -> str:
    """What a ``torch.load(weights_only=True)`` failure means, in one line."""
    text = str(err)
    if isinstance(err, (OSError, EOFError)) or "zip archive" in text or "central directory" in text:
        return "is truncated or corrupted (its archive is incomplete): write it again or pass another"
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if found:
        return (f"holds a Python object ({found.group(1)}) that safe loading (weights_only=True) refuses: "
                "it is not a train-tiny or eps-compare checkpoint")
    if "Weights only load failed" in text or "load key" in text or "operand" in text:
        return NOT_TORCH
    return f"cannot be read as a PyTorch checkpoint: {_first_line(err)}"


def checkpoint_file(path: str | Path) -> Path:
    """``path``, once it is a non-empty file that begins as a torch checkpoint does; otherwise
    :class:`UsageError` (no torch is imported)."""
    path = Path(path)
    where = f"checkpoint {str(path)!r}"
    if not path.exists():
        raise UsageError(f"{where} does not exist: pass a .ckpt written by train-tiny")
    if not path.is_file():
        raise UsageError(f"{where} is not a file: pass a .ckpt written by train-tiny")
    try:
        with path.open("rb") as handle:
            head = handle.read(4)
    except PermissionError:
        raise UsageError(f"{where} cannot be read: permission denied") from None
    if not head:
        raise UsageError(f"{where} is empty: pass a .ckpt written by train-tiny")
    if not head.startswith(TORCH_MAGIC):
        raise UsageError(f"{where} {NOT_TORCH}")
    return path


def load_checkpoint(path: str | Path):
    """``(module, step)``: the :class:`TinyGPTModule` of a train-tiny or eps-compare checkpoint (CPU, eval
    mode) and its ``global_step`` (None when absent).  A file that is no such checkpoint, or whose weights
    disagree with its hyperparameters or are not finite, raises :class:`UsageError`."""
    import torch

    from lnmonitor.tiny.module import TinyGPTModule

    path = checkpoint_file(path)
    where = f"checkpoint {str(path)!r}"
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - every failure to read the file is the same user error
        raise UsageError(f"{where} {_load_error(err)}") from None
    if not (isinstance(ckpt, dict) and isinstance(ckpt.get("hyper_parameters"), dict)
            and isinstance(ckpt.get("state_dict"), dict)):
        raise UsageError(f"{where} is a torch file but not a train-tiny checkpoint: it lacks the model's "
                         "hyperparameters and state_dict (a plain state_dict cannot be analysed; pass "
                         "last.ckpt)")
    accepted = set(inspect.signature(TinyGPTModule.__init__).parameters) - {"self"}
    kwargs = {k: v for k, v in ckpt["hyper_parameters"].items() if k in accepted}
    if "vocab" not in kwargs:
        raise UsageError(f"{where} has hyperparameters but no vocabulary: it was not written by train-tiny "
                         "or eps-compare")
    try:
        module = TinyGPTModule(**kwargs)
    except (TypeError, ValueError) as err:
        raise UsageError(f"{where} has invalid hyperparameters: {_first_line(err)}") from None
    try:
        module.load_state_dict(ckpt["state_dict"], strict=True)
    except RuntimeError as err:
        detail = [ln.strip() for ln in str(err).splitlines()[1:] if ln.strip()]
        raise UsageError(
            f"{where}: the weights do not match the configuration stored with them (width "
            f"{kwargs.get('width')}, depth {kwargs.get('depth')}, vocab {len(kwargs['vocab'])}): "
            f"{detail[0][:200] if detail else _first_line(err)}"
        ) from None
    bad = [n for n, t in module.state_dict().items() if t.is_floating_point() and not t.isfinite().all()]
    if bad:
        raise UsageError(f"{where} has non-finite weights ({bad[0]}{' and others' if len(bad) > 1 else ''}): "
                         "the run diverged; analyse an earlier checkpoint")
    step = ckpt.get("global_step")
    return module.eval(), (int(step) if isinstance(step, int) else None)


def checkpoint_state(path: Path) -> dict | None:
    """``{"step", "hparams"}`` of a checkpoint, to resume it; None when absent; ``{"corrupt": err}`` when
    unreadable."""
    if not path.is_file():
        return None
    import torch

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        return {"step": int(ckpt["global_step"]), "hparams": dict(ckpt.get("hyper_parameters", {}))}
    except Exception as err:  # noqa: BLE001 - any unreadable file is treated the same way
        return {"corrupt": f"{type(err).__name__}: {err}"}
