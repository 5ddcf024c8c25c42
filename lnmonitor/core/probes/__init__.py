"""The structural probes behind ``analyze`` and :class:`~lnmonitor.StructureProbe`: ``structure`` (each norm's
Jacobian and a block's rank) and ``blocks`` (where they look: a model's residual blocks and a block's
branch)."""
