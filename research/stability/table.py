"""The stability testbed's table, from its records alone (no torch).

For every run: its events (:mod:`research.stability.events`), and for every candidate
signal (:data:`research.stability.candidate_signals.CANDIDATES`) and both peers'
rules, the first step it fires.  A run with an event is *bad* (its event step is its earliest
event); one without is *clean*.  Per signal and peer: the lead time before the event over the bad
runs it flagged at or before their event (median and range, in steps), hits (bad runs flagged in
time), late flags (only after the event) and false alarms (clean runs flagged at all).  A signal
that flags no bad run in time does not lead, and the table says so.  The *separating threshold*
column is the least threshold no clean run crossed, and the bad runs it would flag in time: a
figure fitted on these very runs, said as such.

:func:`write_table` writes ``<out>/table.md`` and, given a markdown file, replaces the text
between ``<!-- stability-table:start -->`` and ``<!-- stability-table:end -->`` there, so the
figures in the docs are regenerated, never typed.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from lnmonitor.core.findings.signals import crosses
from lnmonitor.core.output.files import atomic_write_text, read_json
from lnmonitor.errors import UsageError
from research.stability.candidate_signals import CANDIDATES, growth_jump, growth_rate
from research.stability.events import (
    damage_onset,
    divergence,
    kill_loss_spike,
    olmo_stability_monitor,
    spike,
)

__all__ = [
    "PEERS", "RunEvents", "analyse", "load_records", "markdown", "run_group", "signal_figures", "write_table",
]

START, END = "<!-- stability-table:start -->", "<!-- stability-table:end -->"
PEERS = ("KillLossSpike (llm-foundry)", "StabilityMonitorCallback (OLMo-core)")


@dataclass(frozen=True)
class RunEvents:
    """One run: its events' first steps (None: never), its earliest event, and the first step
    each signal and peer fires (None: never)."""

    name: str
    seed: int
    final: float
    divergence: int | None
    spike: int | None
    damage: int | None
    fires: dict[str, int | None]

    @property
    def event(self) -> int | None:
        steps = [s for s in (self.divergence, self.spike, self.damage) if s is not None]
        return min(steps) if steps else None


def load_records(out: Path) -> list[dict]:
    records = [read_json(p, "a stability record") for p in sorted(Path(out).glob("*/seed=*/result.json"))]
    if not records:
        raise UsageError(f"no stability records under {str(out)!r}: run python -m research.stability first")
    return records


def with_rates(measured: list[dict]) -> list[dict]:
    """The measured steps with ``growth_rate`` (from the step before) and ``growth_jump`` (over
    the measured steps of its window) filled in, as the live reader reads them."""
    out, previous, read = [], None, []
    for m in measured:
        growth = m.get("growth")
        growth = math.nan if growth is None else growth
        out.append({**m, "growth_rate": growth_rate(previous, m["step"], growth),
                    "growth_jump": growth_jump(read, m["step"], growth)})
        read.append((m["step"], growth))
        if math.isfinite(growth):
            previous = (m["step"], growth)
    return out


def first_fire(measured: list[dict], signal: str, direction: str, threshold: float) -> int | None:
    for m in measured:
        value = m.get(signal)
        if value is not None and crosses(value, direction, threshold):
            return m["step"]
    return None


def run_group(record: dict) -> str:
    """The runs a record's damage is judged against: its configuration's group and learning-rate
    schedule (a warm-up trails a constant lr by more than the margin from step 1, so a warm-up run
    is compared with the best warm-up run)."""
    return f"{record['group']}/{record['recipe'].get('schedule', 'one-cycle')}"


def best_runs(records: list[dict]) -> dict[tuple[str, int], dict]:
    """Per (group, seed): the run of the group's best configuration (lowest mean final loss),
    groups by :func:`run_group`."""
    by_config: dict[tuple[str, str], list[float]] = {}
    for r in records:
        by_config.setdefault((run_group(r), r["config"]), []).append(r["final_val_loss"])
    best_config = {}
    for (group, config), finals in by_config.items():
        mean = statistics.fmean(f if f is not None and math.isfinite(f) else math.inf for f in finals)
        if group not in best_config or mean < best_config[group][1]:
            best_config[group] = (config, mean)
    return {(run_group(r), r["seed"]): r for r in records if r["config"] == best_config[run_group(r)][0]}


def analyse(records: list[dict]) -> list[RunEvents]:
    best = best_runs(records)
    runs = []
    for r in records:
        final = r["final_val_loss"] if r["final_val_loss"] is not None else math.nan
        mine = run_group(r)
        ref = best.get((mine, r["seed"])) or next(v for (g, _), v in best.items() if g == mine)
        loss = [v if v is not None else math.nan for v in r["loss"]]
        measured = with_rates(r["measured"])
        fires = {s: first_fire(measured, s, *rule) for s, rule in CANDIDATES.items()}
        fires[PEERS[0]] = kill_loss_spike(loss)
        fires[PEERS[1]] = olmo_stability_monitor(loss, r["grad_norm"])
        runs.append(RunEvents(
            r["config"], r["seed"], final, divergence(loss), spike(loss),
            damage_onset(loss, ref["loss"], final, ref["final_val_loss"]), fires))
    return sorted(runs, key=lambda e: (e.name, e.seed))


def signal_figures(runs: list[RunEvents], name: str) -> dict:
    """What a signal (or peer) did over ``runs``: ``bad`` and ``clean`` runs, ``hits`` (bad runs
    flagged at or before their event), the lead times of those (``lead`` median, ``lead_min``,
    ``lead_max``; None without a hit), ``late`` (flagged only after) with ``late_max`` (the
    longest lag) and ``false`` (clean runs flagged)."""
    bad = [r for r in runs if r.event is not None]
    clean = [r for r in runs if r.event is None]
    leads = [r.event - r.fires[name] for r in bad if r.fires[name] is not None and r.fires[name] <= r.event]
    lags = [r.fires[name] - r.event for r in bad if r.fires[name] is not None and r.fires[name] > r.event]
    return {
        "bad": len(bad), "clean": len(clean), "hits": len(leads),
        "lead": statistics.median(leads) if leads else None,
        "lead_min": min(leads) if leads else None, "lead_max": max(leads) if leads else None,
        "late": len(lags), "late_max": max(lags) if lags else None,
        "false": sum(1 for r in clean if r.fires[name] is not None),
    }


def _row(name: str, rule: str, runs: list[RunEvents]) -> str:
    f = signal_figures(runs, name)
    lead = f"{f['lead']:g} ({f['lead_min']} to {f['lead_max']})" if f["hits"] else "**does not lead**"
    late = f"{f['late']} (up to {f['late_max']} steps after)" if f["late"] else "0"
    return f"| {name} | {rule} | {lead} | {f['hits']}/{f['bad']} | {late} | {f['false']}/{f['clean']} |"


def _separating(signal: str, records: list[dict], runs: list[RunEvents]) -> str:
    direction = CANDIDATES[signal][0]
    events = {(r.name, r.seed): r.event for r in runs}
    sign = -1.0 if direction == "<" else 1.0
    clean_worst, bad_hits, bad = -math.inf, 0, 0

    def values(rec, until=None):
        out = []
        for m in with_rates(rec["measured"]):
            v = m.get(signal)
            if v is None or not math.isfinite(v) or (until is not None and m["step"] > until):
                continue
            out.append(sign * (abs(v) if direction == "abs>" else v))
        return out

    for rec in records:
        if events[(rec["config"], rec["seed"])] is None:
            clean_worst = max([clean_worst, *values(rec)])
    for rec in records:
        event = events[(rec["config"], rec["seed"])]
        if event is not None:
            bad += 1
            bad_hits += any(v > clean_worst for v in values(rec, event))
    if not math.isfinite(clean_worst):
        return "no clean run measured it"
    return f"{direction} {sign * clean_worst:.3g}: {bad_hits}/{bad}"


def markdown(records: list[dict]) -> str:
    runs = analyse(records)
    bad = sum(1 for r in runs if r.event is not None)
    lines = [
        f"{len(runs)} runs, {bad} with an event, {len(runs) - bad} clean; "
        f"{sum(r['steps'] for r in records):,} steps, "
        f"{sum(r['cpu_seconds'] for r in records) / 60:.1f} CPU minutes of training.",
        "",
        "| signal | alarm | lead time before the event, steps: median (range) | bad runs flagged in time "
        "| flagged only after the event | false alarms on clean runs | separating threshold: bad runs "
        "flagged in time |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for signal, (direction, threshold) in CANDIDATES.items():
        row = _row(signal, f"{direction} {threshold:g}", runs)
        lines.append(f"{row} {_separating(signal, records, runs)} |")
    lines.append(_row(PEERS[0], "loss >= 2x mean of last 100, > 4 steps", runs) + " n/a |")
    lines.append(_row(PEERS[1], "loss or grad norm > mean + 6 sd of last 128", runs) + " n/a |")
    lines += ["", "Per run (steps; `-`: never):", "",
              "| run | seed | final val loss | divergence | spike | damage onset | event | "
              + " | ".join(CANDIDATES) + " | KillLossSpike | StabilityMonitor |",
              "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * (len(CANDIDATES) + 2)]
    for r in runs:
        cells = [r.divergence, r.spike, r.damage, r.event, *r.fires.values()]
        shown = " | ".join("-" if c is None else str(c) for c in cells)
        lines.append(f"| {r.name} | {r.seed} | {r.final:.4f} | {shown} |")
    return "\n".join(lines) + "\n"


def write_table(out: Path, doc: Path | None = None) -> Path:
    """Write ``<out>/table.md`` (and splice it into ``doc`` between the markers); its path."""
    text = markdown(load_records(out))
    path = Path(out) / "table.md"
    atomic_write_text(path, text)
    if doc is not None:
        body = Path(doc).read_text()
        if START not in body or END not in body:
            raise UsageError(f"{str(doc)!r} has no {START} ... {END} markers to put the table between")
        head, rest = body.split(START, 1)
        atomic_write_text(Path(doc), f"{head}{START}\n{text}{END}{rest.split(END, 1)[1]}")
    return path
