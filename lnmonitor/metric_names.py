"""The names lnmonitor logs under (part of the public interface, see docs/design.md).

Per norm: ``lnmonitor/<statistic>/<norm>`` with ``<norm>`` the module's qualified name in
the LightningModule; the invariance monitor under ``lnmonitor/invariance/``, the
structure probe under ``lnmonitor/probe/``.
"""

PREFIX = "lnmonitor"
INVARIANCE = f"{PREFIX}/invariance"
PROBE = f"{PREFIX}/probe"


def per_norm(statistic: str, norm: str) -> str:
    """``lnmonitor/<statistic>/<norm>``, e.g. ``lnmonitor/inv_sigma/model.lnf``."""
    return f"{PREFIX}/{statistic}/{norm}"
