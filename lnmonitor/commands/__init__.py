"""Subcommands of the ``lnmonitor`` command line; each module has ``register(subparsers)``."""
