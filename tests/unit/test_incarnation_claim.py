"""The incarnation a start claims (roles.identity): one more than the highest the record knows, with no
clock in it, whatever numbering the record was written with."""

from __future__ import annotations

from rolectl.roles.identity import Claim, next_incarnation
from rolectl.sync_protocol import MemberRef, Recorded, Role
from rolectl.sync_protocol.events import MemberJoined
from rolectl.sync_protocol.reducer import reduce_lenient
from rolectl.sync_protocol.state import State

OLD_NUMBERING = 1_764_000_000_000  # an incarnation the old builds wrote: milliseconds since the epoch


def test_the_first_start_of_a_member_is_incarnation_1_and_each_next_one_more():
    assert next_incarnation() == 1
    assert next_incarnation(None, None) == 1
    assert next_incarnation(1) == 2
    assert next_incarnation(3, None, 7, 5) == 8


def test_a_claim_read_before_the_fold_goes_past_what_the_fold_holds_and_never_back():
    claim = Claim(guard=12, incarnation=4)
    assert claim.after(9).incarnation == 10
    assert claim.after(2, None).incarnation == 4  # never lower than what the subject said
    assert claim.after(9).guard == 12 and claim.after(9).token == claim.token


def test_two_claims_of_one_incarnation_never_share_a_join_msg_id():
    ref = MemberRef(role=Role.TRAINER, id="trainer", incarnation=5)
    first, second = Claim(guard=3, incarnation=5), Claim(guard=3, incarnation=5)
    assert first.join_msg_id(ref) != second.join_msg_id(ref)
    assert first.join_msg_id(ref) == first.join_msg_id(ref)  # a retry of one join is the same message
    assert first.join_msg_id(ref).startswith("trainer/trainer#5/")


def test_after_a_record_of_the_old_numbering_the_next_start_is_newer_to_the_fold():
    """An upgrade mid-job: the live incarnation is a millisecond timestamp; the restart's is one more,
    and the reducer takes it as the restart it is (the old one leaves, the new one is alive)."""
    old = MemberRef(role=Role.TRAINER, id="trainer", incarnation=OLD_NUMBERING)
    new = MemberRef(role=Role.TRAINER, id="trainer", incarnation=next_incarnation(OLD_NUMBERING))
    state = State.initial()
    for seq, ref in enumerate((old, new), start=1):
        joined = MemberJoined(member=ref, host="h", pid=seq, step=0, version=0)
        state, _, error = reduce_lenient(state, Recorded(seq=seq, time_ms=seq, event=joined))
        assert error is None, error
    member = state.members["trainer/trainer"]
    assert member.ref == new and member.alive
    assert new.incarnation == OLD_NUMBERING + 1
