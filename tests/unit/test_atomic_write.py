"""The one atomic writer: a reader sees the old file (or directory) or the whole new one, never a half
or a temp."""

from __future__ import annotations

import json

import pytest

from rolectl.bus.files import atomic_directory, atomic_path, write_json_atomic


def test_write_json_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "state" / "explorer.json"
    write_json_atomic(path, {"step": 1})
    write_json_atomic(path, {"step": 2})
    assert json.loads(path.read_text()) == {"step": 2}
    assert sorted(p.name for p in path.parent.iterdir()) == ["explorer.json"]


@pytest.mark.parametrize("fsync", [True, False])
def test_a_write_that_fails_keeps_the_old_file(tmp_path, fsync):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_path(path, fsync=fsync) as tmp:
            tmp.write_bytes(b"half of the ne")
            raise RuntimeError("disk full")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["weights.bin"]


def test_a_directory_replaces_the_old_one_whole_or_not_at_all(tmp_path):
    final = tmp_path / "export"
    with atomic_directory(final) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic_directory(final) as tmp:
            (tmp / "b").write_text("half")
            raise RuntimeError("the writer failed")
    assert sorted(p.name for p in final.iterdir()) == ["a"]  # the old one stands
    with atomic_directory(final) as tmp:
        (tmp / "c").write_text("2")
    assert sorted(p.name for p in final.iterdir()) == ["c"]  # replaced whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # nothing left beside it
