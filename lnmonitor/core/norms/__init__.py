"""Which norms a model has and what each does: ``registry`` (what a norm computes,
:class:`~lnmonitor.core.norms.registry.NormSpec`, and :func:`register_norm` for the user's own),
``identify`` (the float64 check of each candidate against its own output), ``find`` (the
model's norms, :class:`~lnmonitor.core.norms.find.NormInfo`, and the user's ``include`` /
``exclude``), ``discovery`` (what a monitor tells the user about them) and ``roles`` (which
read the residual stream: the rungs and the final norm)."""
