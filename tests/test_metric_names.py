"""Every name a short fit logs is in docs/design.md's list of metric names, and every name
there that applies to the fit is logged: the list is the public interface."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import char_data, trainer

from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor
from lnmonitor.core.metric_names import INVARIANCE_CASES

DESIGN = (Path(__file__).resolve().parent.parent / "docs" / "design.md").read_text()


def listed_names() -> list[str]:
    section = DESIGN[DESIGN.index("## 3. Metric names"):DESIGN.index("## 4.")]
    return [n for n in re.findall(r"`(lnmonitor/[^`]+)`", section) if not n.endswith("/")]


def pattern(name: str) -> re.Pattern:
    cases = "|".join(INVARIANCE_CASES)
    text = re.escape(name).replace(re.escape("<norm>"), r"[\w.]+").replace(re.escape("<case>"), f"({cases})")
    text = text.replace(re.escape("<stack>"), r"[\w.]+")
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
    missing = sorted(n for n, p in patterns.items()
                     if n not in per_norm_baselines | other_stacks and not any(p.match(t) for t in logged))
    assert not missing, f"in docs/design.md but not logged: {missing}"
