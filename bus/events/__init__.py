"""Events on the bus: members publish inputs, the synchronizer publishes decisions, anyone reads them back.

- `EventPublisher` puts a member's input events into the job's event stream with a deterministic
  `Nats-Msg-Id` (`<role>/<id>#<incarnation>/<counter>`), so a publish retried after a lost ack or a
  reconnect is stored once. A member's join is also guarded by its subject's last sequence
  (`expected_last_subject_seq`): two processes claiming the same incarnation, one is stored.
- `DecisionPublisher` appends decisions to the decision log `rft.<job>.sync.log` with a
  deterministic msg id *and* `Nats-Expected-Last-Subject-Sequence`: two synchronizer replicas racing
  produce one sequence of decisions; the loser's publish is refused and it reads what the winner
  recorded. Whatever was decided while the previous append was being stored goes as one message (a
  decision batch, `sync_protocol.encode_decisions`, rounds mixed): one guard, one ack.
- Heartbeats are core NATS, not stream messages: liveness is noise as history. The synchronizer
  turns a silence into a `MemberExpired` *event*, which is what replay sees.
- `read_events()` yields `Recorded(seq, time_ms, event)` in stream order from a sequence or a time
  (each decision of a batch as its own record, all with the batch's sequence),
  optionally stopping at the end that existed when reading began. It is an "ordered consumer" built
  on an ephemeral pull consumer with one pull request kept outstanding (records flow as the server
  stores them, no request per record): any gap in delivery (a lost pull response, a server restart
  that took the in-memory consumer with it) re-creates the consumer just after the last sequence seen.
- **Verified identity.** A record counts only if its subject says what its payload says: an input
  event on `rft.<job>.evt.<role>.<member>.<kind>` must name that role, member and kind; a decision
  must be on the decision log (or, recorded by an older build, on `rft.<job>.sync.<its round>`).
  The reader rejects anything else before it reaches a fold (`identity_problem`), counts it
  (`reader.rejected`) and logs it at a bounded rate; the same
  holds for a heartbeat whose payload names another member than its subject. With per-member
  publish permissions on the server (`rolectl auth init`), the subject is the credential, so a
  member cannot speak for another.
"""

from __future__ import annotations

from ..subjects import identity_problem
from .heartbeats import (
    HEARTBEAT_SCHEMA,
    Heartbeat,
    HeartbeatSubscription,
    decode_heartbeat,
    encode_heartbeat,
    publish_heartbeat,
    subscribe_heartbeats,
)
from .publishers import DecisionPublisher, EventPublisher, decision_msg_id, last_on_subject
from .reader import EventReader, last_sequence, read_all, read_events

__all__ = [
    "EventPublisher",
    "DecisionPublisher",
    "Heartbeat",
    "HeartbeatSubscription",
    "publish_heartbeat",
    "subscribe_heartbeats",
    "encode_heartbeat",
    "decode_heartbeat",
    "EventReader",
    "read_all",
    "read_events",
    "last_sequence",
    "decision_msg_id",
    "last_on_subject",
    "identity_problem",
    "HEARTBEAT_SCHEMA",
]
