"""The figures the findings' long forms quote (:func:`lnmonitor.core.findings.reader.long_form`) and
``eps_dominates``' threshold: typed here, never computed; the research under ``research/`` holds each to its
records (research/stability/test_evidence.py, research/midrun/test_figures.py, research/eps/test_evidence.py),
so a rerun that moves one fails there.
"""

from __future__ import annotations

__all__ = ["EPS_COSTS", "EPS_DELAYS", "EPS_KNEE", "TESTBED"]

# What each kind did where it was tested (docs/findings.md): stream_growth on the confirmation part
# (research/stability/records/confirm); eps_dominates in the fitted testbed (research/stability/records/
# fitted; peer_hits: the bad runs the better of the two peers' loss rules flagged in time); loss_blowup on
# the held-out mid-run testbed (research/midrun/records) and on the confirmation part's runs from scratch.
TESTBED: dict[str, dict] = {
    "stream_growth": dict(bad=64, hits=54, late=1, damaged_only=15, lead=68.5, lead_min=2, lead_max=130,
                          clean=38, false=2, clean_fine_tunes=6, false_fine_tunes=0, blowups=12,
                          blowup_hits=9),
    "eps_dominates": dict(bad=18, clean=14, hits=2, lead=3.5, lead_min=3, lead_max=4, late=0, late_max=None,
                          false=0, peer_hits=0),
    "loss_blowup": dict(events=94, hits=85, healthy=28, harmless=20, false=0, from_start=58,
                        from_start_hits=2, from_start_clean=32, from_start_false=1),
}

# the eps law's knee (docs/eps.md, research/eps/records/law): the first norm's eps/var at step 0 above which
# a larger eps cost validation loss in the grid on the Python help text
EPS_KNEE = 27.2

# What a larger eps cost (docs/eps.md; results/eps-compare-gpt2-init, research/eps/records/law-oos): eps 0.1
# minus eps 1e-5 at GPT-2's init (first eps/var about 130), validation loss after 3,000 steps, mean of
# paired seeds.
EPS_COSTS: dict[str, float] = {
    "LayerNorm on the Python help text": 0.0275,
    "RMSNorm on the Python help text": 0.0245,
    "LayerNorm on the standard library's source": 0.1434,
}

# What it cost in steps (docs/eps.md; research/eps/records/delay-*): the budget minus the step at which the
# eps 1e-5 run's validation loss first reached the eps 0.1 run's final one: (budget, median, lowest, highest)
# over paired seeds.
EPS_DELAYS: dict[str, tuple[int, int, int, int]] = {
    "LayerNorm on the Python help text": (3000, 797, 558, 1044),
    "LayerNorm on the Python help text, 1,000 steps": (1000, 575, 575, 575),
    "LayerNorm on the standard library's source": (3000, 1137, 1032, 1281),
    "LayerNorm on the standard library's source, 1,000 steps": (1000, 609, 594, 624),
}
