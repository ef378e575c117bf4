"""`MemberMap` and `MemberKeys` read as the dict the same writes would make, order included, and never change."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rolectl.sync_protocol import MemberRef, Role
from rolectl.sync_protocol.members import PAGE, MemberKeys, MemberMap
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


# changes to key sets: (which earlier set to change, add or drop, which key)
_key_changes = st.lists(st.tuples(st.integers(0, 40), st.booleans(), st.integers(0, 6)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(_key_changes)
def test_member_keys_read_as_the_dicts_the_same_changes_make_from_any_earlier_set(changes):
    # changing an older set (a state kept and folded on again) must not show in its successors
    sets = [(MemberKeys(["e0", "e1"]), dict.fromkeys(["e0", "e1"]))]
    for which, add, i in changes:
        keys, model = sets[which % len(sets)]
        key, model = f"e{i}", dict(model)
        if add:
            keys = keys.with_key(key)
            model.setdefault(key, None)
        else:
            keys = keys.without(key)
            model.pop(key, None)
        sets.append((keys, model))
        for keys, model in sets:
            assert list(keys) == list(model) and len(keys) == len(model)
            assert all((f"e{j}" in keys) == (f"e{j}" in model) for j in range(7))


def test_a_thousand_arrivals_and_reports_share_one_log():
    waiting = reported = MemberKeys()
    for i in range(1024):
        waiting = waiting.with_key(f"explorer/e{i}")
    arrived = waiting
    for i in range(1024):
        reported, waiting = reported.with_key(f"explorer/e{i}"), waiting.without(f"explorer/e{i}")
    assert len(arrived) == 1024 and len(waiting) == 0 and list(reported) == list(arrived)
    assert waiting._log is arrived._log  # no copy: each change appended to the log
    assert arrived == MemberKeys(reversed(list(arrived))) and arrived != waiting
