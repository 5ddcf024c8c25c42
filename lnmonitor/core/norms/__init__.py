"""Which norms a model has and what each does: ``registry`` (what a norm computes, :func:`register_norm`),
``identify`` (the float64 check of each candidate), ``find`` (the model's norms, ``include``/``exclude``),
``discovery`` (what a monitor tells the user about them) and ``roles`` (the rungs and the final norm)."""
