"""What every monitor (the Lightning callbacks, the Trainer callback, the plain loop's monitor)
shares: ``after_step`` (the post-step sequence every door runs: findings, metrics, logging,
pictures, summary), ``shared`` (how it speaks, the one guard around its entry points, the one
"off for the rest of this run" sentence, its history) and ``arguments`` (the checks of its
constructor arguments)."""
