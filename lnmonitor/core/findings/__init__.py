"""Findings: what the numbers mean for this run, said once, before the damage. ``reader`` (the kinds and the
reader every monitor feeds), ``evidence`` (the tested figures their long forms quote), ``signals`` (the
per-step figures they read) and ``loss_rule`` (the plain loss rule, and what the norms did when it fired)."""
