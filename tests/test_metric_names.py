"""Every name a short fit logs is in docs/design.md's list of metric names, and every name
there that applies to the fit is logged: the list is the public interface."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import char_data, trainer

from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor
from lnmonitor.core.findings import KINDS
from lnmonitor.core.metric_names import (
    INVARIANCE_CASES,
    Metric,
    baseline_metric,
    health_metric,
    invariance_metric,
    ladder_metric,
    parse,
    probe_metric,
    run_metric,
    unsplit,
)
from lnmonitor.views.summary import Trail, summary_text

DESIGN = (Path(__file__).resolve().parent.parent / "docs" / "design.md").read_text()


def listed_names() -> list[str]:
    section = DESIGN[DESIGN.index("## 3. Metric names"):DESIGN.index("## 4.")]
    return [n for n in re.findall(r"`(lnmonitor/[^`]+)`", section) if not n.endswith("/")]


def pattern(name: str) -> re.Pattern:
    cases = "|".join(INVARIANCE_CASES)
    text = re.escape(name).replace(re.escape("<norm>"), r"[\w.]+").replace(re.escape("<case>"), f"({cases})")
    text = text.replace(re.escape("<stack>"), r"[\w.]+").replace(re.escape("<kind>"), f"({'|'.join(KINDS)})")
    return re.compile(text + "$")


def test_a_fit_logs_exactly_the_names_the_design_lists():
    data, module = char_data(3)
    ln = LayerNormMonitor(every_n_steps=1, keep_history=True, images=False, summary=False)
    inv = FinalNormInvarianceMonitor(every_n_steps=1, keep_history=True, summary=False)
    trainer(3, [ln, inv], validate_every=3).fit(module, datamodule=data)
    logged = {tag for h in ln.history + inv.history for tag in h if tag != "step"}
    patterns = {name: pattern(name) for name in listed_names()}
    unlisted = sorted(t for t in logged if not any(p.match(t) for p in patterns.values()))
    assert not unlisted, f"logged but not in docs/design.md: {unlisted}"
    # one width and kind: the shared baselines, not the per-norm ones; the tiny GPT's
    # forward returns logits, so max_dlogit is there too; one stack: no other stack's ladder
    per_norm_baselines = {"lnmonitor/share_baseline/median/<norm>", "lnmonitor/share_baseline/max/<norm>"}
    other_stacks = {"lnmonitor/ladder/<stack>/attenuation", "lnmonitor/ladder/<stack>/growth"}
    findings = {"lnmonitor/health/<kind>"}  # logged from a finding on (test_findings.py); this fit has none
    missing = sorted(n for n, p in patterns.items() if n not in per_norm_baselines | other_stacks | findings
                     and not any(p.match(t) for t in logged))
    assert not missing, f"in docs/design.md but not logged: {missing}"

    # the codec reads back every name it built, also under an integration's prefix (TensorBoard's
    # train/ before a transformers Trainer's tags), and a summary reads a prefixed run the same
    assert all(parse(t).tag == t and parse(f"train/{t}") == parse(t) for t in logged)
    trail = Trail()
    for h in ln.history + inv.history:
        trail.add(h["step"], {k: v for k, v in h.items() if k != "step"})
    curves = trail.curves()
    assert {unsplit(f"train/{t}") for t in curves} == set(curves)
    assert "attenuation" in summary_text(curves)


def test_every_kind_of_name_is_built_and_parsed_by_the_codec():
    built = {
        ladder_metric("growth", "model.encoder"): Metric("ladder", "growth", "model.encoder"),
        ladder_metric("attenuation"): Metric("ladder", "attenuation", ""),
        baseline_metric("max", "h.0.ln_1"): Metric("baseline", "max", "h.0.ln_1"),
        baseline_metric("median"): Metric("baseline", "median", ""),
        invariance_metric("dloss", "scale_3"): Metric("invariance", "dloss", "scale_3"),
        invariance_metric("scale_slope"): Metric("invariance", "scale_slope", ""),
        probe_metric("block_rank", "h.1"): Metric("probe", "block_rank", "h.1"),
        health_metric("spike"): Metric("health", "spike", ""),
        run_metric("eps"): Metric("run", "eps", ""),
        "lnmonitor/ladder_position/h.0.ln_1": Metric("norm", "ladder_position", "h.0.ln_1"),
    }
    assert {tag: parse(tag) for tag in built} == built
    assert all(m.tag == tag for tag, m in built.items())
    assert [parse(t) for t in ("train/loss", "lnmonitorx/sigma/a", "val/lnmonitor")] == [None, None, None]
