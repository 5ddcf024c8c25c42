"""Findings: what the numbers mean for this run, said once, before the damage. ``reader`` (the
kinds, their tested figures and the reader every door feeds), ``signals`` (the per-step
figures they read) and ``loss_rule`` (the plain loss rule, and what the norms did when it fired)."""
