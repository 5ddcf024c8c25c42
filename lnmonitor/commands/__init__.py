"""The ``lnmonitor`` command line: ``cli`` (the entry point, ``--help`` without torch) and one
module per subcommand, each with ``register(subparsers)``: ``train_tiny``, ``eps_compare``,
``report``, ``analyze``, ``summarize``; ``recipe_arguments`` holds the recipe's options they share."""
