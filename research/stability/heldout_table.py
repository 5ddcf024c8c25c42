"""What the held-out records mean: the user-visible event, each signal's hits, lead and false
alarms, beside the same figures on the fitted part, and which signals pass the rule to ship.

docs/findings.md ("Held out") states every definition here before the held-out part was
trained: the **visible event** is a non-finite loss or the 10-step mean training loss more than
:data:`VISIBLE_MARGIN` above the reference run's (the same family and seed, the same batches) at
the same step; **damage** is the last 20 steps' mean more than :data:`DAMAGE_MARGIN` above the
reference's.  On the fitted part (:mod:`research.stability.testbed`) the reference is the
run of the group's best configuration with the same seed, as its damage onset's is, and the
growth was taken on every 5th step only.  ``python -m research.stability.heldout_table``
writes the tables between the ``stability-heldout-table`` markers of docs/findings.md.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from research.stability import RECORDS
from research.stability import heldout as stability_heldout
from research.stability.candidate_signals import growth_jump
from research.stability.events import kill_loss_spike, olmo_stability_monitor
from research.stability.table import best_runs, load_records, run_group

__all__ = ["RULES", "Judged", "judge_fitted", "judge_heldout", "markdown", "visible_event", "write"]

VISIBLE_WINDOW, VISIBLE_MARGIN = 10, 0.3
DAMAGE_WINDOW, DAMAGE_MARGIN = 20, 0.10
MARKERS = ("<!-- stability-heldout-table:start -->", "<!-- stability-heldout-table:end -->")
CONFIRM_MARKERS = ("<!-- stability-confirm-table:start -->", "<!-- stability-confirm-table:end -->")
FITTED = RECORDS / "fitted"


def _mean_at(loss: Sequence[float], step: int) -> float:
    window = loss[step - VISIBLE_WINDOW + 1: step + 1]
    return sum(window) / len(window)


def visible_event(loss: Sequence[float], reference: Sequence[float]) -> int | None:
    """The first step with a non-finite loss, or (from step ``VISIBLE_WINDOW - 1``) a
    ``VISIBLE_WINDOW``-step mean more than ``VISIBLE_MARGIN`` above the reference's at that step;
    None when neither happens."""
    for step, value in enumerate(loss):
        if not math.isfinite(value):
            return step
        if VISIBLE_WINDOW - 1 <= step < len(reference) and all(map(math.isfinite, reference[:step + 1])) \
                and _mean_at(loss, step) > _mean_at(reference, step) + VISIBLE_MARGIN:
            return step
    return None


def damaged(loss: Sequence[float], reference: Sequence[float]) -> bool:
    """The last ``DAMAGE_WINDOW`` steps' mean more than ``DAMAGE_MARGIN`` above the reference's
    (a non-finite loss among them: damaged)."""
    mine, theirs = loss[-DAMAGE_WINDOW:], reference[-DAMAGE_WINDOW:]
    if not all(map(math.isfinite, mine)):
        return True
    return sum(mine) / len(mine) > sum(theirs) / len(theirs) + DAMAGE_MARGIN


def running_minimum(loss: Sequence[float], factor: float = 1.5, after: int = 10) -> int | None:
    """From step ``after``: the first loss above ``factor`` times the least loss before it (a
    non-finite loss fires)."""
    for step in range(after, len(loss)):
        if not math.isfinite(loss[step]) or loss[step] > factor * min(loss[:step]):
            return step
    return None


def _first(points: Sequence[tuple[int, float]], test: Callable[[float], bool]) -> int | None:
    return next((step for step, value in points if math.isfinite(value) and test(value)), None)


def growth_fires(points: Sequence[tuple[int, float]]) -> dict[str, int | None]:
    """The first step each growth rule fires on ``points`` ``(step, growth)`` in step order (nan
    where a step has none): the fit's start is the first finite value."""
    start = next((g for _, g in points if math.isfinite(g) and g > 0), math.nan)
    jumps, read = [], []
    for step, value in points:
        jumps.append((step, growth_jump(read, step, value)))
        read.append((step, value))
    return {
        "growth_jump > 25": _first(jumps, lambda j: j > 25.0),
        "growth_over_start > 35": _first(points, lambda g: g / start > 35.0),
        "growth > 20": _first(points, lambda g: g > 20.0),
    }


# the signals of the table, in its order; the loss rules' windows the shortest the runs allow
RULES = ("growth_jump > 25", "growth_over_start > 35", "growth > 20", "vanished_share > 0.05",
         "running minimum x1.5", "KillLossSpike (window 10)", "StabilityMonitor (window 20)")


@dataclass(frozen=True)
class Judged:
    """One run: its ``part`` (fitted, held-out), family, configuration, seed, whether it is a
    reference or a fine-tune, its visible event's step (None: clean), damage, and the first step
    each of :data:`RULES` fired (None: never; absent: not measured in this part)."""

    part: str
    family: str
    name: str
    seed: int
    reference: bool
    fine_tune: bool
    event: int | None
    damage: bool
    fires: dict[str, int | None]
    start: float

    @property
    def bad(self) -> bool:
        return self.event is not None

    @property
    def bad_amended(self) -> bool:
        """The amended event (docs/findings.md): the visible event, or ended damaged."""
        return self.event is not None or self.damage


def _nan(values: Sequence[float | None]) -> list[float]:
    return [math.nan if v is None else float(v) for v in values]


def _loss_rules(loss: list[float], grad_norm: list[float]) -> dict[str, int | None]:
    blown = [v if math.isfinite(v) else math.inf for v in loss]
    return {"running minimum x1.5": running_minimum(loss),
            "KillLossSpike (window 10)": kill_loss_spike(blown, window_size=10),
            "StabilityMonitor (window 20)": olmo_stability_monitor(blown, grad_norm, window_size=20)}


def judge_heldout(records: list[dict]) -> list[Judged]:
    """The held-out records, each against its family's and seed's reference run."""
    references = {(r["family"], r["seed"]): _nan(r["loss"]) for r in records if r["reference"]}
    out = []
    for r in records:
        loss, reference = _nan(r["loss"]), references[(r["family"], r["seed"])]
        growth = _nan(r["growth"])
        fires = growth_fires(list(enumerate(growth)))
        vanished = [(m["step"], math.nan if m.get("vanished_share") is None else m["vanished_share"])
                    for m in r["measured"]]
        fires["vanished_share > 0.05"] = _first(vanished, lambda v: v > 0.05)
        fires.update(_loss_rules(loss, _nan(r["grad_norm"])))
        event = None if r["reference"] else visible_event(loss, reference)
        out.append(Judged("held-out", r["family"], r["name"], r["seed"], r["reference"], r["fine_tune"],
                          event, not r["reference"] and damaged(loss, reference), fires, growth[0]))
    return out


def judge_fitted(records: list[dict]) -> list[Judged]:
    """The fitted part's records, each against its group's best run with the same seed."""
    best = best_runs(records)
    out = []
    for r in records:
        ref = best.get((run_group(r), r["seed"]))
        loss, reference = _nan(r["loss"]), _nan(ref["loss"]) if ref is not None else []
        points = [(m["step"], math.nan if m.get("growth") is None else m["growth"]) for m in r["measured"]]
        fires = growth_fires(points)
        fires.update(_loss_rules(loss, _nan(r["grad_norm"])))
        own = ref is None or ref is r
        event = None if own else visible_event(loss, reference)
        out.append(Judged("fitted", "tiny", r["config"], r["seed"], own, False, event,
                          not own and damaged(loss, reference), fires, points[0][1]))
    return out


def figures(runs: list[Judged], rule: str, amended: bool = False) -> dict:
    """A rule's figures over the runs that measured it ({} where none did): on the bad runs,
    hits (a fire at or before the visible event, or at any step on a run only damaged), leads to
    the visible event, late fires; false alarms on the clean runs (references included) and on
    the clean fine-tunes; the blow-ups (a visible event within the first ``VISIBLE_WINDOW`` steps)
    said in time.  ``amended``: bad is the visible event or damage (the confirmation's event),
    else the visible event alone."""
    measured = [r for r in runs if rule in r.fires]
    if not measured:
        return {}
    bad = [r for r in measured if (r.bad_amended if amended else r.bad)]
    clean = [r for r in measured if not (r.bad_amended if amended else r.bad)]
    fired = [r for r in bad if r.fires[rule] is not None]
    hits = [r for r in fired if r.event is None or r.fires[rule] <= r.event]
    leads = [r.event - r.fires[rule] for r in hits if r.event is not None]
    blowups = [r for r in bad if r.event is not None and r.event < VISIBLE_WINDOW]
    return {
        "bad": len(bad), "hits": len(hits), "late": len(fired) - len(hits),
        "damaged_only": sum(1 for r in bad if r.event is None),
        "lead": statistics.median(leads) if leads else None, "lead_min": min(leads, default=None),
        "lead_max": max(leads, default=None), "clean": len(clean),
        "false": sum(1 for r in clean if r.fires[rule] is not None),
        "clean_fine_tunes": sum(1 for r in clean if r.fine_tune),
        "false_fine_tunes": sum(1 for r in clean if r.fine_tune and r.fires[rule] is not None),
        "blowups": len(blowups),
        "blowup_hits": sum(1 for r in blowups if r.fires[rule] is not None and r.fires[rule] <= r.event),
    }


def ships(rule: str, held: dict) -> bool:
    """The pre-registered rule (the held-out part's and, on amended figures, the confirmation's):
    ``growth_jump`` at or before the event on 2 of 3 bad runs whose event comes in their first 10
    steps; every other signal on 2 of 3 bad runs; each on at most 1 in 10 clean runs and on no
    clean fine-tune."""
    if not held or not held["bad"]:
        return False
    quiet = held["false"] * 10 <= held["clean"] and held["false_fine_tunes"] == 0
    if rule.startswith("growth_jump"):
        return quiet and held["blowups"] > 0 and 3 * held["blowup_hits"] >= 2 * held["blowups"]
    return quiet and 3 * held["hits"] >= 2 * held["bad"]


def _cell(f: dict) -> str:
    if not f:
        return "not measured"
    lead = "" if f["lead"] is None else f", lead {f['lead']:g} ({f['lead_min']}-{f['lead_max']})"
    return f"{f['hits']}/{f['bad']}{lead}, late {f['late']}; false {f['false']}/{f['clean']}"


def markdown(fitted: list[Judged], held: list[Judged]) -> str:
    """The tables: per rule, fitted beside held-out (from scratch and fine-tunes apart), the
    verdict; then every held-out configuration's runs."""
    scratch = [r for r in held if not r.fine_tune]
    tunes = [r for r in held if r.fine_tune]
    early = sum(r.event is not None and r.event < VISIBLE_WINDOW for r in held)
    lines = [
        f"Fitted part: {len(fitted)} runs ({sum(r.bad for r in fitted)} bad); held-out: {len(held)} runs "
        f"({sum(r.bad for r in held)} bad, {early} of them in their first {VISIBLE_WINDOW} steps). Cells: "
        "hits/bad runs (fired at or before the visible event), median lead in steps (range), fired after "
        "it; false alarms/clean runs.",
        "",
        "| signal | fitted part | held-out, from scratch | held-out, fine-tunes | blow-ups said in time | "
        "false on clean fine-tunes | ships |",
        "|---|---|---|---|---:|---:|---|",
    ]
    for rule in RULES:
        whole = figures(held, rule)
        blow = f"{whole['blowup_hits']}/{whole['blowups']}" if whole else "-"
        tune = f"{whole['false_fine_tunes']}/{whole['clean_fine_tunes']}" if whole else "-"
        verdict = "yes" if ships(rule, whole) else "no"
        lines.append(f"| {rule} | {_cell(figures(fitted, rule))} | {_cell(figures(scratch, rule))} | "
                     f"{_cell(figures(tunes, rule))} | {blow} | {tune} | {verdict} |")
    lines += ["", "| family | configuration | seed | ladder at step 0 | visible event | damaged | "
              + " | ".join(RULES) + " |", "|---|---|---:|---:|---:|---|" + "---:|" * len(RULES)]
    for r in held:
        fires = " | ".join("-" if r.fires.get(rule) is None else str(r.fires[rule]) for rule in RULES)
        event = "reference" if r.reference else ("-" if r.event is None else str(r.event))
        lines.append(f"| {r.family} | {r.name} | {r.seed} | {r.start:.1f} | {event} | "
                     f"{'yes' if r.damage else '-'} | {fires} |")
    return "\n".join(lines) + "\n"


def _amended_cell(f: dict) -> str:
    lead = "" if f["lead"] is None else f", lead {f['lead']:g} ({f['lead_min']}-{f['lead_max']})"
    return f"{f['hits']}/{f['bad']} ({f['damaged_only']} only damaged){lead}; false {f['false']}/{f['clean']}"


def confirm_markdown(held: list[Judged], confirm: list[Judged]) -> str:
    """The confirmation's table: each rule under the amended event on the held-out part (where
    the amendment was read) and on the confirmation part (where it is tested), by family."""
    families = sorted({r.family for r in confirm}, key=lambda f: (f in stability_heldout.DEEP_FAMILIES, f))
    bad = sum(r.bad_amended for r in confirm)
    lines = [
        f"Confirmation part: {len(confirm)} runs, {bad} bad under the amended event "
        f"({sum(r.bad for r in confirm)} with the visible event). Cells: hits/bad runs (of them only "
        "damaged), median lead to the visible event (range); false alarms/clean runs.",
        "",
        "| signal | held-out part (amendment read here) | confirmation part | its clean fine-tunes fired on "
        "| ships |",
        "|---|---|---|---:|---|",
    ]
    for rule in RULES[:4]:
        held_f, conf_f = figures(held, rule, amended=True), figures(confirm, rule, amended=True)
        verdict = "yes" if rule == "growth_over_start > 35" and ships(rule, conf_f) else (
            "no" if rule == "growth_over_start > 35" else "not a candidate")
        lines.append(f"| {rule} | {_amended_cell(held_f)} | {_amended_cell(conf_f)} | "
                     f"{conf_f['false_fine_tunes']}/{conf_f['clean_fine_tunes']} | {verdict} |")
    lines += ["", "| family | growth_over_start > 35 on the confirmation part | ladder at step 0 (median) |",
              "|---|---|---:|"]
    for family in families:
        mine = [r for r in confirm if r.family == family]
        lines.append(f"| {family} | {_amended_cell(figures(mine, 'growth_over_start > 35', amended=True))} | "
                     f"{statistics.median(r.start for r in mine):.1f} |")
    return "\n".join(lines) + "\n"


def _between(text: str, markers: tuple[str, str], table: str) -> str:
    head, rest = text.split(markers[0], 1)
    _, tail = rest.split(markers[1], 1)
    return f"{head}{markers[0]}\n{table}{markers[1]}{tail}"


def write(doc: Path = Path("docs/findings.md"), held_out: Path = stability_heldout.DEFAULT_OUT,
          fitted: Path = FITTED, confirm: Path = stability_heldout.CONFIRM_OUT) -> str:
    """Regenerate the tables between the markers of ``doc``; returns them."""
    held = judge_heldout(stability_heldout.load(held_out))
    table = markdown(judge_fitted(load_records(fitted)), held)
    text = _between(doc.read_text(), MARKERS, table)
    confirmed = judge_heldout(stability_heldout.load(confirm, stability_heldout.CONFIRM_RUNS))
    if confirmed and CONFIRM_MARKERS[0] in text:
        extra = confirm_markdown(held, confirmed)
        text = _between(text, CONFIRM_MARKERS, extra)
        table += "\n" + extra
    doc.write_text(text)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The held-out tables of docs/findings.md.")
    parser.add_argument("--doc", type=Path, default=Path("docs/findings.md"))
    args = parser.parse_args(argv)
    print(write(args.doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
