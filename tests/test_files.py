"""lnmonitor.experiments.files: atomic writes keep the old file when a write fails; JSON is strict."""

from __future__ import annotations

import json
import math
import os

import pytest

from lnmonitor.experiments import files


def test_atomic_write_keeps_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    files.atomic_write_json(path, {"a": 1})

    def boom(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        files.atomic_write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # no temporary left behind


def test_json_is_strict_non_finite_floats_become_null(tmp_path):
    files.atomic_write_json(tmp_path / "x.json", {"a": math.nan, "b": [math.inf, 1.5]})
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": None, "b": [None, 1.5]}
