"""The research behind the eps finding (docs/eps.md), on the records of ``lnmonitor
eps-compare``: ``law`` (one law across comparisons: the paired loss difference against the first
norm's eps/var, a hinge fit with bootstrap intervals; ``python -m research.eps``) and ``delay``
(the eps 0.1 cost as steps of training lost; ``python -m research.eps.delay``).

The records are under :data:`RECORDS`: ``law/`` (the law across the comparisons of docs/eps.md,
:data:`RESULTS` ``eps-compare`` and ``eps-compare-gpt2-init``), ``law-oos/`` (the comparisons that
tested its predictions) and ``delay-1000/``, ``delay-source-1000/`` (the comparisons trained for
the delay at 1,000 steps)."""

from pathlib import Path

RECORDS = Path(__file__).resolve().parent / "records"
RESULTS = Path(__file__).resolve().parents[2] / "results"  # the eps-compare records docs/eps.md shows
