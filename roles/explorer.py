"""The explorer role: pull weights once, explore steps, sync at boundaries, publish experiences.

Reads top to bottom like the reference explore loop:

- before the first step it syncs once (version -1 → whatever the job has: the base model 0 needs
  no reload; a late joiner or a restarted explorer fetches the latest version at once);
- after explore step `s` it syncs when `s > sync_offset and (s - sync_offset) % sync_interval == 0`
  (trainer_driven / fully_async with a rendezvous method: only if the trainer is waiting);
- fully_async with a pull method never blocks: new versions are fetched in the background and
  swapped in between steps; with `explorers.partial_rollout` also inside a step, between two tokens:
  the generations in flight pause, the version loads, and each goes on from the tokens it has, every
  token keeping the version that sampled it (`PauseForWeights`);
- with an `eval:` section, the first explorer evaluates the weights it holds on the eval set before
  its first step (`eval_on_startup`) and after every `eval_interval`-th step, before that step's
  sync (explore steps, then eval, then sync, as the reference does); an eval trains nothing and is
  recorded as `EvalFinished`;
- with `synchronizer.max_ahead`, every step reports the tasks the explorer produced so far, and
  before each step it explores no further while the core has paused it for running ahead of the
  trainer (`ExplorerPaused`), until the recorded `ExplorersResumed`;
- every experience carries the version of the weights that produced it; STOPPED is published when
  the task set is exhausted (or the trainer finished), and the step is saved so a restart resumes;
- a trainer that goes silent (killed, restarting, expired) is waited for, up to
  `explorers.trainer_grace_s`; after that the explorer gives up and exits non-zero.

What it does between its first pull and its stop is the loop it is given (`ExploreLoop`): the task
set's (`TaskSetLoop`, the default), or serving requests (`roles.serve.ServeLoop`). A loop reports
through the explorer (`publish_batch`, `report_step`, `save_state`) and asks it whether to go on
(`stops_with_trainer`, `raise_if_trainer_gone`); the session, the syncs and the weights stay here.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from rolectl.bus.errors import describe
from rolectl.bus.experiences import ExperienceBatch, ExperiencePublisher
from rolectl.bus.security import redact
from rolectl.bus.weights import TransferError, WeightsRef
from rolectl.roles.config import JobConfig
from rolectl.roles.resume import SavedState, StartMode, decide_resume
from rolectl.roles.rollout_step import GroupSampler, StreamingSteps, engine_shares, over_rollout
from rolectl.roles.session import (
    JobIncomplete,
    MemberRejoined,
    MemberSession,
    finish_before_stopping,
    stop_task,
    write_json_atomic,
)
from rolectl.roles.transports import make_pull_transport, make_rendezvous_transport
from rolectl.sync_protocol import (
    EvalFinished,
    ExplorerPaused,
    ExplorersResumed,
    MemberReleased,
    ReleaseReason,
    RendezvousReady,
    Role,
    RunningStatus,
    StepFinished,
    SyncFailed,
    SyncStyle,
    WeightsLoaded,
)
from rolectl.sync_protocol.boundaries import explorer_needs_sync, needs_reload

__all__ = ["Explorer", "ExploreLoop", "PauseForWeights", "TaskSetLoop", "over_rollout"]


class ExploreLoop(Protocol):
    """What an explorer does between its first pull and its stop, built for that explorer
    (`Explorer(..., loop=...)` calls the loop's class with it). It publishes and reports each step
    through the explorer, sets `explorer.finished` when the explorer's work is done, and raises
    `JobIncomplete` when it cannot be done."""

    async def run(self) -> None: ...


class Explorer:
    """A rollout worker of the job: joins, pulls the weights, runs its loop (the task set's unless
    given another), syncs at the boundaries, and says STOPPED with its step saved."""

    def __init__(self, cfg: JobConfig, member_id: str, *, start_mode: StartMode = StartMode.AUTO,
                 loop: Callable[[Explorer], ExploreLoop] | None = None):
        from rolectl.roles.engines import dynamic_sampling_of, make_eval_tasks, make_rollout_engine, make_taskset

        self.cfg = cfg
        self.sync = cfg.synchronizer
        self.member_id = member_id
        self.index = index = _explorer_index(member_id)
        self.engine = make_rollout_engine(cfg, member_id)
        # Further local ranks each hold their own copy of the weights, as separate rollout engines
        # (or tensor-parallel shards) would; an engine that runs its own tensor parallelism (vLLM's
        # workers) is one rank however many workers it has.
        self.local_ranks = cfg.explorers.engine_num * (
            1 if getattr(self.engine, "tensor_parallel_size", 1) > 1 else cfg.explorers.tensor_parallel_size)
        self.extra_ranks = [make_rollout_engine(cfg, f"{member_id}-r{r}") for r in range(1, self.local_ranks)]
        sampling = dynamic_sampling_of(cfg.algorithm)  # dynamic sampling takes more batches a step
        self.sampler = GroupSampler(batch_size=cfg.buffer.batch_size, max_gen_batches=sampling.max_num_gen_batches
                                    ) if sampling.dynamic_sampling else None
        self.taskset = make_taskset(cfg, seed=index, total_batches=cfg.explorers.total_steps * (
            sampling.max_num_gen_batches if self.sampler else 1) + cfg.explorers.streaming,  # its lookahead
            batch_size=cfg.buffer.batch_size)
        # One explorer evaluates: at a boundary every explorer holds the same version.
        self.evaluates = cfg.eval.enabled and index == 0
        self.eval_tasks = make_eval_tasks(cfg) if self.evaluates else []
        self.state_file = cfg.job_dir / member_id / "explorer_state.json"
        self.explore_step = 0
        self.version = -1  # no weights pulled yet (the engine holds the base model, version 0)
        self.tasks_produced = 0  # tasks (groups) published so far: the pace the core bounds (max_ahead)
        self._told_seq = 0  # the stream seq of our last join or step report: what the core paced us by
        self.sync_wait_s: list[float] = []
        self.finished = False  # our work is done: the task set is exhausted or the trainer finished
        self._background: asyncio.Task | None = None
        # (version, tensors, nbytes, fetch seconds) fetched in the background, applied between steps
        self._pending_weights: tuple[int, dict, int, float] | None = None
        self._pending_lock = threading.Lock()  # partial rollouts take it on the rollout's thread
        self.pause_point = PauseForWeights(self) if cfg.explorers.partial_rollout else None
        self.start_mode = start_mode  # resumed or not in run(), once the stream says whether this is a restart
        self.loop = (loop or TaskSetLoop)(self)

    @property
    def engines(self) -> list:
        """The engine of each local rank, the first one's (`engine`) first."""
        return [self.engine, *self.extra_ranks]

    def _trainer_finished_before_join(self, view) -> bool:
        """An explorer started after the trainer's final stop learns it from the stream and ends at
        once, without a synchronizer (which has exited with the job): 0 when its work ends with the
        trainer's (`explorers.stop_with_trainer`), `JobIncomplete` (3) when it still had steps to
        explore that nothing will ever train."""
        if not view.all_finished(Role.TRAINER):
            return False
        trainer = view.trainer
        left = self.cfg.explorers.total_steps - self.explore_step
        if self.cfg.explorers.stop_with_trainer or left <= 0:
            self.finished = True
            self.log.info("trainer_already_finished", trainer_step=trainer.step, step=self.explore_step,
                          hint="the job is over: this explorer has nothing left to do")
            return True
        raise JobIncomplete(
            f"the trainer finished the job at step {trainer.step} before explorer {self.member_id!r} joined, "
            f"and {left} of its {self.cfg.explorers.total_steps} steps are left: nothing will train them "
            "(explorers.stop_with_trainer is false); start a new job to explore more")

    def _own_work_done(self, view) -> bool:
        """The record says this explorer finished its work (a late start of the same id): that is
        not an error, it ends at once with 0. `--resume` rejoins anyway; `--fresh` is refused."""
        recorded = view.member(Role.EXPLORER, self.member_id)
        if recorded is None or not recorded.finished or self.start_mode is not StartMode.AUTO:
            return False
        self.finished = True
        self.log.info("explorer_already_finished", step=recorded.step,
                      hint="the record says its work is done: nothing to resume")
        return True

    def _resume_or_start_fresh(self, view) -> None:
        """Resume from the saved step if this is a restart (see roles.resume), else start at 0."""
        state = json.loads(self.state_file.read_text()) if self.state_file.exists() else None
        saved = SavedState(self.state_file, state["explore_step"] if state else None)
        recorded = view.member(Role.EXPLORER, self.member_id)
        if decide_resume(self.start_mode, saved, recorded, job=self.cfg.job, member=self.member_id,
                         where=redact(self.cfg.nats_url)):
            self.log.warning("resuming_from_saved_state", path=str(self.state_file), step=saved.step,
                             recorded_step=recorded.step if recorded else None, mode=self.start_mode.value)
            self.explore_step = state["explore_step"]
            self.tasks_produced = state.get("tasks_produced", 0)
            self.taskset.load_state_dict(state["taskset"])
        elif state is not None:
            self.state_file.unlink()
            self.log.warning("discarded_saved_state", path=str(self.state_file), step=saved.step)

    def save_state(self) -> None:
        write_json_atomic(self.state_file, {"explore_step": self.explore_step, "tasks_produced": self.tasks_produced,
                                            "taskset": self.taskset.state_dict()})

    # -- setup -------------------------------------------------------------------------------------
    async def run(self) -> None:
        async with MemberSession(self.cfg, Role.EXPLORER, self.member_id, ranks=self.local_ranks) as session:
            self.s = session
            self.log = session.log
            await session.view.start()
            await session.refuse_if_live()  # before anything that touches its saved state
            if self._own_work_done(session.view):
                return  # a late start of a finished member: nothing to resume, nothing to join
            self._resume_or_start_fresh(session.view)
            if self._trainer_finished_before_join(session.view):
                return  # nothing joined, nothing published: the job is over
            self.method = self.sync.sync_method
            if self.method.is_rendezvous:
                self.transport = await make_rendezvous_transport(self.cfg, session)
            else:
                self.transport = make_pull_transport(self.cfg, session.conn)
            self.experiences = ExperiencePublisher(session.conn, self.member_id)
            self._told_seq = await session.join(step=self.explore_step, version=self.version)
            try:
                await self.sync_weight()  # the first pull, before exploring
                if self.evaluates and self.cfg.eval.eval_on_startup and self.explore_step == 0:
                    await self.evaluate()
                if self.sync.sync_style is SyncStyle.FULLY_ASYNC and not self.method.is_rendezvous:
                    self._background = asyncio.create_task(self._follow_versions(), name="background-pull")
                await self.loop.run()
            finally:
                await self._cleanup()

    # -- what a loop reports and asks ---------------------------------------------------------------
    async def publish_batch(self, batch: ExperienceBatch) -> None:
        """Publish a step's experiences; the step is the explorer's from then on."""
        await self.s.fence()  # a process back from a pause must not publish beside its successor
        await self.experiences.publish(batch)
        self.explore_step = batch.explore_step
        self.s.step = batch.explore_step
        self.tasks_produced += len({e.group for e in batch.experiences})

    async def report_step(self, metrics: dict[str, float]) -> None:
        """Report the explorer's current step, with the weights it holds, and `metrics` (and, when
        explorers are paced, the tasks produced so far)."""
        tasks = self.tasks_produced if self.sync.max_ahead is not None else None
        self._told_seq = await self.s.publish(StepFinished(member=self.s.me, step=self.explore_step,
                                                           version=self.engine.version, metrics=metrics, tasks=tasks))

    async def wait_while_paused(self) -> None:
        """Start no step while the core has us paused for running ahead of the trainer
        (`synchronizer.max_ahead`): our view, folded past our last report, says whether we are; the
        recorded `ExplorersResumed` after it lets us go (none within the sync timeout: no
        synchronizer runs, and we go on, as a sync wait does)."""
        if self.sync.max_ahead is None:
            return
        while True:
            try:
                return await self._wait_for_resume()
            except MemberRejoined as exc:  # expired meanwhile: the new incarnation's join is paced again
                self._told_seq = self.s.view.last_seq
                self.log.warning("pause_asked_again", reason=str(exc))

    async def _wait_for_resume(self) -> None:
        view, told = self.s.view, self._told_seq
        await view.wait_for(lambda v: v.last_seq >= told, timeout=120.0, what=f"our report (seq {told}) folded")
        if self._alone_past_the_bound(view):  # the synchronizer's verdict on our report is sure to come
            # caused by our report or later (a resume the synchronizer records after our report may
            # answer an earlier one): a pause addressed to us, or a resume of all
            await self.s.wait_decision(
                lambda d: d if isinstance(d, (ExplorerPaused, ExplorersResumed)) and d.cause_seq >= told else None,
                after=told, what="the synchronizer to pace us (synchronizer.max_ahead)",
                give_up=self._trainer_gone_for_good, detail=self._who_is_missing)
        pause = view.pause_of(self.s.key)
        if pause is None:
            return
        at, started = pause.cause_seq, time.monotonic()  # any resume after our pause is caused later
        self.log.info("explorer_paused", step=self.explore_step, produced=pause.produced, consumed=pause.consumed,
                      limit=pause.limit)
        resumed = await self.s.wait_decision(
            lambda d: d if isinstance(d, ExplorersResumed) and d.cause_seq > at else None, after=at,
            what="the trainer to take what the explorers produced (paused: synchronizer.max_ahead)",
            give_up=self._trainer_gone_for_good, detail=self._who_is_missing)
        self.log.info("explorer_resumed", step=self.explore_step, waited_s=round(time.monotonic() - started, 3),
                      reason=resumed.reason.value if resumed else "no decision")

    def _alone_past_the_bound(self, view) -> bool:
        """Whether our tasks alone reach the bound past the trainer's: our report then pauses us
        (unless the trainer finished); otherwise only the pace decisions say (our view does not fold
        the other explorers' tasks: we may start one step before a pause reaches us)."""
        trainer = view.trainer  # none yet: it took nothing
        if trainer is not None and trainer.finished:
            return False
        unit = self.cfg.trainer.train_batch_tasks or self.cfg.buffer.batch_size
        taken = trainer.tasks if trainer is not None else 0
        return self.tasks_produced - taken >= (self.sync.max_ahead + 1) * unit

    @property
    def replaced(self) -> bool:
        """A newer incarnation of this member took over: its successor owns the work now."""
        return self.s.replaced_by is not None

    def stops_with_trainer(self) -> bool:
        """The trainer finished and this explorer's work ends with it (`explorers.stop_with_trainer`)."""
        return self.cfg.explorers.stop_with_trainer and self.s.view.all_finished(Role.TRAINER)

    def raise_if_trainer_gone(self) -> None:
        """`JobIncomplete` once the trainer has been away longer than its grace."""
        gone = self._trainer_gone_for_good(self.s.view)
        if gone:
            raise JobIncomplete(gone)

    def need_eval(self) -> bool:
        interval = self.cfg.eval.eval_interval
        return self.evaluates and interval > 0 and self.explore_step % interval == 0

    async def evaluate(self) -> None:
        """The whole eval set with the weights we hold; recorded, never trained on."""
        from rolectl.roles.engines.evaluation import evaluate

        result = await asyncio.to_thread(evaluate, self.engine, self.eval_tasks, self.cfg, seed=self.explore_step)
        await self.s.publish(EvalFinished(member=self.s.me, version=self.engine.version, step=self.explore_step,
                                          rewards=result.rewards, tasks=result.tasks, responses=result.responses,
                                          seconds=result.seconds))
        self.log.info("eval_finished", step=self.explore_step, version=self.engine.version,
                      rewards={k: round(v, 4) for k, v in result.rewards.items()}, seconds=round(result.seconds, 3))

    def need_sync(self) -> bool:
        if not explorer_needs_sync(self.explore_step, self.sync):
            return False
        style = self.sync.sync_style
        if style is SyncStyle.FULLY_ASYNC and not self.method.is_rendezvous:
            return False  # the background task picks versions up; never block
        if self.method.is_rendezvous and style in (SyncStyle.TRAINER_DRIVEN, SyncStyle.FULLY_ASYNC):
            return self._trainer_waiting()
        return True

    def _who_is_missing(self) -> str:
        """For a long sync wait: is there a trainer, a synchronizer, and where is the trainer."""
        view = self.s.view
        trainer = view.trainer
        syncs = view.synchronizers_alive()
        if trainer is None:
            said = "no trainer has joined the job yet (is `rolectl start trainer` running?)"
        elif not trainer.alive:
            away = view.away_for(Role.TRAINER)
            said = f"the trainer is away (stopped or expired at step {trainer.step}) for {away:.0f} s"
        else:
            said = f"the trainer is at step {trainer.step}, version {trainer.version}"
        return said + ("" if syncs else "; no synchronizer is running (`rolectl start sync`)")

    def _trainer_waiting(self) -> bool:
        return self.s.view.trainer_waiting()

    def _trainer_gone_for_good(self, view) -> str | None:
        """Why we stop waiting for the trainer, once it has been away (not finished) longer than
        `trainer_grace_s`; None while it is alive, finished, or within its grace."""
        grace = self.cfg.explorers.trainer_grace_s
        away = view.away_for(Role.TRAINER)
        if away <= grace:
            return None
        return (f"the trainer has been gone for {away:.0f} s without finishing (explorers.trainer_grace_s "
                f"= {grace:g}); restart it, or raise the grace if its restart takes longer")

    async def sync_weight(self) -> None:
        """Ask for weights at a boundary; asked again if we were expired (and rejoined) meanwhile."""
        while True:
            try:
                return await self._sync_weight_once()
            except MemberRejoined as exc:
                self.log.warning("sync_asked_again", reason=str(exc))

    async def _sync_weight_once(self) -> None:
        if self.version < 0 and self.method.is_rendezvous:
            # The first sync of a rendezvous method is local: we hold the base model (version 0)
            # and meet the trainer's group at our first boundary. Waiting here instead would
            # deadlock a trainer that needs our experiences before its next boundary.
            await self._set_version(0, round_id=None, nbytes=0, seconds=0.0)
            return
        started = time.monotonic()
        seq = await self.s.set_status(RunningStatus.REQUIRE_SYNC)
        me = self.s.me

        def about_me(d):
            if isinstance(d, MemberReleased) and d.released == me:
                return d
            # one this view could not bind to its group is ours too: its sync fails, saying why
            if isinstance(d, RendezvousReady) and (not d.is_bound or d.assignment_of(me) is not None):
                return d
            return None

        what = ("the first weights from the trainer" if self.version < 0
                else f"weights newer than version {self.version}")
        decision = await self.s.wait_decision(about_me, after=seq, what=f"a sync decision ({what})",
                                              give_up=self._trainer_gone_for_good, detail=self._who_is_missing)
        waited = time.monotonic() - started
        self.sync_wait_s.append(waited)
        self.s.status = RunningStatus.RUNNING
        if decision is None:
            return  # no synchronizer: keep exploring with the weights we have
        if isinstance(decision, RendezvousReady):
            await self._receive_rendezvous(decision)
        elif decision.reason is ReleaseReason.NEW_VERSION:
            if decision.reload:
                ref = WeightsRef(version=decision.version, location=decision.location,
                                 nbytes=decision.nbytes, digest=decision.digest)
                await self._fetch_and_load(ref, round_id=decision.round)
            else:
                await self._set_version(decision.version, round_id=decision.round, nbytes=0, seconds=0.0)
        else:
            self.log.info("released_without_new_weights", reason=decision.reason.value,
                          version=self.engine.version, round=decision.round)
            if self.version < 0:
                # First sync answered without weights (trainer stopped / timed out): we explore
                # with the base model, which is version 0.
                await self._set_version(0, round_id=decision.round, nbytes=0, seconds=0.0)
        self.log.info("sync_done", waited_s=round(waited, 3), version=self.engine.version)

    async def _set_version(self, version: int, *, round_id, nbytes: int, seconds: float) -> None:
        if version < self.version:
            return
        self.version = version
        for engine in self.engines:
            engine.version = version
        self.s.version = version
        await self.s.publish(WeightsLoaded(member=self.s.me, version=version, round=round_id,
                                           nbytes=nbytes, seconds=seconds))

    async def _fetch_and_load(self, ref: WeightsRef, *, round_id) -> None:
        started = time.monotonic()
        try:
            tensors = await self.transport.fetch(ref)
            self._log_fetch()
            for engine in self.engines:
                engine.load_weights(tensors, ref.version)
            self.transport.recycle(tensors)  # copied into the engines: the next fetch may land there
        except TransferError as exc:
            self.log.warning("fetch_failed", version=ref.version, error=describe(exc))
            await self.s.publish(SyncFailed(member=self.s.me, version=self.version, reason=str(exc), round=round_id))
            return
        await self._set_version(ref.version, round_id=round_id, nbytes=ref.nbytes,
                                seconds=time.monotonic() - started)

    def _log_fetch(self) -> None:
        """How a pull fetch got its version (delta sync: a delta, or the keyframe and its deltas)."""
        fetched = getattr(self.transport, "last_fetch", None)
        if fetched:
            self.log.info("weights_fetched", version=fetched["version"], route=fetched["route"],
                          bytes_moved=fetched["bytes_moved"], nbytes=fetched["nbytes"],
                          refused=fetched["refused"], data_connections=fetched.get("data_connections"))

    async def _receive_rendezvous(self, ready: RendezvousReady) -> None:
        started = time.monotonic()
        if not ready.is_bound:  # its group's record could not be read (see roles.member_view)
            reason = (f"the rank assignments of group {ready.epoch} could not be read (no group record "
                      "from the synchronizer)")
            self.log.warning("receive_failed", round=ready.round, epoch=ready.epoch, error=reason)
            await self.s.publish(SyncFailed(member=self.s.me, version=self.version, reason=reason, round=ready.round))
            return
        try:
            nbytes = await self.transport.receive(
                ready, self.s.me, self.engine.weight_buffers(),
                also_into=[e.weight_buffers() for e in self.extra_ranks],
            )
            for engine in self.engines:  # received in place; vLLM reloads its workers
                engine.load_weights(engine.weight_buffers(), ready.version)
        except TransferError as exc:
            self.log.warning("receive_failed", round=ready.round, epoch=ready.epoch, error=describe(exc))
            await self.s.publish(SyncFailed(member=self.s.me, version=self.version, reason=str(exc), round=ready.round))
            return
        await self._set_version(ready.version, round_id=ready.round, nbytes=nbytes,
                                seconds=time.monotonic() - started)

    # -- fully_async -------------------------------------------------------------------------------
    async def _follow_versions(self) -> None:
        """Fetch each newer version in the background; it is swapped in between two steps."""
        fetched = self.version
        while True:
            latest = await self.s.view.wait_for(
                lambda v, fetched=fetched: v.latest if v.latest.version > fetched else None,
                timeout=None, what="a newer version",
            )
            ref = WeightsRef(version=latest.version, location=latest.location, nbytes=latest.nbytes,
                             digest=latest.digest)
            started = time.monotonic()
            try:
                tensors = await self.transport.fetch(ref)
                self._log_fetch()
            except TransferError as exc:
                self.log.warning("background_fetch_failed", version=ref.version, error=describe(exc))
                fetched = ref.version  # skip it; the next version will come
                continue
            fetched = ref.version
            with self._pending_lock:
                self._pending_weights = (ref.version, tensors, ref.nbytes, time.monotonic() - started)

    def take_pending_weights(self) -> tuple[int, dict, int, float] | None:
        """The version the background fetch got and nobody loaded yet, taken (at most once)."""
        with self._pending_lock:
            pending, self._pending_weights = self._pending_weights, None
        return pending

    async def apply_background_weights(self) -> None:
        """Swap in the version the background fetch got (fully_async), between two steps."""
        pending = self.take_pending_weights()
        if pending is None:
            return
        version, tensors, nbytes, seconds = pending
        if needs_reload(self.version, version):
            for engine in self.engines:
                engine.load_weights(tensors, version)
            self.transport.recycle(tensors)  # copied into the engines: the next fetch may land there
            self.version = version
            self.s.version = version
            await self.s.publish(WeightsLoaded(member=self.s.me, version=version, round=None,
                                               nbytes=nbytes, seconds=seconds))

    async def record_loads_in_flight(self) -> int:
        """Record the versions partial rollouts loaded during the last rollout (`WeightsLoaded`, in
        order, before the step's batch is published); how many there were."""
        if self.pause_point is None:
            return 0
        loaded = self.pause_point.take_loaded()
        for version, nbytes, seconds in loaded:
            self.s.version = version
            await self.s.publish(WeightsLoaded(member=self.s.me, version=version, round=None,
                                               nbytes=nbytes, seconds=seconds))
            self.log.info("rollout_paused_for_weights", version=version, step=self.explore_step + 1)
        return len(loaded)

    async def _cleanup(self) -> None:
        if self._background is not None:
            await stop_task(self._background, log=self.log)  # a plain cancel can be lost (see stop_task)
        if self.s.replaced_by is not None:  # fenced: the successor owns the saved state
            await self.transport.aclose()
            self.log.error("explorer_fenced", step=self.explore_step, replaced_by=self.s.replaced_by.incarnation)
            return
        self.save_state()
        try:
            await self.s.set_status(RunningStatus.STOPPED, final=self.finished)
        except Exception as exc:
            self.log.error("stopped_not_published", error=describe(exc))
        await self.transport.aclose()
        # how often it waited, and for how long at most; percentiles are the run summary's (one fold)
        self.log.info("explorer_finished" if self.finished else "explorer_stopped_early",
                      step=self.explore_step, version=self.engine.version, sync_waits=len(self.sync_wait_s),
                      sync_wait_max_s=round(max(self.sync_wait_s), 3) if self.sync_wait_s else None)


class PauseForWeights:
    """The explorer's `PausePoint` (`explorers.partial_rollout`): called by its engines on the
    rollout's thread, between two tokens; loads the version the background fetch got into every
    engine of the explorer (they run one after the other on that thread) and keeps what it loaded,
    for the records the explorer publishes once the rollout is back (`record_loads_in_flight`)."""

    def __init__(self, explorer: Explorer):
        self.explorer = explorer
        self._loaded: list[tuple[int, int, float]] = []  # (version, nbytes, fetch seconds)

    def pending(self) -> bool:
        return self.explorer._pending_weights is not None

    def load(self) -> None:
        x = self.explorer
        pending = x.take_pending_weights()
        if pending is None or not needs_reload(x.version, pending[0]):
            return
        version, tensors, nbytes, seconds = pending
        # said as it happens, not once the rollout is back (`record_loads_in_flight`): a process
        # killed with its generations paused or resumed leaves in its log what it was doing
        x.log.info("generations_paused", version=version, held=x.version, step=x.explore_step + 1)
        for engine in x.engines:
            engine.load_weights(tensors, version)
        # not recycled: the background fetch may be writing its next version on the event loop
        x.version = version
        self._loaded.append((version, nbytes, seconds))
        x.log.info("generations_resumed", version=version, step=x.explore_step + 1)

    def take_loaded(self) -> list[tuple[int, int, float]]:
        loaded, self._loaded = self._loaded, []
        return loaded


class TaskSetLoop:
    """The explore loop: the explorer's task set, a batch a step, rolled out across its engines
    (over-rollout cuts the slowest tasks), each step published, reported and saved, then an eval
    and a sync at their boundaries. It ends when the task set is exhausted or the trainer finished."""

    def __init__(self, explorer: Explorer):
        self.explorer = explorer
        delays = explorer.cfg.explorers.step_delay_s
        self.step_delay_s = delays[explorer.index % len(delays)]
        self.tasks_cut = 0  # tasks of the last step cancelled or dropped by over-rollout
        self.pauses = 0  # weight loads inside the last step's rollout (partial rollouts)
        self._pools: list[ThreadPoolExecutor] | None = None  # one per engine, for over-rollout
        self.sampled = None  # the last step's dynamic sampling (algorithm.dynamic_sampling)
        self.streaming = StreamingSteps(explorer.engines) if explorer.cfg.explorers.streaming else None

    async def run(self) -> None:
        x = self.explorer
        try:
            while True:
                await x.wait_while_paused()
                await x.apply_background_weights()  # fetched while it waited, too: the newest
                position = x.taskset.state_dict()  # where a stop before this step is recorded resumes
                done = x.sampler is not None and x.explore_step >= x.cfg.explorers.total_steps
                tasks = None if done else x.taskset.next_batch()
                if tasks is None:
                    x.log.info("taskset_exhausted", step=x.explore_step)
                    x.finished = True
                    return
                if x.stops_with_trainer():
                    x.log.info("trainer_finished_stop_exploring", step=x.explore_step)
                    x.finished = True
                    return
                x.raise_if_trainer_gone()
                started = time.monotonic()
                step = x.explore_step + 1
                try:
                    experiences = await asyncio.to_thread(self._explore, tasks, step)
                    self.pauses = await x.record_loads_in_flight()
                    if self.step_delay_s:
                        await asyncio.sleep(self.step_delay_s)  # simulated slower rollout engine (config)
                except BaseException:
                    # stopped (or failed) before the step was recorded: its tasks are the restart's,
                    # or the state saved on the way out would skip them and the job end short
                    x.taskset.load_state_dict(position)
                    raise
                # A stop (Ctrl-C) waits for the batch's step to be reported and saved: a batch in the
                # stream that no step reports would be counted nowhere
                await finish_before_stopping(self._record_step(step, experiences, started), log=x.log,
                                             what=f"explore step {step}: publish, report, save",
                                             unless=lambda: x.replaced)
                if x.need_eval():
                    await x.evaluate()
                if x.need_sync():
                    await x.sync_weight()
        finally:
            for pool in self._pools or ():
                pool.shutdown(wait=False, cancel_futures=True)
            if self.streaming is not None:  # never published, so counted nowhere else
                x.log.info("streaming_groups_dropped", groups=self.streaming.drop())

    async def _record_step(self, step: int, experiences: list, started: float) -> None:
        """Publish the step's batch, report the step, save the explorer's state."""
        x = self.explorer
        await x.publish_batch(ExperienceBatch(member=x.member_id, explore_step=step, model_version=x.engine.version,
                                              experiences=tuple(experiences)))
        reward = sum(e.reward for e in experiences) / max(len(experiences), 1)
        sampled = self.sampled.metrics() if self.sampled is not None else {}
        # Reported before it is saved: a restart in between explores the step again (its
        # batch is deduplicated by msg id) and reports it again; counts are per (member, step).
        await x.report_step({"reward_mean": reward, "experiences": float(len(experiences)
                                                                          + sampled.get("experiences_filtered", 0)),
                             "total_steps": float(x.cfg.explorers.total_steps),
                             "seconds": time.monotonic() - started,
                             **({"over_rollout_tasks_cut": float(self.tasks_cut)}
                                if x.cfg.explorers.over_rollout_ratio else {}),
                             **(_partial_rollout_metrics(self.pauses, experiences)
                                if x.pause_point is not None else {}),
                             **sampled, **(self.streaming.metrics() if self.streaming else {}),
                             **x.engine.rollout_metrics})
        x.save_state()
        x.log.info("explore_step", step=step, version=x.engine.version, reward=round(reward, 4))

    def _explore(self, tasks, step: int) -> list:
        """The step's experiences: its tasks rolled out, or with dynamic sampling the groups whose
        rewards differ, from more of the task set if need be (`rollout_step.GroupSampler`)."""
        x = self.explorer
        if x.sampler is None:
            return self._rollout(tasks, step)
        self.sampled = x.sampler.fill(tasks, step, rollout=self._rollout, more=x.taskset.next_batch)
        if self.sampled.short:
            x.log.warning("dynamic_sampling_short_step", step=step, gen_batches=self.sampled.gen_batches,
                          groups_filtered=self.sampled.groups_filtered)
        return self.sampled.experiences

    def _rollout(self, tasks, step: int) -> list:
        """Split the step's tasks across the explorer's engines (one per local rank)."""
        engines = self.explorer.engines
        if self.streaming is not None:
            return self.streaming.rollout(tasks, step, pause_point=self.explorer.pause_point,
                                          more=self.explorer.taskset.next_batch)
        ratio = self.explorer.cfg.explorers.over_rollout_ratio
        if ratio:
            if self._pools is None:
                self._pools = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rollout-r{i}")
                               for i in range(len(engines))]
            experiences, self.tasks_cut = over_rollout(engines, self._pools, tasks, step=step,
                                                       member=self.explorer.member_id,
                                                       wait_for=math.ceil(len(tasks) * (1 - ratio)))
            return experiences
        paused = {} if self.explorer.pause_point is None else {"pause_point": self.explorer.pause_point}
        return [experience for engine, share in engine_shares(engines, tasks)
                for experience in engine.rollout(share, explore_step=step, **paused)]


def _partial_rollout_metrics(pauses: int, experiences: list) -> dict[str, float]:
    """A step's partial-rollout figures: weight loads inside its rollout, experiences that more
    than one version sampled, and their tokens sampled by an older version than their last one."""
    resumed = [e for e in experiences if e.token_versions is not None]
    older = sum(count for e in resumed for count, version in e.token_versions
                if version < e.token_versions[-1][1])
    return {"partial_rollout_pauses": float(pauses), "partial_rollout_experiences": float(len(resumed)),
            "partial_rollout_older_tokens": float(older)}


def _explorer_index(member_id: str) -> int:
    tail = member_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else zlib.crc32(member_id.encode()) % 1000
