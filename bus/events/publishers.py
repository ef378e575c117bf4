"""Publishing to the job's event stream: a member's input events, the synchronizer's decisions.

`EventPublisher` stores each event once under a deterministic `Nats-Msg-Id` (a member's join also
guarded by its subject's last sequence: of two processes claiming one incarnation, one is stored);
`DecisionPublisher` appends decision batches to the decision log guarded by the log's last
sequence, so racing replicas record one history (see the package docstring).
"""

from __future__ import annotations

from collections.abc import Sequence

import nats.errors
import nats.js.errors
from nats.js.api import RawStreamMsg

from rolectl.sync_protocol import (
    Decision,
    DecodeError,
    Event,
    MemberRef,
    decision_identity,
    decode_all,
    encode,
    encode_decisions,
)

from ..connection import BusConnection
from ..errors import DecisionSuperseded, PayloadTooLarge, PublishRejected, SubjectMoved
from ..streams import MSG_TOO_BIG, explain_refusal

__all__ = [
    "EventPublisher",
    "DecisionPublisher",
    "decision_msg_id",
    "last_on_subject",
]

_EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
# JetStream error codes that mean "another writer got to this subject first".
_WRONG_LAST_SEQUENCE = {10071, 10164}


def _wrong_last_sequence(exc: PublishRejected) -> bool:
    return exc.err_code in _WRONG_LAST_SEQUENCE or "wrong last sequence" in (exc.description or "").lower()


async def last_on_subject(conn: BusConnection, subject: str, *, retry_for: float = 30.0) -> RawStreamMsg | None:
    """The newest message on `subject` in the job's event stream (headers included), or None when
    the stream holds none there (never written, or trimmed)."""
    try:
        return await conn.retry(lambda: conn.js.get_last_msg(conn.names.event_stream, subject),
                                what=f"read the last message on {subject}", retry_for=retry_for)
    except nats.js.errors.NotFoundError:
        return None


class EventPublisher:
    """Publishes one member's input events into the job's event stream."""

    def __init__(
        self,
        conn: BusConnection,
        member: MemberRef,
        *,
        ack_timeout: float = 5.0,
        retry_for: float = 30.0,
    ):
        self.conn = conn
        self.member = member
        self.ack_timeout = ack_timeout
        self.retry_for = retry_for
        self._counter = 0

    def next_msg_id(self) -> str:
        """The msg id the next publish without an override will use (and consume)."""
        self._counter += 1
        return f"{self.member.key}#{self.member.incarnation}/{self._counter}"

    async def publish(self, event: Event, *, msg_id: str | None = None,
                      expected_last_subject_seq: int | None = None) -> int:
        """Store `event` and return its stream sequence (the original one if it was a duplicate).

        `msg_id` overrides the member counter for events whose identity is not "the n-th thing this
        member said": the synchronizer's timer events use `timeout/<round>` or `expired/<key>#<inc>`
        so every replica publishes the same fact once.

        `expected_last_subject_seq` stores the event only if its subject's last message is still at
        that sequence (0: none), else raises `SubjectMoved`: a member's join is a compare-and-set.
        A try stored before its ack was lost is found by its msg id (the server checks the guard
        before the duplicate window), and is ours.
        """
        if not isinstance(event, Event):
            raise TypeError(f"EventPublisher publishes input events, not {type(event).__name__}; "
                            "use DecisionPublisher for decisions")
        if event.member.key != self.member.key:
            raise ValueError(f"event from {event.member} given to the publisher of {self.member}: "
                             "each member publishes only its own events")
        if msg_id is None:
            msg_id = self.next_msg_id()
        subject = self.conn.names.event(self.member.role, self.member.id, event.KIND)
        payload = encode(event)
        guard = None if expected_last_subject_seq is None else {
            _EXPECTED_LAST_SUBJECT_SEQ: str(int(expected_last_subject_seq))}
        try:
            ack = await self.conn.publish_acked(
                subject, payload, msg_id=msg_id, headers=guard, ack_timeout=self.ack_timeout,
                retry_for=self.retry_for
            )
        except PublishRejected as exc:
            if guard is not None and _wrong_last_sequence(exc):
                return await self._stored_before(subject, msg_id, expected_last_subject_seq, exc)
            raise explain_refusal(exc, self.conn.names.event_stream, len(payload)) from exc
        if ack.duplicate:
            self.conn.log.debug("bus.event_duplicate", subject=subject, msg_id=msg_id, seq=ack.seq)
        return ack.seq

    async def _stored_before(self, subject: str, msg_id: str, expected: int | None, exc: PublishRejected) -> int:
        """A guarded publish was refused: the sequence of our own earlier try if that is what the
        subject ends with, else `SubjectMoved`."""
        last = await last_on_subject(self.conn, subject, retry_for=self.retry_for)
        if last is not None and last.seq and (last.headers or {}).get("Nats-Msg-Id") == msg_id:
            self.conn.log.debug("bus.event_duplicate", subject=subject, msg_id=msg_id, seq=last.seq)
            return last.seq
        raise SubjectMoved(
            f"{msg_id} not stored: {subject} does not end at seq {expected} ({exc.description})",
            subject=subject, msg_id=msg_id, code=exc.code, err_code=exc.err_code,
            description=exc.description) from exc


# --------------------------------------------------------------------------------------------------
# publishing decisions


def decision_msg_id(decisions: Decision | Sequence[Decision]) -> str:
    """`d/<round>/<kind>/<cause_seq>/<released member key or empty>`: equal for equal decisions.

    A batch (decisions in computed order) is named by its first and last decision and its length,
    `d/<first>..<n>/<last>`: replicas that batch alike send the same id (stored once); a batch that
    differs has another id, and the log's guard tells."""
    if isinstance(decisions, Decision):
        decisions = (decisions,)
    first = decision_identity(decisions[0])
    name = f"d/{first[1]}/{first[0]}/{first[2]}/{first[3]}"
    if len(decisions) > 1:
        last = decision_identity(decisions[-1])
        name += f"..{len(decisions)}/{last[1]}/{last[0]}/{last[2]}/{last[3]}"
    return name


class DecisionPublisher:
    """Appends the synchronizer's decisions to the decision log, each once even with several replicas."""

    def __init__(self, conn: BusConnection, *, ack_timeout: float = 5.0, retry_for: float = 30.0):
        self.conn = conn
        self.ack_timeout = ack_timeout
        self.retry_for = retry_for

    async def publish(self, decisions: Decision | Sequence[Decision], *,
                      expected_last_subject_seq: int | None) -> int | None:
        """Append a decision, or several as one message, to the decision log; return its
        sequence, or `None` if the stream already holds this very message.

        `expected_last_subject_seq` is the sequence of the last message on the decision log this
        replica knows of (0 for a new job); `None` skips the check. When the log holds something
        newer than expected, `DecisionSuperseded` is raised: `on_subject_after` tells what it is
        (another replica's decisions, or something else). A message over the server's
        `max_payload` or the stream's `max_msg_size` raises `PayloadTooLarge` (send fewer at once).
        """
        if isinstance(decisions, Decision):
            decisions = (decisions,)
        if not decisions or not all(isinstance(d, Decision) for d in decisions):
            kinds = ", ".join(sorted({type(d).__name__ for d in decisions})) or "nothing"
            raise TypeError(f"DecisionPublisher publishes decisions, not {kinds}; use EventPublisher for inputs")
        subject = self.conn.names.decision_log
        msg_id = decision_msg_id(decisions)
        payload = encode_decisions(decisions)
        headers = {}
        if expected_last_subject_seq is not None:
            headers[_EXPECTED_LAST_SUBJECT_SEQ] = str(int(expected_last_subject_seq))
        try:
            ack = await self.conn.publish_acked(
                subject,
                payload,
                msg_id=msg_id,
                headers=headers,
                ack_timeout=self.ack_timeout,
                retry_for=self.retry_for,
            )
        except PublishRejected as exc:
            if _wrong_last_sequence(exc):
                # The log does not end where this replica knew it did: something it did not know
                # of is there (maybe these very decisions from another replica, maybe junk), or
                # messages aged out. Only the caller can tell.
                raise DecisionSuperseded(
                    f"decision {msg_id} not stored: {subject} does not end at seq "
                    f"{expected_last_subject_seq} ({exc.description})",
                    subject=subject, msg_id=msg_id, code=exc.code, err_code=exc.err_code,
                    description=exc.description) from exc
            refusal = explain_refusal(exc, self.conn.names.event_stream, len(payload))
            if exc.err_code == MSG_TOO_BIG or "message size exceeds" in (exc.description or "").lower():
                raise PayloadTooLarge(str(refusal), subject=subject, msg_id=msg_id, size=len(payload)) from exc
            if refusal is not exc:
                raise refusal from exc
            raise
        if ack.duplicate:
            self.conn.log.info("bus.decision_duplicate", subject=subject, msg_id=msg_id, seq=ack.seq)
            return None
        return ack.seq

    async def last_on_log(self) -> int:
        """The sequence of the decision log's newest message, 0 when it holds none."""
        msg = await last_on_subject(self.conn, self.conn.names.decision_log, retry_for=self.retry_for)
        return 0 if msg is None else msg.seq or 0  # a stored message always has a sequence (>= 1)

    async def on_subject_after(self, after_seq: int, *,
                               limit: int = 64) -> list[tuple[int, tuple[Decision, ...]]]:
        """What the decision log holds after stream sequence `after_seq`, oldest first: each
        message's sequence and the decisions it holds (none for a foreign or malformed message).
        At most `limit` messages: a guard that failed is about one or two."""
        subject = self.conn.names.decision_log
        stream = self.conn.names.event_stream
        found: list[tuple[int, tuple[Decision, ...]]] = []
        seq = after_seq
        while len(found) < limit:
            after = seq
            try:
                msg = await self.conn.retry(
                    lambda: self.conn.js.get_msg(stream, seq=after + 1, subject=subject, next=True),  # noqa: B023 - awaited in this iteration
                    what=f"read {subject} after seq {after}", retry_for=self.retry_for)
            except nats.js.errors.NotFoundError:
                break
            seq = msg.seq or after + 1  # a stored message always has a sequence
            try:
                held = decode_all(msg.data or b"")
            except DecodeError:
                held = ()
            if not all(isinstance(d, Decision) for d in held):
                held = ()
            found.append((seq, held))  # type: ignore[arg-type]
        return found
