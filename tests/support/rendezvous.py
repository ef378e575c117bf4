"""A `RendezvousReady` with its group, as plain data for a child process (a test's explorer).

Since schema 5 a decision names its group instead of listing it, and a real explorer binds it to
the group its job view folded; a test that hands decisions to child processes sends the group
along and binds it the same way (`RendezvousReady.bound`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from rolectl.sync_protocol import RankAssignment, RendezvousReady, from_plain, to_plain

__all__ = ["rendezvous_to_plain", "rendezvous_from_plain"]


def rendezvous_to_plain(ready: RendezvousReady) -> dict[str, Any]:
    return {"decision": to_plain(ready), "group": msgspec.to_builtins(ready.participants)}


def rendezvous_from_plain(data: dict[str, Any]) -> RendezvousReady:
    ready = from_plain(data["decision"])
    assert isinstance(ready, RendezvousReady)
    return ready.bound(msgspec.convert(data["group"], tuple[RankAssignment, ...]))
