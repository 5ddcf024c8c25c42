"""One meter, three integrations: Lightning, transformers.Trainer and a plain loop log the same numbers.

One tiny transformers GPT-2 (random weights, no dropout), the same starting weights, the
same batch at every step (the whole 8-sequence data set: a step's medians do not depend
on the order of its rows), plain SGD without clipping, the same loss (the Trainer's
per-token normalisation made equal to the model's, see ``labels``): the three integrations must
log the same metric names and values within one histogram bin at every measured step.  (That
the meter and the loop monitor import and run without Lightning, and that the loop monitor refuses
nonsense, is tested where it runs without transformers: test_layout.py, test_loop.py.)
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

import lightning as L  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from torch.utils.tensorboard import SummaryWriter  # noqa: E402

from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor  # noqa: E402
from lnmonitor.core.meter.row_stats import SHARE_RESOLUTION, SIGMA_RESOLUTION, VAR_RESOLUTION  # noqa: E402
from lnmonitor.integrations.loop import LoopMonitor  # noqa: E402
from lnmonitor.integrations.transformers import LNMonitorCallback  # noqa: E402

STEPS, EVERY, LR, ROWS, CONTEXT, PROBE = 4, 2, 0.05, 8, 16, 4
MEASURED = [0, 2, 3]  # every second step and the last
INVARIANCE_TAGS = {"lnmonitor/invariance/shift_5/dloss", "lnmonitor/invariance/scale_rounding_points"}


def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=64, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def tokens() -> torch.Tensor:
    return torch.randint(0, 64, (ROWS, CONTEXT), generator=torch.Generator().manual_seed(1))


def labels(x: torch.Tensor) -> torch.Tensor:
    """The tokens as labels, the first of each row ignored: the Trainer divides the summed loss
    by the labels that are not -100 before the model's shift, so with the first ignored its
    loss is the mean over the 15 predicted tokens, as the model's own (see test docstring)."""
    y = x.clone()
    y[:, 0] = -100
    return y


class Wrapped(L.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.model(input_ids=x, labels=labels(x)).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def lightning_callbacks(state, tmp_path, accumulate: int) -> tuple[dict[int, dict], dict[int, dict]]:
    """``(ladder, invariance)`` by step, the LightningModule's ``model.`` taken out of the names."""
    model = gpt2()
    model.load_state_dict(state)
    monitor = LayerNormMonitor(every_n_steps=EVERY, summary=False, keep_history=True)
    invariance = FinalNormInvarianceMonitor(invariance_every_n_steps=EVERY, probe_batch=(tokens()[:PROBE],),
                                            loss_fn=_logits_and_loss, summary=False, keep_history=True)
    trainer = L.Trainer(max_steps=STEPS, logger=TensorBoardLogger(str(tmp_path / "lightning")),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[monitor, invariance], accelerator="cpu",
                        accumulate_grad_batches=accumulate)
    trainer.fit(Wrapped(model), DataLoader(TensorDataset(tokens()), batch_size=ROWS // accumulate))
    assert all(s.rows == ROWS * CONTEXT for s in monitor.last_row_stats)  # every micro-batch
    return tuple(_by_step({k.replace("/model.", "/", 1): v for k, v in h.items()} for h in m.history)
                 for m in (monitor, invariance))


def _logits_and_loss(module, batch):
    """The loss the other integrations probe (``model(**batch)``: the loss and logits) in Lightning, whose
    default (``training_step``) gives the loss alone."""
    out = module.model(input_ids=batch[0], labels=labels(batch[0]))
    return out.logits, out.loss


def _by_step(history) -> dict[int, dict]:
    """Logged dicts merged by step (a point's scale sweep, added at the end, comes apart)."""
    steps: dict[int, dict] = {}
    for h in history:
        steps.setdefault(h["step"], {}).update(h)
    return steps


def transformers_callback(state, tmp_path, accumulate: int) -> tuple[dict[int, dict], LNMonitorCallback]:
    model = gpt2()
    model.load_state_dict(state)
    data = [{"input_ids": x, "labels": y} for x, y in zip(tokens(), labels(tokens()), strict=True)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=ROWS // accumulate,
        gradient_accumulation_steps=accumulate, max_steps=STEPS, learning_rate=LR,
        optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, use_cpu=True,
        save_strategy="no", report_to=["tensorboard"], logging_steps=EVERY,
        disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    # the Trainer handed to it, as before (tests/test_transformers_callback.py: callbacks=[...]); every step
    # measured, as the Trainer callback measures the updates that end on its logging steps
    callback = LNMonitorCallback(trainer, every_n_steps=1, keep_history=True, invariance_every_n_steps=STEPS,
                                 probe_size=PROBE)
    trainer.add_callback(callback)
    trainer.train()
    assert all(s.rows == ROWS * CONTEXT for s in callback.last_result.row_stats)  # every micro-batch
    # the Trainer's steps count updates done: the step s measured before its update is reported at s + 1
    ladder = {h["step"] - 1: h for h in callback.history
              if "lnmonitor/ladder/attenuation" in h and h["step"] - 1 in MEASURED}
    return ladder, callback


def loop_monitor(state, tmp_path, accumulate: int) -> tuple[dict[int, dict], dict[int, dict]]:
    """``(ladder, invariance)`` by step; the probe's loss is the model's own (``model(**batch).loss``)."""
    model = gpt2()
    model.load_state_dict(state)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x = tokens()
    probe = {"input_ids": x[:PROBE], "labels": labels(x[:PROBE])}
    with SummaryWriter(str(tmp_path / "loop")) as writer:
        monitor = LoopMonitor(model, writer, every_n_steps=EVERY, max_steps=STEPS, keep_history=True,
                              probe_batch=probe, invariance_every_n_steps=EVERY, summary=False)
        for step in range(STEPS):
            with monitor.step(step):
                for part in x.chunk(accumulate):
                    (model(input_ids=part, labels=labels(part)).loss / accumulate).backward()
            optimizer.step()
            optimizer.zero_grad()
    return (_by_step(h for h in monitor.history if "lnmonitor/ladder/attenuation" in h),
            _by_step(h for h in monitor.history if h.keys() & INVARIANCE_TAGS))


def _tolerance(tag: str) -> dict:
    """One histogram bin of the statistic a tag reads (the histograms' resolutions)."""
    statistic = tag.split("/")[1]
    if statistic.startswith("share") and "baseline" not in tag:
        return {"abs": SHARE_RESOLUTION}
    if statistic.startswith("log10"):
        return {"abs": math.log10(1 + VAR_RESOLUTION)}
    if statistic in ("eps_over_var", "transmission"):
        return {"rel": VAR_RESOLUTION}
    if statistic == "ladder":  # a ratio of two statistics, one bin each
        return {"rel": 2 * SIGMA_RESOLUTION}
    return {"rel": SIGMA_RESOLUTION, "abs": 0.0}


def _events(folder, kind: str = "scalars") -> set[str]:
    return set(_read_back(folder, kind))


def _read_back(folder, kind: str = "scalars") -> dict[str, list]:
    """``{tag: [event, ...]}`` of every event file under ``folder`` (``kind``: scalars or images)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, list] = {}
    for run in [p for p in folder.rglob("events.out.tfevents.*")]:
        acc = EventAccumulator(str(run.parent), size_guidance={"images": 0})
        acc.Reload()
        for tag in acc.Tags()[kind]:
            found.setdefault(tag, []).extend(acc.Scalars(tag) if kind == "scalars" else acc.Images(tag))
    return found


def _pictures(folder) -> dict[str, list[tuple[int, int, int]]]:
    """The pictures written under ``folder``: ``{tag: [(step, width, height), ...]}``."""
    return {tag: sorted((e.step, e.width, e.height) for e in events)
            for tag, events in _read_back(folder, "images").items()}


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_three_integrations_log_the_same_numbers(tmp_path, accumulate, capsys):
    """With ``accumulate`` micro-batches per optimizer step, each monitor measures all of them as
    one step.  With accumulation the Trainer's own update differs from the mean-loss step the
    others take (transformers 5.3 divides the accumulated gradient by the number of
    micro-batches once more: doubling its learning rate made its weights follow the others
    here), so there the Trainer's numbers are compared where the weights are the same: step 0."""
    state = {k: v.clone() for k, v in gpt2().state_dict().items()}
    lit, lit_inv = lightning_callbacks(state, tmp_path, accumulate)
    hf, callback = transformers_callback(state, tmp_path, accumulate)
    loop, loop_inv = loop_monitor(state, tmp_path, accumulate)
    assert sorted(lit) == sorted(hf) == sorted(loop) == MEASURED
    for step in MEASURED:
        a, b, c = (dict(d[step]) for d in (lit, hf, loop))
        for d in (a, b, c):
            d.pop("step")
        assert set(a) == set(b) == set(c), (set(a) ^ set(b)) | (set(a) ^ set(c))
        assert "lnmonitor/ladder/attenuation" in a and "lnmonitor/sigma/transformer.ln_f" in a
        for tag, value in a.items():
            tol = _tolerance(tag)
            if accumulate == 1 or step == 0:
                assert b[tag] == pytest.approx(value, **tol), (step, tag)
            assert c[tag] == pytest.approx(value, **tol), (step, tag)
    # the Trainer callback's invariance probe ran at the end, with the model's labels loss
    inv = list(_by_step(h for h in callback.history if h.keys() & INVARIANCE_TAGS).values())
    assert callback.invariance_off_reason is None and [h["step"] for h in inv] == [STEPS]
    shift, axis = inv[0]["lnmonitor/invariance/shift_5/dloss"], inv[0]["lnmonitor/invariance/axis_5/dloss"]
    assert abs(shift) < 1e-5 < abs(axis)
    # and the numbers reached TensorBoard through each monitor's writer, read back
    assert "train/lnmonitor/ladder/attenuation" in _events(tmp_path / "hf")
    assert {"lnmonitor/ladder/attenuation", "lnmonitor/sigma/transformer.ln_f"} <= _events(tmp_path / "loop")
    # the invariance probe: the same points, tags and numbers through the Lightning and loop monitors (the
    # loop monitor's end is its last step, before the update that Lightning's end point follows); the
    # same tags through the Trainer's (its probe rows are the first of its shuffled training loader)
    assert sorted(lit_inv) == [0, 2, 4] and sorted(loop_inv) == [0, 2, 3]
    end = {tag for tag in inv[0] if tag != "step"}
    assert "lnmonitor/invariance/scale_rounding_points" in end  # the end point has the scale sweep
    assert set(lit_inv[4]) == set(loop_inv[3]) == set(inv[0])
    for step in (0, 2):
        assert set(lit_inv[step]) == set(loop_inv[step]) and set(loop_inv[step]) < set(inv[0])  # no sweep
        for tag, value in lit_inv[step].items():
            assert loop_inv[step][tag] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, tag)
    assert {f"train/{tag}" for tag in end} <= _events(tmp_path / "hf")
    assert end <= _events(tmp_path / "loop") and end <= _events(tmp_path / "lightning")
    # the pictures: the ladder at the first and last measured steps and the ladder over training
    pictures = _pictures(tmp_path / "lightning")
    assert set(pictures) == {"lnmonitor/ladder", "lnmonitor/ladder_over_training"}
    assert [p[0] for p in pictures["lnmonitor/ladder"]] == [0, 3]
    assert [p[0] for p in pictures["lnmonitor/ladder_over_training"]] == [3]
    assert _pictures(tmp_path / "loop") == pictures
    # the Trainer's too, to its TensorBoard writer: its steps count the updates done (one more)
    hf_pictures = {tag.removeprefix("train/"): [(step - 1, *size) for step, *size in points]
                   for tag, points in _pictures(tmp_path / "hf").items()}
    assert hf_pictures == pictures
    said = capsys.readouterr().err  # and it prints the end-of-training summary, as the others do
    assert said.count("lnmonitor summary: GPT2LMHeadModel, end of training") == 1


def _trainer_script(out, processes: int) -> dict:
    """tests/hf_ddp_script.py in one process, or in ``processes`` under torchrun (gloo)."""
    from conftest import run_script

    return run_script("hf_ddp_script.py", out, processes)


@pytest.mark.slow
def test_the_trainer_callback_under_torchrun_merges_both_processes_like_one(tmp_path):
    """Two processes (the Trainer's own accelerate set-up, gloo), four sequences each: every
    measured step merges the 8 x 16 rows, and the numbers are one process's on all 8; the
    points land on the fit's first step and the Trainer's logging steps (``logging_steps=2``)."""
    two = _trainer_script(tmp_path / "two.json", 2)
    one = _trainer_script(tmp_path / "one.json", 1)
    assert two["world"] == 2 and one["world"] == 1
    assert two["rows"] == one["rows"] == [ROWS * CONTEXT] * 5
    assert [h["step"] for h in two["history"]] == [h["step"] for h in one["history"]] == [1, 2, 4]
    for a, b in zip(two["history"], one["history"], strict=True):
        assert a.keys() == b.keys()
        for tag, value in a.items():
            if tag != "step":
                assert b[tag] == pytest.approx(value, **_tolerance(tag)), tag
