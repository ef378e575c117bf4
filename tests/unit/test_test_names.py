"""Test files are imported by basename (pytest's rootdir imports): two of one name fail to collect."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_files_share_a_name():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert sorted(name for name, n in names.items() if n > 1) == []
