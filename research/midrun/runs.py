"""Mid-run blow-up testbed (issue 44): one run = one JSON record.

See README.md (the pre-registration) for the design.  Usage::

    python -m research.midrun.runs --only tiny-d4,gpt2-d4 --seeds 0,1,2 [--kinds healthy,lr10]

Each (model, depth, seed) trains its healthy prefix once (steps 0..P-1) and every kind continues
from a copy of that state (model + AdamW state), so all kinds of a seed see the same batches and
the same weights up to P (``adam_quiet`` branches at P - QUIET).  A record that exists is skipped.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lnmonitor.core.meter.meter import LadderMeter
from lnmonitor.tiny.corpus import default_corpus
from lnmonitor.tiny.data import CharVocab, RandomWindows, split_tokens

ROOT = Path(__file__).resolve().parent
RECORDS = ROOT / "records"

P, T, WARMUP, QUIET = 300, 450, 50, 150
WIDTH, HEADS, CONTEXT, BATCH = 64, 4, 64, 16
CLIP, WD, BETAS = 1.0, 0.1, (0.9, 0.999)
BASE_LR = {"tiny": 1e-3, "gpt2": 1e-3, "llama": 1e-3}
TALL_TARGET = 100.0  # the tall checkpoint's ladder growth
KINDS = ("healthy", "lr3", "lr10", "lr30", "lr100", "lr_ramp", "burst_repeat", "burst_random",
         "adam_quiet", "adam_vreset", "tall_hot", "tall_sane")
CONFIGS = ("tiny-d4", "gpt2-d4", "llama-d4", "tiny-d8", "gpt2-d8", "llama-d8")


def r4(x: float) -> float | None:
    """Four significant digits; None for a non-finite value (JSON has no nan)."""
    x = float(x)
    return float(f"{x:.4g}") if math.isfinite(x) else None


def r3(x: float) -> float | None:
    """Three significant digits (the per-rung rms lists, the bulk of a record)."""
    x = float(x)
    return float(f"{x:.3g}") if math.isfinite(x) else None


# -- data ------------------------------------------------------------------------------

_DATA: dict = {}


def data():
    if not _DATA:
        text = default_corpus()
        vocab = CharVocab.from_text(text)
        train, _ = split_tokens(vocab.encode(text), 0.1)
        _DATA.update(vocab=vocab, train=train)
    return _DATA["vocab"], _DATA["train"]


def batch(kind: str, seed: int, step: int, stream: RandomWindows, vocab_size: int):
    """The batch of ``step``: the seed's random windows, or a burst's replacement."""
    if kind.startswith("burst") and P <= step < P + 50:
        g = torch.Generator().manual_seed(seed * 100_003 + step)
        if kind == "burst_repeat":
            token = int(torch.randint(0, vocab_size, (1,), generator=g))
            x = torch.full((BATCH, CONTEXT + 1), token, dtype=torch.long)
        else:
            x = torch.randint(0, vocab_size, (BATCH, CONTEXT + 1), generator=g)
        return x[:, :-1], x[:, 1:]
    return stream.batch(step)


# -- models ----------------------------------------------------------------------------

def build(arch: str, depth: int, vocab_size: int, seed: int):
    torch.manual_seed(seed)
    if arch == "tiny":
        from lnmonitor.tiny.model import GPTConfig, TinyGPT
        return TinyGPT(GPTConfig(vocab_size=vocab_size, width=WIDTH, depth=depth, heads=HEADS,
                                 context=CONTEXT))
    if arch == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(vocab_size=vocab_size, n_positions=CONTEXT, n_embd=WIDTH, n_layer=depth,
                         n_head=HEADS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2LMHeadModel(cfg)
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=WIDTH, intermediate_size=4 * WIDTH * 2 // 3,
                          num_hidden_layers=depth, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                          max_position_embeddings=CONTEXT, tie_word_embeddings=False)
        return LlamaForCausalLM(cfg)
    raise ValueError(arch)


def forward_loss(arch: str, model, x, y):
    if arch == "tiny":
        return model(x, y)[1]
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def out_projections(arch: str, model):
    """The projections that write into the residual stream, per block."""
    if arch == "tiny":
        return [(b.attn.proj.weight, b.mlp.proj.weight) for b in model.blocks]
    if arch == "gpt2":
        return [(b.attn.c_proj.weight, b.mlp.c_proj.weight) for b in model.transformer.h]
    return [(b.self_attn.o_proj.weight, b.mlp.down_proj.weight) for b in model.model.layers]


def make_optimizer(model, lr: float):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=BETAS)


def lr_at(kind: str, step: int, base: float) -> float:
    if kind == "tall_hot":
        return 30 * base
    if kind == "tall_sane":
        return base
    lr = base * min(1.0, (step + 1) / WARMUP)
    if step < P:
        return lr
    mult = {"lr3": 3, "lr10": 10, "lr30": 30, "lr100": 100}.get(kind, 1)
    if kind == "lr_ramp":
        mult = 100 ** (min(step - P, 99) / 99)
    return lr * mult


# -- one training segment --------------------------------------------------------------

class Trainer:
    """A model, its optimiser and its meter, trained step by step; ``rows`` collects the record."""

    def __init__(self, arch: str, depth: int, seed: int):
        self.arch, self.depth, self.seed = arch, depth, seed
        vocab, train = data()
        self.vocab_size = len(vocab)
        self.stream = RandomWindows(train, CONTEXT, BATCH, seed, total=T)
        self.model = build(arch, depth, self.vocab_size, seed)
        self.base_lr = BASE_LR[arch]
        self.opt = make_optimizer(self.model, self.base_lr)
        self.meter = LadderMeter(self.model, info=lambda _: None, warn=lambda *a: None, watch_growth=False)
        self.gains = [(i.name, i.module.weight) for i in self.meter.norms
                      if isinstance(getattr(i.module, "weight", None), torch.nn.Parameter)]
        self.prev: dict[str, tuple[float, float]] = {}  # norm -> (share median, 1/sigma) last step
        self.rungs: list[str] | None = None
        self.final: str | None = None

    # state copies: the shared prefix's branch points
    def snapshot(self) -> dict:
        return {"model": copy.deepcopy(self.model.state_dict()), "opt": copy.deepcopy(self.opt.state_dict()),
                "prev": dict(self.prev)}

    def restore(self, snap: dict, fresh_optimizer: bool = False) -> None:
        self.model.load_state_dict(snap["model"])
        self.opt = make_optimizer(self.model, self.base_lr)
        if not fresh_optimizer:
            self.opt.load_state_dict(copy.deepcopy(snap["opt"]))
        self.prev = dict(snap["prev"])

    def step(self, kind: str, step: int) -> dict:
        model, opt = self.model, self.opt
        lr = lr_at(kind, step, self.base_lr)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = batch(kind, self.seed, step, self.stream, self.vocab_size)
        opt.zero_grad(set_to_none=True)
        with self.meter.step():
            loss = forward_loss(self.arch, model, x, y)
            loss.backward()
        res = self.meter.result()
        if kind == "adam_quiet" and P - QUIET <= step < P:
            for p in model.parameters():
                if p.ndim >= 2 and p.grad is not None:
                    p.grad.zero_()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        before = [w.detach().clone() for _, w in self.gains]
        opt.step()
        gain_upd = max((float((w.detach() - b).norm() / b.norm().clamp_min(1e-12))
                        for (_, w), b in zip(self.gains, before, strict=True)), default=math.nan)
        row = {"loss": r4(loss.item()), "gnorm": r4(gnorm), "lr": r4(lr), "gain_upd": r4(gain_upd)}
        row.update(self.figures(res))
        return row

    def figures(self, res) -> dict:
        nan = math.nan
        if res is None:
            return {"growth": None, "rms": None, "inv_sigma_final": None, "eps_var_final": None,
                    "share_final": None, "share_jump": None, "invsigma_jump": None}
        fig = res.figures
        if self.rungs is None:
            self.rungs, self.final = list(fig.rungs), fig.final
        by = fig.by_name()
        share_jump = invs_jump = 0.0
        for f in fig.norms:
            share, invs = f.stats.share_median, f.inv_sigma
            if f.name in self.prev:
                ps, pi = self.prev[f.name]
                if math.isfinite(share) and math.isfinite(ps) and ps > 0:
                    share_jump = max(share_jump, abs(share / ps - 1))
                if math.isfinite(invs) and math.isfinite(pi) and pi > 0:
                    invs_jump = max(invs_jump, abs(invs / pi - 1))
            self.prev[f.name] = (share, invs)
        final = by.get(self.final) if self.final else None
        return {
            "growth": r4(fig.growth),
            "rms": [r3(by[n].rms) if n in by else None for n in self.rungs],
            "inv_sigma_final": r4(final.inv_sigma if final else nan),
            "eps_var_final": r4(final.eps_over_var if final else nan),
            "share_final": r4(final.stats.share_median if final else nan),
            "share_jump": r4(share_jump),
            "invsigma_jump": r4(invs_jump),
        }

    # the tall checkpoint
    def stream_growth(self) -> float:
        """Ladder growth (median row rms of the final norm's input over the first rung's) on
        the batch of step P, measured by lnmonitor's meter without an optimiser step."""
        x, y = self.stream.batch(P)
        self.model.zero_grad(set_to_none=True)
        with self.meter.step():
            forward_loss(self.arch, self.model, x, y).backward()
        res = self.meter.result()
        self.model.zero_grad(set_to_none=True)
        return float(res.figures.growth)

    def make_tall(self) -> tuple[float, float, float]:
        """Scale the second half of the blocks' output projections until the growth is ~100x."""
        projections = out_projections(self.arch, self.model)[self.depth // 2:]
        originals = [(a.detach().clone(), b.detach().clone()) for a, b in projections]
        start = self.stream_growth()
        scale, growth = 1.0, start
        for _ in range(12):
            if abs(math.log(growth / TALL_TARGET)) < math.log(1.1):
                break
            scale *= (TALL_TARGET / growth) ** 0.9
            with torch.no_grad():
                for (a, b), (a0, b0) in zip(projections, originals, strict=True):
                    a.copy_(a0 * scale)
                    b.copy_(b0 * scale)
            growth = self.stream_growth()
        return start, scale, growth


# -- runs ------------------------------------------------------------------------------

def record_path(config: str, kind: str, seed: int) -> Path:
    return RECORDS / config / kind / f"seed={seed}.json"


def write(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, separators=(",", ":")))
    os.replace(tmp, path)


def run_config(config: str, seed: int, kinds=KINDS, steps: tuple[int, int] = (P, T), out=None) -> list[Path]:
    """Train every missing kind of ``config`` (``arch-d<depth>``) at ``seed``; returns the paths written."""
    global P, T
    saved = (P, T)
    P, T = steps
    try:
        return _run_config(config, seed, kinds, out or RECORDS)
    finally:
        P, T = saved


def _run_config(config: str, seed: int, kinds, out: Path) -> list[Path]:
    arch, depth = config.split("-d")[0], int(config.split("-d")[1])
    todo = [k for k in kinds if not (out / config / k / f"seed={seed}.json").exists()]
    if not todo:
        return []
    t0 = time.process_time()
    tr = Trainer(arch, depth, seed)
    prefix, branch = [], None
    for step in range(P):
        if step == P - QUIET:
            branch = tr.snapshot()
        prefix.append(tr.step("healthy", step))
    at_p = tr.snapshot()
    prefix_cpu = time.process_time() - t0
    meta = {"model": arch, "depth": depth, "width": WIDTH, "heads": HEADS, "context": CONTEXT,
            "batch": BATCH, "seed": seed, "P": P, "T": T, "warmup": WARMUP, "base_lr": tr.base_lr,
            "clip": CLIP, "betas": BETAS, "weight_decay": WD, "vocab": tr.vocab_size, "rungs": tr.rungs,
            "final": tr.final, "params": sum(p.numel() for p in tr.model.parameters())}
    written = []
    for kind in todo:
        t1 = time.process_time()
        rows = list(prefix)
        extra: dict = {}
        fit_start = 0
        if kind == "adam_quiet":
            tr.restore(branch)
            rows = prefix[:P - QUIET]
            first = P - QUIET
        elif kind.startswith("tall"):
            tr.restore(at_p, fresh_optimizer=True)
            start, scale, growth = tr.make_tall()
            extra = {"tall_growth_before": r4(start), "tall_scale": r4(scale),
                     "tall_growth_after": r4(growth)}
            fit_start, first = P, P
        else:
            tr.restore(at_p)
            first = P
            if kind == "adam_vreset":
                for group in tr.opt.param_groups:
                    for p in group["params"]:
                        if p.ndim >= 2 and p in tr.opt.state:
                            tr.opt.state[p]["exp_avg_sq"].mul_(1e-4)
        for step in range(first, T):
            rows.append(tr.step(kind, step))
            if rows[-1]["loss"] is None:  # non-finite: the run is over
                break
        cpu = time.process_time() - t1 + (prefix_cpu if kind == todo[0] else 0.0)
        record = dict(meta, kind=kind, fit_start=fit_start, cpu_s=round(cpu, 1), **extra,
                      series={key: [r[key] for r in rows] for key in rows[0]})
        path = out / config / kind / f"seed={seed}.json"
        write(path, record)
        written.append(path)
        print(f"{config} seed={seed} {kind:13s} cpu {cpu:5.1f}s final loss {rows[-1]['loss']} "
              f"max growth {max((g for g in record['series']['growth'] if g), default=None)}", flush=True)
    return written


def compact(root: Path = RECORDS) -> None:
    """Round every record's per-rung rms to three significant digits (records written before
    that rounding was the default kept four), rewriting in place, atomically."""
    for path in sorted(root.glob("*/*/seed=*.json")):
        record = json.loads(path.read_text())
        rms = record["series"]["rms"]
        record["series"]["rms"] = [None if row is None else [None if v is None else r3(v) for v in row]
                                   for row in rms]
        write(path, record)


def main(argv=None) -> None:
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(CONFIGS), help="configs, e.g. tiny-d4,llama-d8")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--compact", action="store_true", help="only round the stored rms lists to 3 digits")
    args = ap.parse_args(argv)
    if args.compact:
        compact()
        return
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        sys.exit(f"unknown kinds {sorted(unknown)}; choose from {KINDS}")
    t0 = time.time()
    for config in args.only.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            run_config(config, seed, kinds)
    print(f"done in {time.time() - t0:.0f}s wall", flush=True)


if __name__ == "__main__":
    main()
