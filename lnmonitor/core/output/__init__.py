"""Names and output: ``metric_names`` (the one codec that builds and parses every logged tag),
``writers`` (where a monitor's numbers go when no framework logs them) and ``files`` (atomic,
strict-JSON files)."""
