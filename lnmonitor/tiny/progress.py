"""Progress of a train-tiny or eps-compare fit where the output is not a terminal (a log file, a pipe, a
SLURM job): a plain line every :data:`EVERY_N_STEPS` optimizer steps."""

from __future__ import annotations

import time

from lightning.pytorch.callbacks import Callback

from lnmonitor.core.output.metric_names import TRAIN_LOSS, VAL_LOSS

__all__ = ["EVERY_N_STEPS", "ProgressLines"]

EVERY_N_STEPS = 100


class ProgressLines(Callback):
    """One line every ``every_n_steps`` optimizer steps and at the last: the step, the last training and
    validation losses, the time taken and the time left at the pace so far."""

    def __init__(self, every_n_steps: int = EVERY_N_STEPS) -> None:
        self.every_n_steps = every_n_steps
        self._start, self._first, self._printed, self._validated = 0.0, 0, 0, 0

    def on_train_start(self, trainer, pl_module) -> None:
        self._start, self._first = time.perf_counter(), trainer.global_step
        self._printed = self._first

    def on_validation_end(self, trainer, pl_module) -> None:
        self._validated = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step, total = trainer.global_step, trainer.max_steps  # the recipe always bounds the steps
        if step == self._printed or (step % self.every_n_steps and step != total):
            return  # not due, or a micro-batch of a step already said
        self._printed = step
        metrics = trainer.callback_metrics
        said = [f"{TRAIN_LOSS} {float(metrics[TRAIN_LOSS]):.4f}"] if TRAIN_LOSS in metrics else []
        if VAL_LOSS in metrics:
            said.append(f"{VAL_LOSS} {float(metrics[VAL_LOSS]):.4f} (at step {self._validated})")
        taken = time.perf_counter() - self._start
        left = taken / (step - self._first) * (total - step)
        timing = f"{_duration(taken)} taken, about {_duration(left)} left"
        print(f"step {step}/{total}: {', '.join(said)}; {timing}", flush=True)


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds:02d} s" if minutes else f"{seconds} s"
