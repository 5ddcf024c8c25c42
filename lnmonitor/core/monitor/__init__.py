"""What every monitor (the Lightning callbacks, the Trainer callback, the plain loop's monitor)
shares: ``shared`` (how it speaks, the one guard around its entry points, its history) and
``arguments`` (the checks of its constructor arguments)."""
