"""The ``Example::`` blocks of the monitors' docstrings run as doctests: what a user copies works."""

from __future__ import annotations

import doctest
import importlib
import warnings

import pytest

MODULES = [
    "lnmonitor.lightning.layernorm_monitor",
    "lnmonitor.lightning.invariance_monitor",
    "lnmonitor.lightning.structure_probe",
    "lnmonitor.integrations.loop",
    "lnmonitor.integrations.transformers",
]


@pytest.mark.parametrize("name", MODULES)
def test_the_examples_in_the_docstrings_run(name):
    if name.endswith("transformers"):
        pytest.importorskip("transformers")
    module = importlib.import_module(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the examples' tiny models say things; the output is what counts
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no example"
    assert result.failed == 0
