"""The figures the findings' long forms quote (:func:`lnmonitor.core.findings.reader.long_form`)
and ``eps_dominates``' threshold: what each kind did where it was tested.  Typed here, never
computed: the research that measured them holds each to its records under ``research/``, so a
rerun that moves one fails there.

* :data:`TESTBED` ``stream_growth``: the confirmation part's runs
  (research/stability/records/confirm; research/stability/test_evidence.py);
  ``eps_dominates``: the fitted testbed (research/stability/records/fitted; the same test);
  ``loss_blowup``: the mid-run testbed (research/midrun/records; research/midrun/test_figures.py)
  and the confirmation part's runs from scratch (the same test).
* :data:`EPS_KNEE`: the eps law's knee (research/eps/records/law; research/eps/test_evidence.py),
  the testbed's pre-stated alarm for ``first_eps_over_var``
  (research/stability/candidate_signals.py; research/stability/test_evidence.py).
* :data:`EPS_COSTS` and :data:`EPS_DELAYS`: the eps comparisons (results/eps-compare-gpt2-init,
  research/eps/records/law-oos, research/eps/records/delay-*; research/eps/test_evidence.py).
"""

from __future__ import annotations

__all__ = ["EPS_COSTS", "EPS_DELAYS", "EPS_KNEE", "TESTBED"]

# What each kind did where it was tested (docs/findings.md): stream_growth on the confirmation part
# (models and seeds its threshold was not fitted on: research.stability.heldout_table.figures,
# amended); eps_dominates in the fitted testbed (research.stability.table.signal_figures;
# peer_hits: the bad runs the better of the two peers' loss rules flagged in time); loss_blowup on
# the held-out mid-run testbed (research/midrun/RESULTS.md) and on the confirmation part's runs
# from scratch.
TESTBED: dict[str, dict] = {
    "stream_growth": dict(bad=64, hits=54, late=1, damaged_only=15, lead=68.5, lead_min=2, lead_max=130,
                          clean=38, false=2, clean_fine_tunes=6, false_fine_tunes=0, blowups=12,
                          blowup_hits=9),
    "eps_dominates": dict(bad=18, clean=14, hits=2, lead=3.5, lead_min=3, lead_max=4, late=0, late_max=None,
                          false=0, peer_hits=0),
    "loss_blowup": dict(events=94, hits=85, healthy=28, harmless=20, false=0, from_start=58,
                        from_start_hits=2, from_start_clean=32, from_start_false=1),
}

# the eps law's knee (docs/eps.md): the first norm's eps/var at step 0 above which a larger eps
# cost validation loss in the grid on the Python help text
EPS_KNEE = 27.2

# What a larger eps cost where it was measured (docs/eps.md): eps 0.1 minus eps 1e-5 at GPT-2's
# init (the first norm's eps/var about 130 at step 0), validation loss after 3,000 steps of the
# tiny recipe, mean over paired seeds.
EPS_COSTS: dict[str, float] = {
    "LayerNorm on the Python help text": 0.0275,
    "RMSNorm on the Python help text": 0.0245,
    "LayerNorm on the standard library's source": 0.1434,
}

# What it cost in steps (docs/eps.md, "The cost as steps lost"): the budget minus the step at
# which the eps 1e-5 run's validation loss first reached the eps 0.1 run's final one, over each
# run's own schedule: (budget, median, lowest, highest) over paired seeds.
EPS_DELAYS: dict[str, tuple[int, int, int, int]] = {
    "LayerNorm on the Python help text": (3000, 797, 558, 1044),
    "LayerNorm on the Python help text, 1,000 steps": (1000, 575, 575, 575),
    "LayerNorm on the standard library's source": (3000, 1137, 1032, 1281),
    "LayerNorm on the standard library's source, 1,000 steps": (1000, 609, 594, 624),
}
