"""lnmonitor.core.output.files: atomic writes keep the old file when a write fails; JSON is strict."""

from __future__ import annotations

import json
import math
import os

import pytest

from lnmonitor.core.output import files


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


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_written_files_get_the_mode_the_umask_gives_like_any_other_file(tmp_path, umask):
    """Under umask 022 a report, its JSON and its PNGs are 0644 (readable by colleagues), not
    the 0600 of a temporary file; the reference is a file opened the ordinary way."""
    from lnmonitor.views.plotting import new_figure, save_png

    old = os.umask(umask)
    try:
        (tmp_path / "reference.txt").write_text("x")
        files.atomic_write_text(tmp_path / "report.md", "# report\n")
        files.atomic_write_json(tmp_path / "results.json", {"a": 1})
        save_png(new_figure(1, 1), tmp_path / "figure.png")
    finally:
        os.umask(old)
    expected = (tmp_path / "reference.txt").stat().st_mode & 0o777
    assert expected == 0o666 & ~umask
    for name in ("report.md", "results.json", "figure.png"):
        assert (tmp_path / name).stat().st_mode & 0o777 == expected, name
