"""The members of a `State`: an immutable mapping, in join order, that a fold updates cheaply.

A fold writes at least one member per input (its sender's last sequence, status, step...). With a
plain dict, every input copied the whole map: a thousand-member job copied a thousand entries per
record, and every member folds every record. `MemberMap` keeps its members in pages of `PAGE` (join
order across pages), so a successor with a few members changed shares every page but theirs:
`with_changes` copies the touched pages and a tuple of page references, and the key index only when
a member joins. Reads are those of a dict; nothing ever changes a `MemberMap` once built.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterable, Iterator, Mapping, ValuesView
from itertools import chain
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .state import MemberState

__all__ = ["MemberMap", "PAGE"]

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
