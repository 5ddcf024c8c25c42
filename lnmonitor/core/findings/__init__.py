"""Findings: what the numbers mean for this run, said once, before the damage. ``reader`` (the
kinds, their tested figures and the reader every door feeds) and ``signals`` (the per-step
figures they read)."""
