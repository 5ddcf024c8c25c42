"""Every name a short fit logs is in docs/design.md's list of metric names, and every name
there that applies to the fit is logged: the list is the public interface.  docs/metrics.md is
what ``python tools/metrics_doc.py`` writes, and holds every name a fit logs."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from conftest import char_data, trainer

from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor
from lnmonitor.core.findings.reader import KINDS
from lnmonitor.core.output.metric_names import (
    INVARIANCE_CASES,
    Metric,
    baseline_metric,
    health_metric,
    hist_metric,
    invariance_metric,
    ladder_metric,
    parse,
    probe_metric,
    run_metric,
    unsplit,
)
from lnmonitor.views.summary import RunCurves, summary_text

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from metrics_doc import DOC, FAMILIES, family_of, render  # noqa: E402

DESIGN = (Path(__file__).resolve().parent.parent / "docs" / "design.md").read_text()


def listed_names() -> list[str]:
    section = DESIGN[DESIGN.index("## 3. Metric names"):DESIGN.index("## 4.")]
    return [n for n in re.findall(r"`(lnmonitor/[^`]+)`", section) if not n.endswith("/")]


def pattern(name: str) -> re.Pattern:
    cases = "|".join(INVARIANCE_CASES)
    text = re.escape(name).replace(re.escape("<norm>"), r"[\w.]+").replace(re.escape("<case>"), f"({cases})")
    text = text.replace(re.escape("<stack>"), r"[\w.]+").replace(re.escape("<kind>"), f"({'|'.join(KINDS)})")
    return re.compile(text + "$")


@pytest.fixture(scope="module")
def fit():
    """A three-step fit with the monitor and the invariance monitor measuring every step."""
    data, module = char_data(3)
    ln = LayerNormMonitor(every_n_steps=1, keep_history=True, images=False, summary=False)
    inv = FinalNormInvarianceMonitor(invariance_every_n_steps=1, keep_history=True, summary=False)
    trainer(3, [ln, inv], validate_every=3).fit(module, datamodule=data)
    return ln, inv


def test_a_fit_logs_exactly_the_names_the_design_lists(fit):
    ln, inv = fit
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
    kept = RunCurves()
    for h in ln.history + inv.history:
        kept.add(h["step"], {k: v for k, v in h.items() if k != "step"})
    curves = kept.curves()
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


def test_docs_metrics_is_generated_from_the_families_and_holds_every_name_a_fit_logs(fit):
    assert DOC.read_text(encoding="utf-8") == render(), "run: python tools/metrics_doc.py"
    ln, inv = fit
    logged = {tag for h in ln.history + inv.history for tag in h if tag != "step"}
    # and what this fit does not log: findings, the structure probe, histograms, pictures, settings
    logged |= {health_metric(kind) for kind in KINDS} | {probe_metric("block_rank", "blocks.0"),
                                                          probe_metric("gain_spread", "blocks.0.ln1")}
    logged |= {hist_metric("share", "model.lnf"), run_metric("ladder"), run_metric("eps")}
    assert not sorted(t for t in logged if family_of(t) is None), "logged, not in docs/metrics.md"
    assert all(family_of(f"train/{t}") is family_of(t) for t in logged)  # a Trainer's split
    # every family is in the page, and no family is a name nothing logs in this fit's kind
    page = DOC.read_text(encoding="utf-8")
    assert all(f"`{f.names[0]}`" in page for f in FAMILIES)


def test_the_experiments_final_figures_and_the_recipes_losses_go_through_the_codec():
    """One codec for every tag: an eps-comparison run's ``final/<key>`` is built and parsed by it,
    and the recipe's losses are its constants (no name built by hand elsewhere)."""
    from lnmonitor.core.output.metric_names import TRAIN_LOSS, VAL_LOSS, Metric, final_metric, parse
    from lnmonitor.experiments.eps.run import FINAL_METRICS

    for key in FINAL_METRICS:
        tag = final_metric(key)
        assert tag == f"final/{key}" and parse(tag) == Metric("final", key) and parse(tag).tag == tag
    assert (TRAIN_LOSS, VAL_LOSS) == ("train/loss", "val/loss") and parse(VAL_LOSS) is None
