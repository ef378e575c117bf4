"""Every NATS name a job uses (subjects, streams, buckets, durable consumers), in one place."""

from __future__ import annotations

import re

from rolectl.sync_protocol import Decision, Event, Role

__all__ = [
    "check_name",
    "identity_problem",
    "JobNames",
    "subject_matches",
]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_name(value: str, what: str) -> str:
    """A job or member name must be one NATS token: letters, digits, '_' or '-' (1..64 chars)."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(
            f"invalid {what} {value!r}: use 1-64 letters, digits, '_' or '-' "
            "(it becomes part of NATS subjects and stream names)"
        )
    return value


DECISION_LOG = "log"  # the decision log's last subject token (never a round number)


class JobNames:
    """Names for one job. Subjects:

    - events      ``rft.<job>.evt.<role>.<member>.<kind>``  (in the job's event stream)
    - decisions   ``rft.<job>.sync.log``                      (in the job's event stream; builds
      before schema 4 recorded a round's decisions on ``rft.<job>.sync.<round>``, still read)
    - heartbeats  ``rft.<job>.hb.<role>.<member>``            (core NATS only: liveness, not history)
    - experiences ``rft.<job>.exp.<member>``                  (in the job's experience stream)
    - weights     ``rft.<job>.w.<version>.c.<index>`` chunks, then ``rft.<job>.w.<version>.m`` (the
      manifest, published last) in the job's weights stream
    """

    def __init__(self, job: str):
        self.job = check_name(job, "job name")
        upper = self.job.upper().replace("-", "_")
        self.prefix = f"rft.{self.job}"
        self.event_stream = f"RFT_{upper}_EVENTS"
        self.experience_stream = f"RFT_{upper}_EXP"
        self.weights_stream = f"RFT_{upper}_WEIGHTS"
        self.trainer_experience_durable = "trainer"
        # key-value buckets: the synchronizers' active/standby lease, and reducer snapshots
        self.lease_bucket = f"rft_{self.job}_lease"
        self.snapshot_bucket = f"rft_{self.job}_snapshots"

    # events -------------------------------------------------------------------------------------
    def event(self, role: Role | str, member: str, kind: str) -> str:
        return f"{self.prefix}.evt.{Role.parse(role).value}.{member}.{kind}"

    @property
    def all_events(self) -> str:
        return f"{self.prefix}.evt.>"

    @property
    def decision_log(self) -> str:
        """The one subject every decision is recorded on, in the order computed: one guard
        (`Nats-Expected-Last-Subject-Sequence`) orders all of them, so a batch may span rounds."""
        return f"{self.prefix}.sync.{DECISION_LOG}"

    def decision(self, round_id: int) -> str:
        """Where builds before schema 4 recorded round `round_id`'s decisions (read, never written)."""
        return f"{self.prefix}.sync.{round_id}"

    @property
    def all_decisions(self) -> str:
        return f"{self.prefix}.sync.>"

    def member_events(self, role: Role | str, member: str = "*") -> str:
        """Every event subject of one member (or, by default, of every member of `role`)."""
        return f"{self.prefix}.evt.{Role.parse(role).value}.{member}.>"

    def recorded_subject(self, event: Event | Decision) -> str:
        """The subject a record of `event` belongs on (an archived row of an older build has none)."""
        if isinstance(event, Decision):
            return self.decision_log
        return self.event(event.member.role, event.member.id, event.KIND)

    @property
    def event_stream_subjects(self) -> list[str]:
        return [self.all_events, self.all_decisions]

    # heartbeats ---------------------------------------------------------------------------------
    def heartbeat(self, role: Role | str, member: str) -> str:
        return f"{self.prefix}.hb.{Role.parse(role).value}.{member}"

    @property
    def all_heartbeats(self) -> str:
        return f"{self.prefix}.hb.>"

    # CUDA IPC handle requests (core NATS request/reply, trainer -> explorer) ----------------------
    def cuda_ipc(self, member: str) -> str:
        return f"{self.prefix}.ipc.{member}"

    # experiences --------------------------------------------------------------------------------
    def experiences(self, member: str) -> str:
        return f"{self.prefix}.exp.{member}"

    @property
    def all_experiences(self) -> str:
        return f"{self.prefix}.exp.>"

    # weights (object store transport) ------------------------------------------------------------
    def weights_chunk(self, version: int, index: int) -> str:
        return f"{self.prefix}.w.{int(version)}.c.{int(index)}"

    def weights_chunks(self, version: int) -> str:
        return f"{self.prefix}.w.{int(version)}.c.>"

    def weights_manifest(self, version: int) -> str:
        return f"{self.prefix}.w.{int(version)}.m"

    def weights_version(self, version: int) -> str:
        """Every subject of one version (chunks and manifest), for purging it."""
        return f"{self.prefix}.w.{int(version)}.>"

    @property
    def all_weights_manifests(self) -> str:
        return f"{self.prefix}.w.*.m"

    @property
    def all_weights_first_chunks(self) -> str:
        """Chunk 0 of every version, complete or not: finds partial uploads to clean up."""
        return f"{self.prefix}.w.*.c.0"

    @property
    def all_weights(self) -> str:
        return f"{self.prefix}.w.>"


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether NATS subject `subject` matches `pattern` (`*` one token, a final `>` one or more)."""
    wanted, tokens = pattern.split("."), subject.split(".")
    for i, token in enumerate(wanted):
        if token == ">":
            return len(tokens) > i
        if i >= len(tokens) or (token != "*" and token != tokens[i]):
            return False
    return len(tokens) == len(wanted)


def identity_problem(subject: str, event: Event | Decision) -> str | None:
    """Why `event` may not be recorded on `subject`, or None when the subject vouches for it.

    Inputs belong on `rft.<job>.evt.<role>.<member>.<kind>` naming the payload's member role, id
    and kind; decisions on the decision log `rft.<job>.sync.log`, or (recorded by a build before
    schema 4) on `rft.<job>.sync.<round>` naming the payload's round. (Job and member names are
    single NATS tokens, so splitting on dots is exact.)
    """
    tokens = subject.split(".")
    where = tokens[2] if len(tokens) > 2 and tokens[0] == "rft" else None
    if isinstance(event, Decision):
        if where != "sync":
            return f"decision {event.KIND} published on {subject}, outside the job's .sync. subjects"
        if len(tokens) != 4 or tokens[3] not in (DECISION_LOG, str(event.round)):
            return f"decision {event.KIND} for round {event.round} published on {subject}"
        return None
    if where != "evt":
        return f"input event {event.KIND} published on {subject}, not on an .evt. subject"
    if len(tokens) != 6:
        return f"input event {event.KIND} on malformed subject {subject}"
    role, member, kind = tokens[3:6]
    claimed = event.member
    if (role, member) != (claimed.role.value, claimed.id):
        return f"{event.KIND} claims to be from {claimed.key} but was published on {subject}"
    if kind != event.KIND:
        return f"{event.KIND} published on {subject}, the subject of kind {kind!r}"
    return None
