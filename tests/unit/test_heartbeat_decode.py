"""Heartbeats decode in one msgspec call when well formed, and exactly as before otherwise."""

from __future__ import annotations

import msgpack
import pytest

from rolectl.bus.events.heartbeats import Heartbeat, _decode_slowly, decode_heartbeat, encode_heartbeat
from rolectl.sync_protocol import DecodeError, MemberRef, Role, RunningStatus

HB = Heartbeat(member=MemberRef(role=Role.EXPLORER, id="explorer-0001", incarnation=17), step=3, version=-1,
               status=RunningStatus.REQUIRE_SYNC, host="gpu-7")
PLAIN = msgpack.unpackb(encode_heartbeat(HB))


@pytest.mark.parametrize("change", [
    {},
    {"status": "REQUIRE_SYNC"},  # a status spelled otherwise: parsed as it always was
    {"extra": 1},  # an unknown key is ignored, as it always was
    {"schema": 0},
    {"member": {**PLAIN["member"], "extra": True}},
])
def test_what_decodes_decodes_to_the_same_heartbeat_on_both_paths(change):
    payload = msgpack.packb({**PLAIN, **change})
    assert decode_heartbeat(payload) == _decode_slowly(payload)
    assert decode_heartbeat(payload).member == HB.member


@pytest.mark.parametrize("change, complaint", [
    ({"schema": 2}, "newer than this build"),
    ({"step": True}, "'step' must be an integer"),
    ({"status": "sleeping"}, "not a RunningStatus"),
    ({"host": 7}, "'host' must be a string"),
    ({"member": {"role": "explorer", "id": "e"}}, "inc"),
])
def test_what_does_not_decode_is_refused_with_the_reason_it_always_had(change, complaint):
    with pytest.raises(DecodeError, match=complaint):
        decode_heartbeat(msgpack.packb({**PLAIN, **change}))


def test_bytes_that_are_not_a_heartbeat_are_a_decode_error():
    for payload in (b"\xc1", msgpack.packb([1, 2]), b""):
        with pytest.raises(DecodeError):
            decode_heartbeat(payload)
