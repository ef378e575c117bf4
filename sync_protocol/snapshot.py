"""Reducer snapshots: a `State` as msgpack bytes and back, so a fold can start from one; and a
rendezvous group's rank assignments, for members that do not fold every explorer.

A snapshot at `state.last_seq = S` plus the stream's records after S folds to exactly the state a
fold from the first record reaches (a test checks it on generated streams). Restarted
synchronizers, members' job views and `rolectl replay` start from the newest snapshot, which keeps
restarts fast on long runs and lets the event stream be trimmed by age or size.

Pure: bytes in, state out (or `DecodeError`); no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import msgspec

from .config import SyncConfig
from .enums import RunningStatus, SyncMethod
from .errors import ConfigError, DecodeError
from .events import MemberRef, RankAssignment
from .members import MemberMap
from .state import GroupState, LatestVersion, MemberState, RoundPhase, RoundState, State, member_keys

__all__ = ["SNAPSHOT_SCHEMA", "GROUP_SCHEMA", "encode_state", "decode_state", "encode_group", "decode_group"]

SNAPSHOT_SCHEMA = 1
GROUP_SCHEMA = 1


def _ref(ref: MemberRef) -> list[Any]:
    return [ref.role.value, ref.id, ref.incarnation]


def _unref(value: Any) -> MemberRef:
    role, member_id, incarnation = value  # checked as a member map on the wire is
    return msgspec.convert({"role": role, "id": member_id, "inc": incarnation}, MemberRef)


def encode_state(state: State, *, extra: Mapping[str, Any] | None = None) -> bytes:
    """The state as bytes; `extra` (plain values) travels along, e.g. the shell's own bookkeeping."""
    members = []
    for m in state.members.values():
        members.append([_ref(m.ref), m.status.value, m.step, m.version, m.ranks, m.host, m.alive,
                        m.joined_seq, m.last_seq, m.last_time_ms, m.rendezvous, dict(m.metrics), m.finished])
    rounds = []
    for r in state.rounds.values():
        rounds.append([r.id, r.method.value, _ref(r.opened_by), r.opened_at_ms, r.opened_seq,
                       list(r.waiting), list(r.participants), r.phase.value, r.version, r.epoch,
                       list(r.reported)])
    latest = state.latest
    data = {
        "schema": SNAPSHOT_SCHEMA,
        "config": state.config.to_mapping() if state.config is not None else None,
        "members": members,
        "latest": [latest.version, latest.step, latest.method.value if latest.method else None,
                   latest.location, latest.digest, latest.nbytes],
        "rounds": rounds,
        "next_round": state.next_round,
        "group": [state.group.epoch, [[_ref(a.member), a.rank_offset, a.ranks] for a in state.group.members],
                  state.group.broken],
        "last_seq": state.last_seq,
        "trainer": state.trainer,
        "counts": [state.rounds_closed, state.syncs_completed, state.versions_published],
        "extra": dict(extra or {}),
    }
    return msgspec.msgpack.encode(data)


def decode_state(payload: bytes) -> tuple[State, dict[str, Any]]:
    """`(state, extra)` from `encode_state` bytes, or `DecodeError` saying what is wrong."""
    try:
        data = msgspec.msgpack.decode(payload)
    except Exception as exc:  # msgspec.DecodeError mostly; anything here means "not msgpack"
        raise DecodeError(f"snapshot is not msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise DecodeError(f"snapshot must be a map, got {type(data).__name__}")
    schema = data.get("schema")
    if schema != SNAPSHOT_SCHEMA:
        raise DecodeError(f"snapshot schema {schema!r} is not {SNAPSHOT_SCHEMA}: written by another "
                          "rolectl version; fold from the stream instead")
    try:
        return _build(data), dict(data.get("extra") or {})
    except (KeyError, TypeError, ValueError, ConfigError) as exc:
        raise DecodeError(f"snapshot is malformed ({type(exc).__name__}: {exc})") from None


def _build(data: dict[str, Any]) -> State:
    members: dict[str, MemberState] = {}
    for (ref, status, step, version, ranks, host, alive, joined_seq, last_seq, last_time_ms, rendezvous,
         metrics, finished) in data["members"]:
        member = MemberState(ref=_unref(ref), status=RunningStatus(status), step=step, version=version,
                             ranks=ranks, host=host, alive=alive, joined_seq=joined_seq, last_seq=last_seq,
                             last_time_ms=last_time_ms, rendezvous=rendezvous,
                             metrics=MappingProxyType(dict(metrics)), finished=finished)
        members[member.ref.key] = member
    rounds: dict[int, RoundState] = {}
    for (rid, method, opened_by, opened_at_ms, opened_seq, waiting, participants, phase, version, epoch,
         reported) in data["rounds"]:
        rounds[rid] = RoundState(id=rid, method=SyncMethod(method), opened_by=_unref(opened_by),
                                 opened_at_ms=opened_at_ms, opened_seq=opened_seq, waiting=member_keys(waiting),
                                 participants=member_keys(participants), phase=RoundPhase(phase), version=version,
                                 epoch=epoch, reported=member_keys(reported))
    version, step, method, location, digest, nbytes = data["latest"]
    epoch, group_members, broken = data["group"]
    rounds_closed, syncs_completed, versions_published = data["counts"]
    config = data["config"]
    return State(
        config=SyncConfig.from_mapping(config, where="snapshot.config") if config is not None else None,
        members=MemberMap(members),
        latest=LatestVersion(version=version, step=step, method=SyncMethod(method) if method else None,
                             location=location, digest=digest, nbytes=nbytes),
        rounds=MappingProxyType(rounds),
        next_round=data["next_round"],
        group=GroupState(epoch=epoch, members=tuple(
            RankAssignment(member=_unref(ref), rank_offset=offset, ranks=ranks)
            for ref, offset, ranks in group_members), broken=broken),
        last_seq=data["last_seq"],
        trainer=data["trainer"],
        rounds_closed=rounds_closed,
        syncs_completed=syncs_completed,
        versions_published=versions_published,
    )


def encode_group(epoch: int, participants: tuple[RankAssignment, ...]) -> bytes:
    """The explorers' rank assignments of group `epoch` (a `RendezvousReady`'s `participants`)."""
    return msgspec.msgpack.encode({"schema": GROUP_SCHEMA, "epoch": epoch,
                                   "members": [[_ref(a.member), a.rank_offset, a.ranks] for a in participants]})


def decode_group(payload: bytes) -> tuple[int, tuple[RankAssignment, ...]]:
    """`(epoch, participants)` from `encode_group` bytes, or `DecodeError` saying what is wrong."""
    try:
        data = msgspec.msgpack.decode(payload)
        if not isinstance(data, dict) or data.get("schema") != GROUP_SCHEMA:
            raise DecodeError(f"a group record must be a map of schema {GROUP_SCHEMA}")
        return data["epoch"], tuple(RankAssignment(member=_unref(ref), rank_offset=offset, ranks=ranks)
                                    for ref, offset, ranks in data["members"])
    except DecodeError:
        raise
    except Exception as exc:  # not msgpack, or rows of the wrong shape
        raise DecodeError(f"group record is malformed ({type(exc).__name__}: {exc})") from None
