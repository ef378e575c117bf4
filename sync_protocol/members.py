"""The members of a `State`: an immutable mapping, in join order, that a fold updates cheaply.

A fold writes at least one member per input (its sender's last sequence, status, step...). With a
plain dict, every input copied the whole map: a thousand-member job copied a thousand entries per
record, and every member folds every record. `MemberMap` keeps its members in pages of `PAGE` (join
order across pages), so a successor with a few members changed shares every page but theirs:
`with_changes` copies the touched pages and a tuple of page references, and the key index only when
a member joins. Reads are those of a dict; nothing ever changes a `MemberMap` once built.

`MemberKeys` is the same idea for the key sets of an open round (who waits, who takes part, who
reported): an immutable ordered set whose successors share an append-only log of changes.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Collection, ItemsView, Iterable, Iterator, Mapping, ValuesView
from itertools import chain
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .state import MemberState

__all__ = ["MemberMap", "MemberKeys", "PAGE"]

PAGE = 64
"""Members a page: a write copies one page (and the tuple of N/64 page references)."""


class MemberMap(Mapping[str, "MemberState"]):
    """`role/id` -> `MemberState`, in the order members first joined (like a dict's insertion order)."""

    __slots__ = ("_pages", "_page_of")

    def __init__(self, items: Mapping[str, MemberState] | Iterable[tuple[str, MemberState]] = ()):
        pairs = items.items() if isinstance(items, Mapping) else items
        pages: list[dict[str, MemberState]] = []
        page_of: dict[str, int] = {}
        for key, member in pairs:
            if key in page_of:
                pages[page_of[key]][key] = member
                continue
            if not pages or len(pages[-1]) >= PAGE:
                pages.append({})
            pages[-1][key] = member
            page_of[key] = len(pages) - 1
        self._pages: tuple[dict[str, MemberState], ...] = tuple(pages)
        self._page_of: dict[str, int] = page_of

    def with_changes(self, changes: Mapping[str, MemberState]) -> MemberMap:
        """A successor with `changes` applied: members already here keep their place, new ones
        are appended in the order given."""
        if not changes:
            return self
        pages = list(self._pages)
        page_of = self._page_of
        copied: set[int] = set()
        for key, member in changes.items():
            index = page_of.get(key)
            if index is None:
                if page_of is self._page_of:
                    page_of = dict(page_of)  # a member joined: the index is copied, once
                if not pages or len(pages[-1]) >= PAGE:
                    pages.append({})
                index = page_of[key] = len(pages) - 1
            if index not in copied and index < len(self._pages):
                pages[index] = dict(pages[index])
            copied.add(index)
            pages[index][key] = member
        successor = MemberMap.__new__(MemberMap)
        successor._pages, successor._page_of = tuple(pages), page_of
        return successor

    def __getitem__(self, key: str) -> MemberState:
        return self._pages[self._page_of[key]][key]

    def get(self, key: str, default: MemberState | None = None) -> MemberState | None:  # type: ignore[override]
        index = self._page_of.get(key)
        return default if index is None else self._pages[index][key]

    def __contains__(self, key: object) -> bool:
        return key in self._page_of

    def __iter__(self) -> Iterator[str]:
        return chain.from_iterable(self._pages)

    def __len__(self) -> int:
        return len(self._page_of)

    def values(self) -> ValuesView[MemberState]:
        return _Values(self)

    def items(self) -> ItemsView[str, MemberState]:
        return _Items(self)

    def __repr__(self) -> str:
        return f"MemberMap({dict(self)!r})"


class _Values(ValuesView["MemberState"]):
    _mapping: MemberMap

    def __iter__(self) -> Iterator[MemberState]:
        return chain.from_iterable(page.values() for page in self._mapping._pages)


class _Items(ItemsView[str, "MemberState"]):
    _mapping: MemberMap

    def __iter__(self) -> Iterator[tuple[str, MemberState]]:
        return chain.from_iterable(page.items() for page in self._mapping._pages)


class _KeyLog:
    """The changes a family of `MemberKeys` shares, in order: change `i` is `(key, added)`;
    `changes_of[key]` lists the positions of the key's changes, ascending."""

    __slots__ = ("changes", "changes_of")

    def __init__(self, keys: Iterable[str]):
        self.changes: list[tuple[str, bool]] = [(key, True) for key in dict.fromkeys(keys)]
        self.changes_of: dict[str, list[int]] = {key: [at] for at, (key, _) in enumerate(self.changes)}


class MemberKeys(Collection[str]):
    """Member keys in the order they came (one added again goes last): an immutable ordered set
    whose `with_key` and `without` cost O(1), not a copy of the set.

    A rendezvous round adds a key to `waiting` at every arrival, and at every report adds one to
    `reported` and drops one from `waiting`: copying the set each time made the fold of a round
    O(N^2) (4,096 explorers: about half of its time). A set here is a shared `_KeyLog` and how many
    of its changes it has seen: changing the newest set of a family appends one change to the log;
    changing an older one (a state kept and folded on again) first copies its keys into a log of
    its own. Whether a key is in costs a dict lookup and a look at the key's (few) changes."""

    __slots__ = ("_log", "_seen", "_len")

    def __init__(self, keys: Iterable[str] = ()):
        self._log = _KeyLog(keys)
        self._seen = self._len = len(self._log.changes)

    def __contains__(self, key: object) -> bool:
        changes = self._log.changes_of.get(key) if isinstance(key, str) else None
        if changes is None:
            return False
        last = bisect_right(changes, self._seen - 1) - 1  # the key's last change this set has seen
        return last >= 0 and self._log.changes[changes[last]][1]

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[str]:
        changes, changes_of, seen = self._log.changes, self._log.changes_of, self._seen
        for at in range(seen):
            key, added = changes[at]
            if added:
                of_key = changes_of[key]
                later = bisect_right(of_key, at)  # the key's next change, if this set has seen one
                if later == len(of_key) or of_key[later] >= seen:
                    yield key

    def with_key(self, key: str) -> MemberKeys:
        """This set and `key` (last, unless it is in already)."""
        return self if key in self else self._change(key, added=True)

    def without(self, key: str) -> MemberKeys:
        """This set less `key` (itself when `key` is not in)."""
        return self._change(key, added=False) if key in self else self

    def _change(self, key: str, *, added: bool) -> MemberKeys:
        log, at = self._log, self._seen
        if len(log.changes) == at:  # the newest set of its family: one more change in the log
            change = (key, added)
            log.changes.append(change)
            # appended where we looked, not after a change another thread appended meanwhile (which
            # then owns this family's log: we take one of our own below)
            if log.changes[at] is change:
                log.changes_of.setdefault(key, []).append(at)
                successor = MemberKeys.__new__(MemberKeys)
                successor._log, successor._seen = log, at + 1
                successor._len = self._len + (1 if added else -1)
                return successor
        keys = list(self)
        return MemberKeys([*keys, key] if added else [k for k in keys if k != key])

    def __eq__(self, other: object) -> bool:
        # like the read-only dicts these were: the same keys, whatever their order
        if not isinstance(other, MemberKeys):
            return NotImplemented
        return self._len == other._len and all(key in other for key in self)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"MemberKeys({list(self)!r})"
