"""The eps comparison's grid (eps x seeds over one recipe, checked) and what must match for runs to be
compared (the recipe, the precision and the data)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from lnmonitor.errors import UsageError
from lnmonitor.experiments.eps.store import eps_label, grid_pairs
from lnmonitor.tiny.recipe import Recipe

__all__ = ["DEFAULT_EPS", "DEFAULT_SEEDS", "Experiment", "data_fingerprint", "experiment_config", "parse_eps",
           "parse_seeds"]

DEFAULT_EPS = (1e-5, 1e-1)
DEFAULT_SEEDS = (0, 1, 2)


def parse_eps(values: Sequence) -> tuple[float, ...]:
    """Distinct finite eps > 0, in the order given; UsageError otherwise."""
    if not values:
        raise UsageError("--eps needs at least one value, e.g. --eps 1e-5 1e-1")
    out: list[float] = []
    for raw in values:
        try:
            eps = float(raw)
        except (TypeError, ValueError):
            raise UsageError(f"eps {raw!r} is not a number: pass values like 1e-5 0.1") from None
        if not (math.isfinite(eps) and eps > 0):
            raise UsageError(f"eps must be a finite number > 0, got {raw!r}")
        if eps in out:
            raise UsageError(f"eps {raw!r} is given twice (as {eps_label(eps)}): pass each value once")
        out.append(eps)
    return tuple(out)


def parse_seeds(values: Sequence) -> tuple[int, ...]:
    """Distinct integer seeds >= 0, in the order given; UsageError otherwise."""
    if not values:
        raise UsageError("--seeds needs at least one seed, e.g. --seeds 0 1 2")
    out: list[int] = []
    for raw in values:
        try:
            seed = int(str(raw), 10)
        except ValueError:
            raise UsageError(f"seed {raw!r} is not an integer: pass values like 0 1 2") from None
        if seed < 0:
            raise UsageError(f"seeds must be integers >= 0, got {raw!r}")
        if seed in out:
            raise UsageError(f"seed {raw!r} is given twice: pass each seed once")
        out.append(seed)
    return tuple(out)


def data_fingerprint(text: str) -> dict:
    return {"sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(), "chars": len(text)}


def experiment_config(recipe: Recipe, text: str) -> dict:
    """What must match for runs to be compared: the recipe without eps, seed and ``val_every`` (training does
    not depend on it), the precision and the data; not the accelerator: shards may run on other machines."""
    fields = recipe.to_dict()
    for name in ("eps", "seed", "val_every"):
        fields.pop(name)
    return {"recipe": fields, "precision": str(recipe.trainer_kwargs.get("precision") or "32-true"),
            "data": data_fingerprint(text)}


@dataclass(frozen=True)
class Experiment:
    """A grid of eps x seeds over one base recipe (its own eps and seed are ignored)."""

    recipe: Recipe
    eps: tuple[float, ...] = DEFAULT_EPS
    seeds: tuple[int, ...] = DEFAULT_SEEDS

    def __post_init__(self) -> None:
        object.__setattr__(self, "eps", parse_eps(self.eps))
        object.__setattr__(self, "seeds", parse_seeds(self.seeds))

    def pairs(self) -> list[tuple[float, int]]:
        return grid_pairs(self.eps, self.seeds)

    def shard(self, index: int, count: int) -> list[tuple[float, int]]:
        return [p for i, p in enumerate(self.pairs()) if i % count == index]

    def recipe_for(self, eps: float, seed: int) -> Recipe:
        return replace(self.recipe, eps=float(eps), seed=int(seed))
