"""Experiments built on the tiny recipe: the eps comparison and its report."""
