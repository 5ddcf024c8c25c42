"""Everything the three integrations log, as float hex: the check that a change of the code's
shape changed no number.

Runs the tiny transformers GPT-2 of tests/test_three_callbacks.py (random weights, fixed seeds,
the same batch) through each integration -- Lightning
(:class:`~lnmonitor.LayerNormMonitor`, :class:`~lnmonitor.FinalNormInvarianceMonitor`),
``transformers.Trainer`` (:class:`~lnmonitor.LNMonitorCallback`) and a plain loop
(:class:`~lnmonitor.LoopMonitor`, on batches padded to different lengths) -- and writes every
logged value of every step as ``float.hex`` to one JSON file, with everything the monitors printed
(their notes and end-of-fit summaries).  Two dumps, one taken before a change and one after,
must be equal wherever no number was meant to change::

    python tools/metrics_dump.py before.json        # on the old commit
    python tools/metrics_dump.py after.json         # on the new one
    python tools/metrics_dump.py --compare before.json after.json

``--compare`` prints each tag whose values differ (bit for bit) and exits 1 if any does.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, not an installed copy

STEPS = 6  # three measured steps at every 2nd and the last


def _parity():
    """tests/test_three_callbacks.py, whose model, batch, labels and LightningModule the dump runs: one
    definition of the three integrations' common ground."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tests" / "test_three_callbacks.py"
    spec = importlib.util.spec_from_file_location("test_three_callbacks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _hex(history) -> dict[str, dict[str, str]]:
    """``{step: {tag: float hex}}`` of a monitor's kept history."""
    out: dict[str, dict[str, str]] = {}
    for logged in history:
        step = str(logged["step"])
        for tag, value in logged.items():
            if tag != "step":
                out.setdefault(step, {})[tag] = float(value).hex()
    return out


def lightning_callbacks(folder: Path) -> dict:
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor

    T = _parity()
    monitor = LayerNormMonitor(every_n_steps=T.EVERY, keep_history=True)
    invariance = FinalNormInvarianceMonitor(invariance_every_n_steps=T.EVERY,
                                            probe_batch=(T.tokens()[:T.PROBE],), loss_fn=T._logits_and_loss,
                                            keep_history=True)
    trainer = L.Trainer(max_steps=STEPS, logger=CSVLogger(str(folder)), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                        callbacks=[monitor, invariance])
    trainer.fit(T.Wrapped(T.gpt2()), DataLoader(TensorDataset(T.tokens()), batch_size=T.ROWS))
    return {"ladder": _hex(monitor.history), "invariance": _hex(invariance.history)}


def transformers_callback(folder: Path) -> dict:
    import transformers

    from lnmonitor import LNMonitorCallback

    T = _parity()
    data = [{"input_ids": x, "labels": y} for x, y in zip(T.tokens(), T.labels(T.tokens()), strict=True)]
    args = transformers.TrainingArguments(
        output_dir=str(folder), per_device_train_batch_size=T.ROWS, max_steps=STEPS, learning_rate=T.LR,
        optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, use_cpu=True,
        save_strategy="no", report_to=[], logging_steps=T.EVERY, disable_tqdm=True, dataloader_num_workers=0,
        seed=0, data_seed=0)
    trainer = transformers.Trainer(model=T.gpt2(), args=args, train_dataset=data)
    callback = LNMonitorCallback(trainer, every_n_steps=T.EVERY, keep_history=True, probe_size=T.PROBE)
    trainer.add_callback(callback)
    trainer.train()
    return {"all": _hex(callback.history)}


def loop_monitor(_folder: Path) -> dict:
    import torch

    from lnmonitor import LoopMonitor

    T = _parity()
    model = T.gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=T.LR)
    x = T.tokens()
    mask = torch.ones_like(x)
    mask[1::2, T.CONTEXT // 2:] = 0  # every second row padded after half its length
    labels = T.labels(x).masked_fill(mask == 0, -100)
    probe = {"input_ids": x[:T.PROBE], "attention_mask": mask[:T.PROBE], "labels": labels[:T.PROBE]}
    monitor = LoopMonitor(model, every_n_steps=T.EVERY, max_steps=STEPS, keep_history=True,
                          probe_batch=probe, invariance_every_n_steps=T.EVERY)
    for step in range(STEPS):
        with monitor.step(step):
            model(input_ids=x, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    return {"all": _hex(monitor.history)}


def dump() -> dict:
    """Every monitor's logged values and printed summary."""
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, run in (("lightning", lightning_callbacks), ("transformers", transformers_callback),
                          ("loop", loop_monitor)):
            said = io.StringIO()
            handler = logging.StreamHandler(said)
            logging.getLogger("lnmonitor").addHandler(handler)
            with warnings.catch_warnings(), contextlib.redirect_stderr(said):
                warnings.simplefilter("ignore")
                values = run(Path(tmp) / name)
            logging.getLogger("lnmonitor").removeHandler(handler)
            out[name] = {"values": values, "said": said.getvalue().splitlines()}
    return out


def compare(before: dict, after: dict) -> list[str]:
    """What differs between two dumps: one line per tag and step, and per changed line said."""
    differences = []

    def walk(a, b, where):
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                if key not in a or key not in b:
                    differences.append(f"{where}/{key}: only {'after' if key in b else 'before'}")
                else:
                    walk(a[key], b[key], f"{where}/{key}")
        elif isinstance(a, list) and isinstance(b, list):  # lines printed: line by line
            for i in range(max(len(a), len(b))):
                line_a, line_b = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
                if line_a != line_b:
                    differences.append(f"{where}[{i}]: {line_a!r} -> {line_b!r}")
        elif a != b:
            differences.append(f"{where}: {a!r} -> {b!r}")

    walk(before, after, "")
    return differences


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", help="write the dump here")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two dumps")
    args = parser.parse_args(argv)
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        differences = compare(before, after)
        print("\n".join(differences) if differences else "identical, bit for bit")
        return 1 if differences else 0
    if not args.out:
        parser.error("give a file to write the dump to, or --compare BEFORE AFTER")
    result = dump()
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True))
    counts = {integration: sum(len(s) for part in d["values"].values() for s in part.values())
              for integration, d in result.items()}
    print(f"wrote {args.out}: values logged by integration {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
