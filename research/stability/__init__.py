"""The findings' testbed (docs/findings.md): ``testbed`` (tiny-recipe runs made to go wrong, and
healthy controls), ``events`` (what happened in a run and when, and the peers' loss rules),
``table`` (the fitted part's table), ``heldout`` and ``heldout_table`` (models the thresholds
were not fitted on, and what their records mean), ``candidate_signals`` (every signal tested,
with its pre-stated alarm) and ``scales`` (the attention and output logits no norm governs).
``python -m research.stability`` trains the fitted part and writes its table.

The records are under :data:`RECORDS`: ``fitted/`` (the testbed), ``heldout/`` and ``confirm/``
(the held-out and confirmation parts)."""

from pathlib import Path

RECORDS = Path(__file__).resolve().parent / "records"
