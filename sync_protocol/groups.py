"""Readers of a recorded stream: each `RendezvousReady` bound to the group it names, as a member's
view binds it while it reads.

Since schema 5 a rendezvous decision names its group (epoch, count, digest) instead of listing it;
the group is `State.group`, folded from the inputs before the decision. `GroupBinder` folds the
inputs it is given (illegal ones skipped, as live) and binds each rendezvous decision to the group
of the state before it; everything else passes through unchanged. Pure: records in, records out.
"""

from __future__ import annotations

from collections.abc import Iterable

from .events import Event, Recorded, RendezvousReady
from .reducer import reduce_lenient
from .state import State

__all__ = ["GroupBinder", "bind_groups"]


class GroupBinder:
    """Call it on each record of a stream, in order; it returns the record to keep."""

    def __init__(self, state: State | None = None):
        self.state = State.initial() if state is None else state

    def __call__(self, rec: Recorded) -> Recorded:
        event = rec.event
        if isinstance(event, RendezvousReady):
            bound = self.state.group.bind(event)
            if bound is not event:
                return Recorded(seq=rec.seq, time_ms=rec.time_ms, event=bound, subject=rec.subject)
        elif isinstance(event, Event):
            self.state, _, _ = reduce_lenient(self.state, rec)
        return rec


def bind_groups(records: Iterable[Recorded], state: State | None = None) -> list[Recorded]:
    """`records` with every rendezvous decision bound to its group (see the module docstring);
    `state`: where the records start (a snapshot's), if not at the stream's first."""
    binder = GroupBinder(state)
    return [binder(rec) for rec in records]
