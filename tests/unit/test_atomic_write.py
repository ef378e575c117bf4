"""The one atomic writer: a reader sees the old file or the whole new one, never a half or a temp."""

from __future__ import annotations

import json

import pytest

from rolectl.bus.files import atomic_path, write_json_atomic


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
