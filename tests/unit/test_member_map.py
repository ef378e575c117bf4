"""`MemberMap` reads as the dict the same writes would make, order included, and never changes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rolectl.sync_protocol import MemberRef, Role
from rolectl.sync_protocol.members import PAGE, MemberMap
from rolectl.sync_protocol.state import MemberState


def _member(i: int, step: int) -> MemberState:
    return MemberState(ref=MemberRef(role=Role.EXPLORER, id=f"e{i}", incarnation=1), step=step)


# a sequence of inputs, each writing a few members (a new key joins; an old one changes)
_writes = st.lists(st.lists(st.tuples(st.integers(0, 3 * PAGE), st.integers(0, 9)), max_size=4), max_size=60)


@settings(max_examples=300, deadline=None)
@given(_writes)
def test_a_member_map_reads_as_the_dict_the_same_writes_make(writes):
    reference: dict[str, MemberState] = {}
    versions = [(MemberMap(), {})]
    current = MemberMap()
    for batch in writes:
        changes = {f"explorer/e{i}": _member(i, step) for i, step in batch}
        current = current.with_changes(changes)
        reference.update(changes)
        versions.append((current, dict(reference)))
    for mapping, expected in versions:  # every version, old ones too: a write changed none of them
        assert list(mapping.items()) == list(expected.items())
        assert list(mapping) == list(expected) and list(mapping.values()) == list(expected.values())
        assert len(mapping) == len(expected) and mapping == expected
        for key in expected:
            assert key in mapping and mapping[key] is expected[key] and mapping.get(key) is expected[key]
        assert mapping.get("explorer/nobody") is None and "explorer/nobody" not in mapping


def test_a_successor_shares_every_page_it_did_not_write():
    base = MemberMap((f"explorer/e{i}", _member(i, 0)) for i in range(4 * PAGE))
    changed = base.with_changes({"explorer/e70": _member(70, 1)})
    shared = [a is b for a, b in zip(base._pages, changed._pages)]
    assert shared == [True, False, True, True] and changed._page_of is base._page_of
    assert base["explorer/e70"].step == 0 and changed["explorer/e70"].step == 1
    with pytest.raises(TypeError):
        changed["explorer/e1"] = _member(1, 5)  # type: ignore[index]
