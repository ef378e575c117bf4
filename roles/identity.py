"""One live process per member: a start claims its member's next incarnation from the job's record,
with a compare-and-set on the member's join subject, and refuses to start when another one holds it.

An incarnation numbers the starts of one member (role and id). It used to be the start time in
milliseconds: two starts in the same millisecond got the same one (both joined, each took half of
every batch), and a restart on a host whose clock runs behind looked older than the process it
replaced. Now the record assigns it: a start reads the last join on its member's subject
(`rft.<job>.evt.<role>.<id>.member_joined`) and the incarnation the fold holds for the member, and
claims one more than the highest it knows. Its join is stored only if that subject still ends
where the start read it (`Nats-Expected-Last-Subject-Sequence`), so of two starts that read the
same record exactly one joins; the other reads the winner's join and exits 2 naming it. A restart
after the previous process died takes the next number the same way, and so does a rejoin after an
expiry. Records of the old numbering (milliseconds since the epoch) are numbers like any other: the
next incarnation is one more, so an upgrade mid-job never makes a restart look older.

The join's msg id carries a token of the claiming session (`<key>#<inc>/joined.<token>`): two starts
of the same incarnation never share one, or the server would store the first and answer the second
"duplicate", and both would run as one member.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import socket
from dataclasses import dataclass, field

from rolectl.bus.connection import BusConnection
from rolectl.bus.events import Heartbeat, last_on_subject, subscribe_heartbeats
from rolectl.roles.resume import StartRefused
from rolectl.sync_protocol import (
    DecodeError,
    MemberJoined,
    MemberRef,
    Role,
    RunningStatus,
    StatusChanged,
    decode,
)

__all__ = ["Claim", "next_incarnation", "read_claim", "pid_running", "live_member_refusal",
           "refuse_if_synchronizer_live"]


def next_incarnation(*known: int | None) -> int:
    """One more than the highest incarnation the record knows for a member (1 for its first start)."""
    return 1 + max((k for k in known if k is not None), default=0)


@dataclass(frozen=True)
class Claim:
    """What a start read of its member's record: the join subject's last sequence (the guard its
    join is published with; 0 when the subject holds nothing), the incarnation it joins as, and the
    last join on the subject (who held the member before, with host and pid)."""

    guard: int
    incarnation: int
    previous: MemberJoined | None = None
    token: str = field(default_factory=lambda: secrets.token_hex(6))

    def after(self, *known: int | None) -> Claim:
        """This claim, past the `known` incarnations too (what a fold read after it holds)."""
        return dataclasses.replace(self, incarnation=max(self.incarnation, next_incarnation(*known)))

    def join_msg_id(self, ref: MemberRef) -> str:
        """The join's msg id: a retry of this very join is stored once, another start's never is."""
        return f"{ref.key}#{ref.incarnation}/joined.{self.token}"


async def read_claim(conn: BusConnection, role: Role, member_id: str, *, known: tuple[int | None, ...] = ()) -> Claim:
    """Read the last join on the member's subject and claim the incarnation after it and after
    `known` (the fold's current incarnation of the member, this process's own ones)."""
    last = await last_on_subject(conn, conn.names.event(role, member_id, MemberJoined.KIND))
    previous = _event_of(last.data if last is not None else None, MemberJoined, f"{role.value}/{member_id}")
    guard = (last.seq or 0) if last is not None else 0
    incarnation = next_incarnation(previous.member.incarnation if previous else None, *known)
    return Claim(guard=guard, incarnation=incarnation, previous=previous)


def _event_of(data: bytes | None, kind: type, key: str):
    """The event of type `kind` from member `key` that `data` holds, or None (nothing, or junk)."""
    if not data:
        return None
    try:
        event = decode(data)
    except DecodeError:
        return None
    return event if isinstance(event, kind) and event.member.key == key else None


def pid_running(pid: int) -> bool:
    """Whether a process `pid` exists on this host (one we may not signal counts as existing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def live_member_refusal(ref: MemberRef, *, job: str, joined: MemberJoined | None, host: str | None = None,
                        step: int | None = None, expiry: float, lead: str = "") -> str:
    """Why a start of `ref`'s member does not go on: incarnation `ref` of it runs (named by its join's
    host and pid), and what to do."""
    if joined is not None:
        where = f"pid {joined.pid} on host {joined.host}"
        stop = f"stop it first (Ctrl-C in its terminal, or `kill {joined.pid}` on {joined.host})"
    else:
        where, stop = f"on host {host or '?'}", "stop it first"
    if ref.role is Role.SYNCHRONIZER:
        twice = "a second one under the same id would fold and decide the job twice as one member"
        gone = (f"If its machine is gone, a start on another host waits up to {expiry} s for its heartbeat "
                "and goes on once it is silent")
    else:
        twice = "a second one would do its work twice"
        gone = (f"If it hangs or its machine is gone, a running synchronizer expires it {expiry} s after its last "
                f"heartbeat (`rolectl status --job {job}` then shows it expired) and a start resumes it")
    at = "" if step is None else f", at step {step}"
    return (f"{lead}{ref.role.value} {ref.id!r} of job {job!r} is already running ({where}, incarnation "
            f"{ref.incarnation}{at}): {twice}. To replace it, {stop} and start again: the new one resumes "
            f"where it stopped. {gone}")


async def refuse_if_synchronizer_live(conn: BusConnection, claim: Claim, *, expiry: float, log) -> None:
    """Raise `StartRefused` when the synchronizer replica `claim.previous` names still runs.

    A synchronizer has no fold of its own yet when it starts, and no peer may be there to expire a
    dead one, so the evidence is its own: a final STOPPED recorded after that join (a clean stop);
    on this host, whether its pid runs; on another, its heartbeat, listened for up to `expiry` s."""
    previous = claim.previous
    if previous is None:
        return
    ref = previous.member
    status = await last_on_subject(conn, conn.names.event(ref.role, ref.id, StatusChanged.KIND))
    stopped = _event_of(status.data if status is not None else None, StatusChanged, ref.key)
    if stopped is not None and stopped.member == ref and stopped.status is RunningStatus.STOPPED:
        return
    if previous.host == socket.gethostname():
        if not pid_running(previous.pid):
            log.info("previous_process_gone", incarnation=ref.incarnation, pid=previous.pid)
            return
    elif not await _heard_from(conn, ref, within=expiry):
        log.info("previous_process_silent", incarnation=ref.incarnation, host=previous.host, waited_s=expiry)
        return
    raise StartRefused(live_member_refusal(ref, job=conn.names.job, joined=previous, expiry=expiry))


async def _heard_from(conn: BusConnection, ref: MemberRef, *, within: float) -> bool:
    """Whether a heartbeat of incarnation `ref` arrives within `within` seconds."""
    heard = asyncio.get_running_loop().create_future()

    def on_beat(beat: Heartbeat) -> None:
        if beat.member == ref and not heard.done():
            heard.set_result(True)

    async with await subscribe_heartbeats(conn, on_beat):
        try:
            return await asyncio.wait_for(heard, within)
        except asyncio.TimeoutError:
            return False
