"""`MemberKeys` reads as the ordered dict the same adds and drops make, and never changes."""

from __future__ import annotations

from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rolectl.sync_protocol import members
from rolectl.sync_protocol.members import PAGE, MemberKeys

_KEYS = [f"explorer/e{i}" for i in range(3 * PAGE)]
_FEW = _KEYS[:14]  # with pages of 4: pages fill, and dropped keys come back, often


def _sequences(keys: list[str]) -> st.SearchStrategy:
    """A first set (duplicates too), then writes: add or drop a key, each on the newest version or,
    now and then, on an older one (a branch: both successors share that version's pages and index)."""
    writes = st.lists(st.tuples(st.sampled_from(["add", "add", "drop"]), st.sampled_from(keys),
                                st.one_of(st.just(0), st.just(0), st.just(0), st.integers(1, 30))),
                      max_size=300)
    return st.tuples(st.lists(st.sampled_from(keys), max_size=len(keys)), writes)


def _assert_reads_as(keys: MemberKeys, model: dict[str, None], domain: list[str]) -> None:
    assert list(keys) == list(model) and list(keys.items()) == list(model.items())
    assert len(keys) == len(model) and bool(keys) == bool(model) and keys == model
    for key in domain:
        assert (key in keys) == (key in model) and keys.get(key, "absent") == model.get(key, "absent")
        if key not in model:
            with pytest.raises(KeyError):
                keys[key]


def _check_against_a_dict(first: list[str], writes: list[tuple[str, str, int]], domain: list[str]) -> None:
    versions = [(MemberKeys(first), dict.fromkeys(first))]
    for action, key, back in writes:
        keys, model = versions[max(0, len(versions) - 1 - back)]
        model = dict(model)
        if action == "add":
            keys = keys.with_key(key)
            model[key] = None  # a dict keeps a key's place, or puts a new one (or one dropped) last
        else:
            keys = keys.without_key(key)
            model.pop(key, None)
        versions.append((keys, model))
    for keys, model in versions:  # every version, old ones too: no later write changed one
        _assert_reads_as(keys, model, domain)


@settings(max_examples=300, deadline=None)
@given(_sequences(_KEYS))
def test_member_keys_read_as_the_ordered_dict_the_same_writes_make(sequence):
    _check_against_a_dict(*sequence, _KEYS)


@settings(max_examples=300, deadline=None)
@given(_sequences(_FEW))
def test_with_small_pages_too(sequence):
    with mock.patch.object(members, "PAGE", 4):  # the same code, with many pages of a few keys
        _check_against_a_dict(*sequence, _KEYS)


def test_a_key_dropped_and_added_again_goes_last_and_only_then_is_found():
    keys = MemberKeys(_KEYS[: PAGE + 3])
    dropped = keys.without_key(_KEYS[5])
    assert _KEYS[5] not in dropped and dropped.get(_KEYS[5]) is None and len(dropped) == PAGE + 2
    again = dropped.with_key(_KEYS[5])
    assert list(again) == _KEYS[:5] + _KEYS[6: PAGE + 3] + [_KEYS[5]]
    assert list(keys) == _KEYS[: PAGE + 3] and _KEYS[5] not in dropped  # neither predecessor changed


def test_an_add_or_a_drop_copies_one_page_and_shares_the_index():
    keys = MemberKeys(_KEYS[: 2 * PAGE + 1])  # three pages, the last with one key
    added = keys.with_key("trainer/t")
    dropped = keys.without_key(_KEYS[PAGE])
    assert [a is b for a, b in zip(keys._pages, added._pages)] == [True, True, False]
    assert [a is b for a, b in zip(keys._pages, dropped._pages)] == [True, False, True]
    assert added._page_of is keys._page_of and dropped._page_of is keys._page_of
    assert keys.with_key(_KEYS[0]) is keys and keys.without_key("trainer/t") is keys
    assert "trainer/t" not in keys and "trainer/t" in added and _KEYS[PAGE] not in dropped
    empty = MemberKeys()  # one empty set is every round's default: what is built on it shares nothing
    assert empty.with_key("trainer/t")._page_of is not empty._page_of and not empty._page_of
