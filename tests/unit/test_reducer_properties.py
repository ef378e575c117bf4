"""Properties of the reducer over random interleavings of what a trainer and explorers can do.

A small model of the roles turns a random list of actions into a plausible stream: explorers join,
step (reporting the tasks they produced, and exploring no further while paused for running ahead
of the trainer), ask for syncs, load weights, fail, stop, restart; the trainer steps (reporting the
tasks it took), publishes, asks for a
rendezvous, answers "nothing new", broadcasts, stops, restarts; the synchronizer's clock expires
members and times rounds out. The model reads the folded state to aim its reports at real rounds,
but is sloppy on purpose (stale incarnations, repeated reports, events before joining), so the
stream also holds illegal and racy inputs. Those are folded leniently and the invariants must hold
regardless.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolectl.sync_protocol import (
    DecodeError,
    EvalFinished,
    ExplorerPaused,
    ExplorersResumed,
    JobConfigured,
    MemberExpired,
    MemberJoined,
    MemberRef,
    MemberReleased,
    NoNewVersion,
    Recorded,
    RendezvousReady,
    Role,
    RoundClosed,
    RoundOpened,
    RoundTimedOut,
    RunningStatus,
    State,
    StatusChanged,
    StepFinished,
    SyncConfig,
    SyncFailed,
    SyncMethod,
    SyncStyle,
    VersionPublished,
    WeightsBroadcast,
    WeightsLoaded,
    decision_identity,
    decode,
    encode,
    fold_lenient,
    reduce,
    reduce_lenient,
)
from rolectl.sync_protocol.snapshot import decode_state, encode_state
from rolectl.sync_protocol.state import RoundPhase

SYNC = MemberRef(role=Role.SYNCHRONIZER, id="clock", incarnation=0)
EXPLORER_IDS = ("e0", "e1", "e2")
# Weighted by repetition: mostly the ordinary flow, sometimes a failure, a departure or noise.
ACTIONS = (
    ("step", "req", "req", "load", "load", "t_step", "t_req", "t_req", "t_broadcast", "t_broadcast",
     "t_publish")
    + ("eval", "fail", "t_fail", "t_no_new", "stop", "restart", "expire", "t_stop", "t_restart", "t_expire",
       "timeout", "configure", "stale", "join", "t_join", "finish", "t_finish")
)
_LIFECYCLE = frozenset({"join", "t_join", "restart", "t_restart", "expire", "t_expire", "stale",
                        "configure", "timeout"})
UNIT = 2  # train_batch_tasks: the unit of max_ahead
MOST_PER_STEP = 2  # tasks an explorer's step produces at most


class _Model:
    """What each role would plausibly send next, given the folded state so far."""

    def __init__(self, config: SyncConfig):
        self.config = config
        self.incarnation = {key: 0 for key in ("trainer/t",) + tuple(f"explorer/{i}" for i in EXPLORER_IDS)}
        self.state = State.initial()
        self.seq = 0
        self.produced = {f"explorer/{i}": 0 for i in EXPLORER_IDS}  # each explorer's tasks, across restarts
        self.consumed = 0  # the trainer's
        self.decisions: list = []  # what the reducer decided as the stream was recorded

    def ref(self, key: str) -> MemberRef:
        role, member_id = key.split("/")
        return MemberRef(role=Role(role), id=member_id, incarnation=self.incarnation[key])

    def member(self, key: str):
        return self.state.members.get(key)

    def round_of(self, key: str):
        for rnd in self.state.rounds.values():
            if rnd.phase is RoundPhase.TRANSFERRING and key in rnd.participants and key not in rnd.reported:
                return rnd
        return None

    def event_for(self, action: str, who: int):
        explorer = f"explorer/{EXPLORER_IDS[who % len(EXPLORER_IDS)]}"
        trainer = "trainer/t"
        key = trainer if action.startswith("t_") else explorer
        member = self.member(key)
        if action not in _LIFECYCLE and (member is None or not member.alive) and who % 3:
            # mostly, a member that is gone comes back first (sometimes it talks anyway: illegal)
            action = "t_restart" if key == trainer else "restart"
        elif action in ("join", "t_join") and member is not None and member.alive and who % 3:
            action = "t_step" if key == trainer else "step"  # mostly no double join
        elif action in ("load", "t_broadcast") and self.round_of(key) is None and who % 3:
            action = "t_req" if key == trainer else "req"  # nothing to report yet: ask instead
        ref = self.ref(key)
        step = member.step if member else 0
        version = member.version if member else -1
        latest = self.state.latest.version
        if action == "configure":
            return JobConfigured(member=ref, config=self.config, train_batch_tasks=UNIT)
        if action in ("join", "t_join"):
            return MemberJoined(member=ref, host="h", pid=1, step=step, version=0 if key == trainer else -1,
                                ranks=1 + who % 2)
        if action in ("restart", "t_restart"):
            if member is not None:
                self.incarnation[key] += 1
            return MemberJoined(member=self.ref(key), host="h", pid=2, step=0,
                                version=0 if key == trainer else -1, ranks=1)
        if action == "step" and key in self.state.paused:
            # a paused explorer explores no further (an eval record changes no decision)
            return EvalFinished(member=ref, version=max(version, 0), step=step, tasks=1, responses=1)
        if action == "step":
            return StepFinished(member=ref, step=step + 1, version=max(version, 0),
                                tasks=self.produced[key] + 1 + who % MOST_PER_STEP)
        if action == "eval":  # a record only: it must never change a decision
            return EvalFinished(member=ref, version=max(version, 0), step=step, rewards={"r": 0.5}, tasks=2,
                                responses=2, seconds=0.1)
        if action == "t_step":
            # it takes what is there, a step's worth or a little more (filtered, dropped), never more
            taken = min(sum(self.produced.values()), self.consumed + UNIT + who % 2)
            return StepFinished(member=ref, step=step + 1, version=version, tasks=taken)
        if action == "req":
            return StatusChanged(member=ref, status=RunningStatus.REQUIRE_SYNC, step=step, version=version)
        if action == "t_req":
            return StatusChanged(member=ref, status=RunningStatus.REQUIRE_SYNC, step=step,
                                 version=max(version, 0), rendezvous="10.0.0.1:29500")
        if action == "load":
            rnd = self.round_of(key)
            if rnd is not None:
                return WeightsLoaded(member=ref, version=rnd.version, round=rnd.id)
            return WeightsLoaded(member=ref, version=max(latest, version))
        if action == "t_broadcast":
            rnd = self.round_of(key)
            return WeightsBroadcast(member=ref, version=rnd.version if rnd else 0,
                                    round=rnd.id if rnd else 1)
        if action in ("fail", "t_fail"):
            rnd = self.round_of(key)
            return SyncFailed(member=ref, version=latest, reason="x", round=rnd.id if rnd else None)
        if action in ("stop", "t_stop", "finish", "t_finish"):
            return StatusChanged(member=ref, status=RunningStatus.STOPPED, step=step, version=max(version, -1),
                                 final=action.endswith("finish"))
        if action in ("expire", "t_expire"):
            return MemberExpired(member=SYNC, expired=ref, silent_for=10.0)
        if action == "t_publish":
            return VersionPublished(member=ref, version=latest + 1, step=step, method=SyncMethod.MEMORY,
                                    location=f"v{latest + 1}", nbytes=1, digest="d")
        if action == "t_no_new":
            return NoNewVersion(member=ref, version=latest, step=step)
        if action == "timeout":
            open_rounds = sorted(self.state.rounds)
            return RoundTimedOut(member=SYNC, round=open_rounds[who % len(open_rounds)] if open_rounds else who)
        if action == "stale":  # an event from an incarnation that is no longer current
            return StepFinished(member=MemberRef(role=ref.role, id=ref.id, incarnation=ref.incarnation - 1),
                                step=1, version=0)
        raise AssertionError(action)

    def record(self, action: str, who: int) -> Recorded:
        self.seq += 1 + who % 2  # gaps in the stream sequence are fine
        rec = Recorded(seq=self.seq, time_ms=1000 * self.seq, event=self.event_for(action, who))
        self.state, decisions, error = reduce_lenient(self.state, rec)
        self.decisions.extend(decisions)
        event = rec.event
        if error is None and isinstance(event, StepFinished) and event.tasks is not None:
            # a count the job took (a refused report counts nothing: the role reports it again)
            if event.member.role is Role.EXPLORER:
                self.produced[event.member.key] = event.tasks
            else:
                self.consumed = event.tasks
        return rec


_configs = st.builds(
    SyncConfig,
    sync_method=st.sampled_from(list(SyncMethod)),
    sync_style=st.sampled_from(list(SyncStyle)),
    max_ahead=st.one_of(st.none(), st.integers(0, 3)),
)
# "calm" scripts have no departures, so rendezvous rounds get to complete; "stormy" ones have all
_CALM_ACTIONS = tuple(a for a in ACTIONS if a not in {"stop", "restart", "expire", "t_stop", "t_restart",
                                                      "t_expire", "timeout", "stale", "fail", "t_fail",
                                                      "finish", "t_finish"})
_scripts = st.lists(st.tuples(st.sampled_from(_CALM_ACTIONS), st.integers(0, 5)), min_size=10,
                    max_size=120) | st.lists(st.tuples(st.sampled_from(ACTIONS), st.integers(0, 5)),
                                             min_size=10, max_size=120)


def _stream(config: SyncConfig, script, configure_first: bool) -> list[Recorded]:
    return _recorded(config, script, configure_first)[0]


def _recorded(config: SyncConfig, script, configure_first: bool) -> tuple[list[Recorded], _Model]:
    model = _Model(config)
    records = []
    if configure_first:
        records.append(model.record("configure", 0))
    for action, who in (("t_join", 0), ("join", 0), ("join", 1), ("join", 2)):
        records.append(model.record(action, who))
    for action, who in script:
        records.append(model.record(action, who))
    return records, model


def _check_invariants(records: list[Recorded], *, paced_from_start: bool = False) -> tuple[State, list, list]:
    """Fold step by step, checking each invariant after every input (`paced_from_start`: the
    job's config came first, so the bound on explorers running ahead held from their first step)."""
    state = State.initial()
    opened: set[int] = set()
    closed: set[int] = set()
    all_decisions = []
    errors = []
    for rec in records:
        before = state
        state, decisions, error = reduce_lenient(before, rec)
        if error is not None:
            errors.append(error)
            assert decisions == ()
            assert state.last_seq == rec.seq
            assert (state.members, state.rounds, state.latest, state.group) == (
                before.members, before.rounds, before.latest, before.group)
        for d in decisions:
            assert d.cause_seq == rec.seq
            assert decode(encode(d)) == d
            if isinstance(d, RoundOpened):
                assert d.round not in opened and d.round not in closed
                opened.add(d.round)
            elif isinstance(d, RoundClosed):
                assert d.round in opened and d.round not in closed, "closed twice or never opened"
                closed.add(d.round)
            elif isinstance(d, MemberReleased):
                assert d.round in opened and d.round not in closed
            elif isinstance(d, RendezvousReady):
                _check_rendezvous_ready(d, state, rec)
        # open rounds are exactly those opened and not yet closed
        assert set(state.rounds) == opened - closed
        # the latest version never goes down
        assert state.latest.version >= before.latest.version
        # held versions never go down within an incarnation
        for key, member in state.members.items():
            old = before.members.get(key)
            if old is not None and old.ref == member.ref:
                assert member.version >= old.version, (key, old.version, member.version)
        # whoever a round waits for is alive and asking
        for rnd in state.rounds.values():
            for key in rnd.waiting:
                member = state.members[key]
                assert member.alive and member.status is RunningStatus.REQUIRE_SYNC, (key, rnd)
        trainer = state.trainer_state
        # once the trainer finished, explorers are free to go on (a trainer started again re-binds them)
        paced_from_start = paced_from_start and not (trainer is not None and trainer.finished)
        _check_pace(state, decisions, paced_from_start)
        all_decisions.extend(decisions)
    identities = [decision_identity(d) for d in all_decisions]
    assert len(identities) == len(set(identities)), "two decisions share an identity (a message id)"
    return state, all_decisions, errors


def _check_pace(state: State, decisions, paced_from_start: bool) -> None:
    """The bound on explorers running ahead, after every input."""
    limit = state.ahead_limit()
    ahead = state.tasks_produced - state.tasks_consumed
    # the sum is the explorers' own reports
    assert state.tasks_produced == sum(m.tasks for m in state.explorers(alive_only=False))
    for key in state.paused:  # only live explorers are paused, each once
        assert state.members[key].alive and state.members[key].ref.role is Role.EXPLORER
    assert len(set(state.paused)) == len(state.paused)
    if state.paused:  # nobody stays paused once the trainer caught up or finished
        trainer = state.trainer_state
        assert limit is not None and ahead >= limit and not (trainer and trainer.finished), (ahead, limit)
    for d in decisions:
        if isinstance(d, ExplorerPaused):
            assert state.members[d.explorer.key].ref == d.explorer and d.produced - d.consumed >= d.limit
        elif isinstance(d, ExplorersResumed):
            assert not state.paused
    if paced_from_start and limit is not None:
        # explorers that explore no further while paused never run more than the bound ahead, plus
        # at most the one step each was in when the bound was reached
        assert ahead <= limit - 1 + len(EXPLORER_IDS) * MOST_PER_STEP, (ahead, limit)


def _check_rendezvous_ready(d: RendezvousReady, state: State, rec: Recorded) -> None:
    trainer = state.trainer_state
    assert trainer is not None and trainer.alive and trainer.status is RunningStatus.REQUIRE_SYNC
    joining = rec.event.member.key if isinstance(rec.event, MemberJoined) else None
    live_explorers = {m.ref for m in state.explorers() if m.key != joining}
    assert {p.member for p in d.participants} == live_explorers
    for ref in live_explorers:
        assert state.members[ref.key].status is RunningStatus.REQUIRE_SYNC
    assert d.world_size == 1 + sum(p.ranks for p in d.participants)
    assert d.version == trainer.step


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(config=_configs, script=_scripts, configure_first=st.booleans())
def test_invariants_hold_on_random_interleavings(config, script, configure_first):
    records = _stream(config, script, configure_first)
    _check_invariants(records, paced_from_start=configure_first)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(config=_configs, seed=st.integers(0, 2**32), calm=st.booleans())
def test_invariants_hold_on_long_random_streams(config, seed, calm):
    # Hypothesis keeps its lists short; long runs (where groups re-form many times) come from a seed
    rng = random.Random(seed)
    actions = _CALM_ACTIONS if calm else ACTIONS
    script = [(rng.choice(actions), rng.randrange(6)) for _ in range(250)]
    configure_first = rng.random() < 0.9
    _check_invariants(_stream(config, script, configure_first), paced_from_start=configure_first)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(config=_configs.filter(lambda c: c.max_ahead is not None), script=_scripts)
def test_replay_reproduces_every_pause_and_resume(config, script):
    # what `rolectl replay --check` does: the decisions recomputed from the recorded inputs alone are
    # the ones made while they were recorded, pauses and resumes included
    records, model = _recorded(config, script, True)
    recomputed = fold_lenient(records)[1]
    assert recomputed == model.decisions
    paced = [d for d in recomputed if isinstance(d, (ExplorerPaused, ExplorersResumed))]
    assert paced == [d for d in model.decisions if isinstance(d, (ExplorerPaused, ExplorersResumed))]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(config=_configs, script=_scripts)
def test_folding_the_same_events_twice_gives_identical_states_and_decisions(config, script):
    records = _stream(config, script, True)
    first = fold_lenient(records)
    second = fold_lenient(records)
    assert first[0] == second[0]
    assert first[1] == second[1]
    assert [str(e) for e in first[2]] == [str(e) for e in second[2]]


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(config=_configs, script=_scripts)
def test_eval_records_change_no_decision(config, script):
    # EvalFinished is a record for the eval curve: the same stream without it decides the same
    records = _stream(config, script, True)
    without = [r for r in records if not isinstance(r.event, EvalFinished)]
    assert fold_lenient(records)[1] == fold_lenient(without)[1]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(config=_configs, script=_scripts, pick=st.integers(0, 10**6))
def test_redelivering_an_applied_sequence_is_a_no_op(config, script, pick):
    records = _stream(config, script, True)
    state, _, _ = fold_lenient(records)
    again = records[pick % len(records)]
    assert reduce(state, again) == (state, ())


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(config=_configs, script=_scripts, cut=st.integers(0, 10**6))
def test_folding_in_two_parts_equals_folding_at_once(config, script, cut):
    # what a restarted synchronizer does: a snapshot state, then the tail of the stream
    records = _stream(config, script, True)
    cut = cut % (len(records) + 1)
    head_state, head_decisions, _ = fold_lenient(records[:cut])
    state, tail_decisions, _ = fold_lenient(records[cut:], head_state)
    whole_state, whole_decisions, _ = fold_lenient(records)
    assert state == whole_state
    assert head_decisions + tail_decisions == whole_decisions


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(config=_configs, script=_scripts, cut=st.integers(0, 10**6))
def test_a_snapshot_plus_the_tail_folds_like_the_whole_stream(config, script, cut):
    # what a restart from a recorded snapshot does: the state through bytes, then the tail
    records = _stream(config, script, True)
    cut = cut % (len(records) + 1)
    head_state, head_decisions, _ = fold_lenient(records[:cut])
    restored, extra = decode_state(encode_state(head_state, extra={"round_subject_seq": {"3": 7}}))
    assert restored == head_state and extra == {"round_subject_seq": {"3": 7}}
    state, tail_decisions, _ = fold_lenient(records[cut:], restored)
    whole_state, whole_decisions, _ = fold_lenient(records)
    assert state == whole_state
    assert head_decisions + tail_decisions == whole_decisions


@settings(max_examples=300, deadline=None)
@given(payload=st.binary(max_size=200))
def test_snapshot_decoding_junk_raises_decode_error_only(payload):
    try:
        decode_state(payload)
    except DecodeError:
        pass
