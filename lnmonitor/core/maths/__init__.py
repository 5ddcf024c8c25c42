"""The maths, on rows of a norm's input and needing no model: ``geometry`` (the normalised
input, the Jacobian, the dead plane, in float64-exact closed forms), ``random_baseline`` (the
exact share of a random direction) and ``reductions`` (the fused per-row numbers the taps compute,
equal to ``geometry`` to float32 rounding)."""
