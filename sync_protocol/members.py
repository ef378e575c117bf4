"""Immutable ordered maps that a fold updates cheaply: a `State`'s members and a round's member keys.

A fold writes at least one member per input (its sender's last sequence, status, step...), and a
rendezvous round adds or drops one key per request and report. With plain dicts, every input copied
the whole map: a thousand-member job copied a thousand entries per record, and a round of N
explorers O(N) per arrival, O(N^2) per round. A `PagedMap` keeps its keys in pages of `PAGE`
(insertion order across pages), so a successor with a few keys written shares every page but
theirs: it copies the touched pages and a tuple of page references. Reads are those of a dict;
nothing a reader can see ever changes once built.

`MemberMap` is `role/id` -> `MemberState`; `MemberKeys` an ordered set of keys (values `None`,
read like the dict `dict.fromkeys` makes) that also drops keys.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterable, Iterator, Mapping, ValuesView
from itertools import chain
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from .state import MemberState

__all__ = ["PagedMap", "MemberMap", "MemberKeys", "PAGE"]

PAGE = 64
"""Keys a page: a write copies one page (and the tuple of N/64 page references)."""

V = TypeVar("V")
Paged = TypeVar("Paged", bound="PagedMap[Any]")


class PagedMap(Mapping[str, V]):
    """`str` -> `V` in the order keys were added (a dict's insertion order), stored in pages.

    A new key goes on the last page (a new page when that one is full), so iterating the pages in
    order gives the keys in the order they came; a key written again keeps its place, one dropped
    leaves its page, and one dropped then added again goes last, as in a dict.

    `_page_of` names the page each key was put on. It only grows, and a map and its successors
    share it: a key is here when the page named holds it, since the index also names keys a
    successor put and keys this map dropped. So adding or dropping a key copies no index; it is
    copied only when the key was put on another page by some version (dropped and added again
    after the last page filled, or added on two branches): rare.
    """

    __slots__ = ("_pages", "_page_of", "_len")

    def __init__(self, items: Mapping[str, V] | Iterable[tuple[str, V]] = ()):
        self._fill(dict(items))  # a key given twice keeps its first place and last value, as in a dict

    def _fill(self, entries: dict[str, V]) -> None:
        """Pages of `entries` (a dict no one else holds), in its order."""
        if len(entries) <= PAGE:  # most rounds' sets: the dict is the one page
            self._pages: tuple[dict[str, V], ...] = (entries,) if entries else ()
            self._page_of: dict[str, int] = dict.fromkeys(entries, 0)
        else:
            keys = list(entries)
            self._pages = tuple({key: entries[key] for key in keys[start:start + PAGE]}
                                for start in range(0, len(keys), PAGE))
            self._page_of = {key: at // PAGE for at, key in enumerate(keys)}
        self._len = len(entries)

    def _with_entry(self: Paged, key: str, value: Any) -> Paged:
        """A successor with `key` -> `value`: in its place when here, else last. It copies the page
        written and the tuple of page references (this map itself when nothing changes)."""
        pages, page_of, size = self._pages, self._page_of, self._len
        at = page_of.get(key)
        if at is None or at >= len(pages) or key not in pages[at]:  # not in this map: it goes last
            if not pages:
                page_of = {}  # a map with no pages shares nothing: a fresh index
            if not pages or len(pages[-1]) >= PAGE:
                pages += ({},)
            at = len(pages) - 1
            # setdefault is one step: two successors of one map built at once (two threads) cannot
            # both place the key, on different pages
            if page_of.setdefault(key, at) != at:  # some version put it on another page: rare
                page_of = dict(page_of)
                page_of[key] = at
            size += 1
        elif pages[at][key] is value:
            return self
        page = dict(pages[at])
        page[key] = value
        successor = object.__new__(type(self))
        successor._pages = pages[:at] + (page,) + pages[at + 1:]
        successor._page_of, successor._len = page_of, size
        return successor

    def _without_entry(self: Paged, key: str) -> Paged:
        """A successor without `key`, the others in their order (this map when it is not here)."""
        if key not in self:
            return self
        at = self._page_of[key]
        page = dict(self._pages[at])
        del page[key]  # the index keeps naming the page: the page says the key is gone
        successor = object.__new__(type(self))
        successor._pages = self._pages[:at] + (page,) + self._pages[at + 1:]
        successor._page_of, successor._len = self._page_of, self._len - 1
        return successor

    def __getitem__(self, key: str) -> V:
        try:
            return self._pages[self._page_of[key]][key]
        except IndexError:  # on a page a successor added
            raise KeyError(key) from None

    def get(self, key: str, default: V | None = None) -> V | None:  # type: ignore[override]
        at = self._page_of.get(key)
        if at is None:
            return default
        try:
            return self._pages[at].get(key, default)
        except IndexError:  # on a page a successor added
            return default

    def __contains__(self, key: object) -> bool:
        at = self._page_of.get(key)  # type: ignore[call-overload]
        # the page named must hold it: the shared index also names keys a successor put or this map dropped
        return at is not None and at < len(self._pages) and key in self._pages[at]

    def __iter__(self) -> Iterator[str]:
        return chain.from_iterable(self._pages)

    def __len__(self) -> int:
        return self._len

    def values(self) -> ValuesView[V]:
        return _Values(self)

    def items(self) -> ItemsView[str, V]:
        return _Items(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self)!r})"


class _Values(ValuesView[V]):
    _mapping: PagedMap[V]

    def __iter__(self) -> Iterator[V]:
        return chain.from_iterable(page.values() for page in self._mapping._pages)


class _Items(ItemsView[str, V]):
    _mapping: PagedMap[V]

    def __iter__(self) -> Iterator[tuple[str, V]]:
        return chain.from_iterable(page.items() for page in self._mapping._pages)


class MemberMap(PagedMap["MemberState"]):
    """`role/id` -> `MemberState`, in the order members first joined (like a dict's insertion order)."""

    __slots__ = ()

    def with_changes(self, changes: Mapping[str, MemberState]) -> MemberMap:
        """A successor with `changes` applied: members already here keep their place, new ones
        are appended in the order given."""
        successor = self
        for key, member in changes.items():
            successor = successor._with_entry(key, member)
        return successor


class MemberKeys(PagedMap[None]):
    """Member keys in the order they came, as a read-only `dict.fromkeys`: whether one is there
    costs one lookup, not a scan, and adding or dropping one copies a page, not the set. The order
    is the one a dict would keep (a key dropped and added again goes last); rendezvous ranks and
    their membership digest follow it."""

    __slots__ = ()

    def __init__(self, keys: Iterable[str] = ()):
        self._fill(dict.fromkeys(keys))

    def with_key(self, key: str) -> MemberKeys:
        """These keys and `key`, last (these when it is here already)."""
        return self._with_entry(key, None)

    def without_key(self, key: str) -> MemberKeys:
        """These keys less `key`, the others in their order (these when it is not here)."""
        return self._without_entry(key)

    def __repr__(self) -> str:
        return f"MemberKeys({list(self)!r})"
