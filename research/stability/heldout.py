"""The held-out part of the findings' testbed: models the thresholds were not fitted on.

docs/findings.md ("Held out") states the part before it was trained: a pre-LN transformer built
from ``torch.nn`` parts with a tall ladder at initialisation, ``transformers``' GPT-2 and Llama
from small configs with their own init, and fine-tunes of a tall-ladder GPT-2 checkpoint, each at
a reference learning rate and at healthy and harmful ones, on the standard library's source
(the fitted part trained on the Python help text), 3 seeds.  One run trains its model in a plain
loop for :data:`STEPS` steps and records every step's training loss (bytes as tokens,
cross-entropy in nats per byte, every position a target), gradient norm before clipping and the
ladder's growth (the meter's every-step growth watch; the meter's own figure at step 0), and the
meter's signals every :data:`MEASURE_EVERY` steps.  What the records mean is
:mod:`research.stability.heldout_table`'s.

Records go to ``<out>/<family>/<lr>/seed=<seed>.json`` (written atomically, never rerun unless
``force``).  Imports transformers when a run needs it.
"""

from __future__ import annotations

import argparse
import math
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lnmonitor.core.meter.meter import LadderMeter
from lnmonitor.core.output.files import atomic_write_json, read_json
from research.stability import RECORDS
from research.stability.candidate_signals import candidate_signals

__all__ = ["DEFAULT_OUT", "FAMILIES", "MEASURE_EVERY", "RUNS", "STEPS", "HeldOutRun", "run", "run_all"]

DEFAULT_OUT = RECORDS / "heldout"
STEPS, BATCH, CONTEXT, WIDTH, DEPTH, HEADS = 150, 16, 64, 64, 4, 4
MEASURE_EVERY = 10
SEEDS = (0, 1, 2)
VOCAB = 256  # bytes: one vocabulary for both corpora
TRAIN_CHARS = 400_000
TALL = 10.0  # the fine-tunes' checkpoint: its residual projections scaled by this


@dataclass(frozen=True)
class HeldOutRun:
    """One run: a ``family`` (the model and where it starts), a learning rate, its linear
    ``warmup`` steps (0: none), a seed; ``reference``: the run of its family and seed that the
    user-visible event is judged against."""

    family: str
    lr: float
    warmup: int
    seed: int

    @property
    def name(self) -> str:
        return f"lr{self.lr:g}" + (f"-warmup{self.warmup}" if self.warmup else "")

    @property
    def fine_tune(self) -> bool:
        return self.family == "finetune-gpt2"

    @property
    def reference(self) -> bool:
        return self.lr == REFERENCE_LR[self.family] and not self.warmup


FAMILIES = ("torch-nn", "hf-gpt2", "hf-llama", "finetune-gpt2")
# the confirmation part's (docs/findings.md, "An amendment ... and its confirmation"): unseen families
DEEP_FAMILIES = ("hf-gpt2-deep", "tiny-deep")
REFERENCE_LR = {"torch-nn": 1e-3, "hf-gpt2": 1e-3, "hf-llama": 1e-3, "finetune-gpt2": 1e-4,
                "hf-gpt2-deep": 1e-3, "tiny-deep": 1e-3}
SCRATCH_LRS = ((1e-3, 0), (3e-3, 0), (1e-2, 0), (3e-2, 50), (3e-2, 0), (1e-1, 0))
FINE_TUNE_LRS = ((1e-4, 0), (1e-3, 0), (3e-2, 0), (1e-1, 0))


def _runs(families: tuple[str, ...], seeds: tuple[int, ...]) -> tuple[HeldOutRun, ...]:
    return tuple(HeldOutRun(family, lr, warmup, seed)
                 for family in families
                 for lr, warmup in (FINE_TUNE_LRS if family == "finetune-gpt2" else SCRATCH_LRS)
                 for seed in seeds)


RUNS = _runs(FAMILIES, SEEDS)
CONFIRM_SEEDS = (3, 4, 5)
CONFIRM_RUNS = _runs(FAMILIES + DEEP_FAMILIES, CONFIRM_SEEDS)
CONFIRM_OUT = RECORDS / "confirm"


# -- the models ----------------------------------------------------------------------------


class TorchPreLN(nn.Module):
    """A pre-LN character transformer from ``torch.nn`` parts, PyTorch's default init but for
    the embeddings, N(0, 0.02) (as GPT-2's: the ladder is tall at initialisation)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.empty(CONTEXT, WIDTH))
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.position, std=0.02)
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, DEPTH, norm=nn.LayerNorm(WIDTH),
                                            enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)
        mask = nn.Transformer.generate_square_subsequent_mask(CONTEXT)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.blocks(self.embed(x) + self.position[:n], mask=self.mask[:n, :n], is_causal=True)
        return self.head(h)


class Logits(nn.Module):
    """A ``transformers`` causal LM as a function of the tokens to their logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x).logits


class TinyLogits(nn.Module):
    """This project's TinyGPT as a function of the tokens to their logits."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        from lnmonitor.tiny.model import GPTConfig, TinyGPT

        config = GPTConfig(vocab_size=VOCAB, width=WIDTH, depth=depth, heads=HEADS, context=CONTEXT)
        self.model = TinyGPT(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)[0]


def build(family: str) -> nn.Module:
    """A freshly initialised model of ``family`` (the fine-tunes' before their checkpoint)."""
    if family == "torch-nn":
        return TorchPreLN()
    if family == "tiny-deep":
        return TinyLogits(2 * DEPTH)
    import transformers

    if family in ("hf-gpt2", "finetune-gpt2", "hf-gpt2-deep"):
        depth = 2 * DEPTH if family == "hf-gpt2-deep" else DEPTH
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=WIDTH, n_layer=depth,
                                         n_head=HEADS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return Logits(transformers.GPT2LMHeadModel(config))
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                                      num_hidden_layers=DEPTH, num_attention_heads=HEADS,
                                      num_key_value_heads=HEADS, max_position_embeddings=CONTEXT)
    return Logits(transformers.LlamaForCausalLM(config))


# -- the data ------------------------------------------------------------------------------


def corpus(name: str) -> torch.Tensor:
    """The first :data:`TRAIN_CHARS` bytes of a built-in corpus as token ids."""
    from lnmonitor.tiny.corpus import default_corpus, python_source

    text = (python_source() if name == "source" else default_corpus())[:TRAIN_CHARS]
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def batches(data: torch.Tensor, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of windows from ``data``, the same for every run of one seed."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - CONTEXT - 1, (BATCH,), generator=generator)
        window = torch.stack([data[s:s + CONTEXT + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


# -- one run -------------------------------------------------------------------------------


def _train(model: nn.Module, data: torch.Tensor, seed: int, lr: float, warmup: int,
           step_end: Callable[[int, float, float], None] | None = None,
           meter: LadderMeter | None = None) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    feed = batches(data, seed)
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup) if warmup else lr
        x, y = next(feed)
        measured = meter is not None and step % MEASURE_EVERY == 0
        if measured:
            meter.start()
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        if measured:
            meter.stop()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step_end is not None:
            step_end(step, float(loss), grad_norm)


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    """The fine-tunes' tall-ladder checkpoint of ``seed``: GPT-2 trained :data:`STEPS` steps at lr
    1e-3 on the Python help text, its residual projections (``c_proj``) then scaled by
    :data:`TALL`, as a pretrained model's stream is tall."""
    torch.manual_seed(seed)
    model = build("finetune-gpt2")
    _train(model, corpus("help"), seed + 100, 1e-3, 0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("c_proj.weight") or name.endswith("c_proj.bias"):
                parameter.mul_(TALL)
    return {k: v.clone() for k, v in model.state_dict().items()}


def run(spec: HeldOutRun, start: dict[str, torch.Tensor] | None = None) -> dict:
    """Train one held-out run and return its record (``start``: the fine-tune's checkpoint)."""
    torch.manual_seed(spec.seed)
    model = build(spec.family)
    if spec.fine_tune:
        model.load_state_dict(start if start is not None else checkpoint(spec.seed))
    meter = LadderMeter(model, info=lambda _: None, warn=lambda key, text: None)
    record = {"family": spec.family, "name": spec.name, "lr": spec.lr, "warmup": spec.warmup,
              "seed": spec.seed, "reference": spec.reference, "fine_tune": spec.fine_tune, "steps": STEPS,
              "measure_every": MEASURE_EVERY, "loss": [], "grad_norm": [], "growth": [], "measured": []}

    def step_end(step: int, loss: float, grad_norm: float) -> None:
        record["loss"].append(loss if math.isfinite(loss) else None)
        record["grad_norm"].append(grad_norm if math.isfinite(grad_norm) else None)
        taken = meter.take_growth(step)
        growth = taken[1] if taken is not None and taken[0] == step else math.nan
        if step % MEASURE_EVERY == 0:
            result = meter.result()
            signals = candidate_signals(result.figures if result is not None else None)
            if step == 0:
                growth = signals["growth"]  # the watch starts once the first step has told the roles
            record["measured"].append({"step": step, **{k: (v if math.isfinite(v) else None)
                                                        for k, v in signals.items()}})
        record["growth"].append(growth if math.isfinite(growth) else None)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(model, corpus("source"), spec.seed, spec.lr, spec.warmup, step_end, meter)
    meter.close()
    return record


def record_path(out: Path, spec: HeldOutRun) -> Path:
    return out / spec.family / spec.name / f"seed={spec.seed}.json"


def _run_group(out: Path, specs: list[HeldOutRun], force: bool) -> list[str]:
    torch.set_num_threads(1)
    start = checkpoint(specs[0].seed) if specs[0].fine_tune else None
    done = []
    for spec in specs:
        path = record_path(out, spec)
        if path.exists() and not force:
            continue
        atomic_write_json(path, run(spec, start))
        done.append(str(path))
    return done


def run_all(out: Path = DEFAULT_OUT, *, runs: tuple[HeldOutRun, ...] = RUNS, jobs: int = 1,
            force: bool = False, echo: Callable[[str], None] = print) -> list[Path]:
    """Train every run of ``runs`` that has no record under ``out`` (grouped by family and
    seed: a fine-tune's checkpoint is made once per seed), ``jobs`` groups side by side."""
    groups: dict[tuple[str, int], list[HeldOutRun]] = {}
    for spec in runs:
        groups.setdefault((spec.family, spec.seed), []).append(spec)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(_run_group, out, specs, force) for specs in groups.values()]
        for future in futures:
            for path in future.result():
                echo(f"wrote {path}")
    return [record_path(out, spec) for spec in runs]


def load(out: Path = DEFAULT_OUT, runs: tuple[HeldOutRun, ...] = RUNS) -> list[dict]:
    """Every record of ``runs`` under ``out``, in their order."""
    return [read_json(record_path(out, spec), "held-out record") for spec in runs
            if record_path(out, spec).exists()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train the findings' held-out part (docs/findings.md).")
    parser.add_argument("--part", choices=("heldout", "confirm"), default="heldout")
    parser.add_argument("--out", type=Path, default=None, help="default: research/stability/records/<part>")
    parser.add_argument("--jobs", type=int, default=1, help="family-and-seed groups side by side")
    parser.add_argument("--force", action="store_true", help="train again runs that have a record")
    args = parser.parse_args(argv)
    confirm = args.part == "confirm"
    out = args.out or (CONFIRM_OUT if confirm else DEFAULT_OUT)
    run_all(out, runs=CONFIRM_RUNS if confirm else RUNS, jobs=args.jobs, force=args.force)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
