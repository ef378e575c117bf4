"""The trainer role: sample experiences, train a step, publish weights per the sync style, save.

Reads top to bottom like the reference train loop (init → setup → train → cleanup):

- a step consumes `train_batch_tasks` tasks' worth of experiences from the durable experience
  consumer; experiences older than `max_staleness` versions are dropped and counted, or with
  `staleness_policy: correct` trained with the off-policy correction and counted as corrected;
- `need_sync` follows the reference (fixed / trainer_driven / fully_async: every `sync_interval`
  steps; explorer_driven: when an explorer's round is open, answering "no new version" if nothing
  was trained since the last sync);
- a checkpoint (model, optimizer, step, last synced step) is saved *before* the version is
  announced and before experiences are acked, so a restart neither repeats nor skips a version and
  loses no experience; the ack subjects of the batches it holds are written down as they arrive,
  so a restart gives them back to the stream at once instead of after `ack_wait_s` (the books of
  fetched, trained and acked messages are `roles.ack_ledger.AckLedger`'s);
- the job ends when `total_steps` are trained (a final STOPPED); a trainer that cannot get there
  (every explorer finished its task set, or gone longer than `trainer.explorer_grace_s`) ends
  with a non-zero exit, saying why.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

from rolectl.bus.errors import describe
from rolectl.bus.experiences import ExperienceReader
from rolectl.bus.security import redact
from rolectl.bus.weights import TransferError
from rolectl.bus.weights.base import PullTransport, RendezvousTransport
from rolectl.bus.weights.delta import cast_source
from rolectl.roles.ack_ledger import AckLedger
from rolectl.roles.config import JobConfig, env_settings
from rolectl.roles.engines import dynamic_sampling_of
from rolectl.roles.resume import SavedState, StartMode, decide_resume
from rolectl.roles.session import (
    JobIncomplete,
    MemberRejoined,
    MemberSession,
    finish_before_stopping,
    write_json_atomic,
)
from rolectl.roles.transports import make_pull_transport, make_rendezvous_transport, wire_dtype
from rolectl.roles.waiting import WaitNotice
from rolectl.sync_protocol import (
    MemberReleased,
    NoNewVersion,
    RendezvousReady,
    Role,
    RunningStatus,
    StalenessTally,
    StepFinished,
    StepsRolledBack,
    SyncFailed,
    SyncStyle,
    TasksTaken,
    VersionPublished,
    WeightsBroadcast,
)
from rolectl.sync_protocol.boundaries import Staleness, trainer_needs_sync, verdict_of_age

__all__ = ["Trainer", "saved_trainer_state", "write_trainer_state", "export_hf", "gpu_memory_metrics"]


class Trainer:
    def __init__(self, cfg: JobConfig, member_id: str = "trainer", *, start_mode: StartMode = StartMode.AUTO,
                 engine: object | None = None):
        from rolectl.roles.engines import make_train_engine

        self.cfg = cfg
        self.sync = cfg.synchronizer
        self.member_id = member_id
        # Given: rank 0's engine of a trainer of several ranks (roles.launch.ranks.RankLeader).
        self.engine = engine if engine is not None else make_train_engine(cfg)
        self.ckpt_dir = cfg.trainer_checkpoint_dir
        self.total_steps = cfg.trainer.total_steps
        self.save_interval = cfg.trainer.save_interval
        self.train_batch_tasks = cfg.trainer.train_batch_tasks or cfg.buffer.batch_size
        self.experiences_per_step = self.train_batch_tasks * self.engine.group_size
        self.method = self.sync.sync_method
        self.last_sync_step = 0
        self.version = 0  # the base model
        self.dropped_stale = 0
        self.corrected_stale = 0  # past max_staleness, trained with the correction (staleness_policy: correct)
        # the step being filled: how far behind each experience taken was, and the verdicts on them
        # (its StepFinished records both, so `replay --check` recomputes the verdicts)
        self.step_ages: Counter[int] = Counter()
        self.step_verdicts: Counter[Staleness] = Counter()
        # experiences taken off the stream: trained, dropped or filtered (what paces explorers, max_ahead)
        self.experiences_taken = 0
        self.tasks_reported = 0  # the last count of tasks taken the core heard (StepFinished, TasksTaken)
        self.last_metrics: dict | None = None  # the saved step's StepFinished metrics
        self.answered_rounds: set[int] = set()
        self.end_reason = ""
        self.interrupted = False  # stopped by a stop signal (Ctrl-C, SIGTERM): its STOPPED says so
        self._why_no_more = ""
        # Versions the stream announced (ours, and the latest at start): prune keeps the newest of
        # these and nothing else, so junk with a high version number never pushes them out.
        self.announced_versions: set[int] = set()
        self.start_mode = start_mode  # resumed or not in run(), once the stream says whether this is a restart
        # The parts that need the live member session, built by _setup() at the top of run():
        self.session: MemberSession | None = None
        self.log: Any = None  # the session's logger, bound with job, role and member
        self.transport: PullTransport | RendezvousTransport | None = None
        self.reader: ExperienceReader | None = None
        self.ledger: AckLedger | None = None  # experience messages from fetch to ack (exactly once)

    # -- setup -------------------------------------------------------------------------------------
    def _resume_or_start_fresh(self, view) -> dict | None:
        """Resume from the saved checkpoint if this is a restart (see roles.resume), else start at 0;
        the trainer state resumed from, if any."""
        state = saved_trainer_state(self.cfg, self.member_id, view, self.start_mode, self.log)
        if state is not None:
            self._resume(state)
        return state

    def _resume(self, state: dict) -> None:
        self.engine.load_checkpoint(self.ckpt_dir / state["checkpoint"])
        self.last_sync_step = state["last_sync_step"]
        self.version = state["version"]
        self.dropped_stale = state.get("dropped_stale", 0)
        self.corrected_stale = state.get("corrected_stale", 0)
        self.experiences_taken = state.get("experiences_taken", 0)
        self.last_metrics = state.get("metrics")

    def _adopt_published_versions(self, view) -> None:
        """What the stream says was published after our checkpoint counts as published."""
        latest = view.state.latest
        if latest.version > 0:
            self.announced_versions.add(latest.version)
        if latest.version > self.version and latest.step == self.engine.step:
            # Announced after our last checkpoint was saved (we died between the two): it
            # is the version of our current step, so it counts as synced.
            self.version = latest.version
            self.last_sync_step = max(self.last_sync_step, latest.step)
        elif latest.version > self.version:
            # With save_interval > 1 the steps after the checkpoint are trained again; the
            # versions already announced for them are not announced a second time.
            self.log.warning("resuming_behind_published_version", step=self.engine.step,
                             published=latest.version)
        if self.method.is_rendezvous and view.broadcast_version > self.version:
            # Likewise for a broadcast our previous incarnation sent after the checkpoint.
            self.version = view.broadcast_version
            self.last_sync_step = max(self.last_sync_step, self.version)

    async def _setup(self, session: MemberSession) -> int:
        """Build the parts that need the live session: resume (or not), catch up with what the stream
        says was published, the weight transport, the experience reader and the ack ledger; join.
        Returns the step the stream last heard of from this member."""
        self.session, self.log = session, session.log
        await session.view.start()
        await session.refuse_if_live()  # before anything that touches its state (checkpoint, held batches)
        saved = self._resume_or_start_fresh(session.view)
        previous = session.view.member(Role.TRAINER, self.member_id)
        reported_step = previous.step if previous is not None else 0
        self._adopt_published_versions(session.view)
        session.step = self.engine.step
        session.version = self.version
        if self.method.is_rendezvous:
            self.transport = await make_rendezvous_transport(self.cfg, session)
        else:
            self.transport = make_pull_transport(self.cfg, session.conn)
        # Batches that do not fit the engine are refused (terminated, counted) before training.
        self.reader = ExperienceReader(session.conn, ack_wait_s=self.cfg.buffer.ack_wait_s,
                                       limits=self.engine.experience_limits)
        self.ledger = AckLedger(self.reader, held_file=self.ckpt_dir / "held_batches.json", log=self.log,
                                saved=saved)
        await self.ledger.forget_confirmed()
        await session.join(step=self.engine.step, version=self.version)
        # once joined: a start that loses the race to join must not nak the winner's batches
        await self.ledger.give_back_predecessors()
        self.log.info("trainer_ready", step=self.engine.step, version=self.version,
                      method=self.method.value, style=self.sync.sync_style.value)
        return reported_step

    async def run(self) -> None:
        async with MemberSession(self.cfg, Role.TRAINER, self.member_id) as session:
            reported_step = await self._setup(session)
            try:
                if self.engine.step < reported_step:
                    # killed between two checkpoints: the steps after the last one are trained again,
                    # and the record says so before their StepFinished come a second time
                    await session.publish(StepsRolledBack(member=session.me, from_step=reported_step,
                                                          to_step=self.engine.step))
                    self.log.warning("steps_rolled_back", from_step=reported_step, to_step=self.engine.step)
                if self.engine.step > reported_step and self.last_metrics is not None:
                    # We died between our checkpoint and its StepFinished: report the step now,
                    # once (steps are reported after they are saved, so never twice).
                    await self._step_finished(self.last_metrics)
                if (self.engine.step > self.last_sync_step
                        and self.sync.sync_style is not SyncStyle.EXPLORER_DRIVEN and await self.need_sync()):
                    await self.sync_weight()  # ... and before syncing it: sync it now
                await self.train()
            except asyncio.CancelledError:
                self.interrupted = session.replaced_by is None  # a stop signal, not our own fence
                raise
            finally:
                await self._cleanup()
            if self.engine.step < self.total_steps:
                raise JobIncomplete(self.end_reason)

    # -- loop --------------------------------------------------------------------------------------
    async def train(self) -> None:
        self.end_reason = f"trained {self.total_steps} steps"
        while self.engine.step < self.total_steps:
            batch = await self._sample()
            if batch is None:
                self.end_reason = (f"no more experiences after step {self.engine.step} of "
                                   f"{self.total_steps}: {self._why_no_more}")
                self.log.error("no_more_experiences", step=self.engine.step, total_steps=self.total_steps,
                               reason=self._why_no_more)
                break
            # A stop (Ctrl-C) waits for the step in flight to be trained, saved and reported: the
            # engine's thread cannot be cut short, and a step trained but not reported is counted
            # nowhere once the job ends. A replaced trainer stops at once: the step is its successor's.
            await finish_before_stopping(self._train_step(batch), log=self.log,
                                         what=f"train step {self.engine.step + 1}: train, save, report",
                                         unless=lambda: self.session.replaced_by is not None)
            if await self.need_sync():
                await self.sync_weight()

    async def _train_step(self, batch: list) -> None:
        """Train one step on `batch`, save when due, report the step."""
        await self.session.fence()  # a process back from a pause must not train what its successor trains
        metrics = await asyncio.to_thread(self.engine.train_step, batch, current_version=self.version)
        self.ledger.step_trained()  # the next save may ack them
        self.experiences_taken += len(batch)
        self._guard_metrics(metrics)
        self.session.step = self.engine.step
        metrics["dropped_stale_total"] = float(self.dropped_stale)
        corrected = self.step_verdicts[Staleness.CORRECTED]
        self.corrected_stale += corrected
        metrics["corrected_stale"] = float(corrected)
        metrics["corrected_stale_total"] = float(self.corrected_stale)
        metrics["total_steps"] = float(self.total_steps)  # progress against it: status, dashboard
        metrics["mean_staleness"] = (
            sum(self.version - e.model_version for e in batch) / len(batch) if batch else 0.0
        )
        metrics.update(gpu_memory_metrics())
        self.last_metrics = metrics
        # Saved before it is reported: a restart resumes after the last reported step, never
        # repeats one (a step saved but not reported is reported by the restart).
        if self.need_save():
            await self.save_checkpoint()
        # which experiences the step trained (a step rolled back is trained again, and its ids
        # logged again): what a test that kills the trainer checks "none trained twice" against
        self.log.debug("step_experiences", step=self.engine.step, ids=[e.id for e in batch])
        interval = self.cfg.trainer.hf_save_interval
        if interval and self.engine.step % interval == 0:
            await self._export_hf(f"step-{self.engine.step}")
        await self._step_finished(metrics)

    def _guard_metrics(self, metrics: dict) -> None:
        """Count what never reached the model: refused batches, skipped non-finite updates."""
        metrics["experiences_rejected"] = float(self.reader.rejected)
        if metrics.get("updates_skipped_nonfinite"):
            self.log.warning("nonfinite_update_skipped", step=self.engine.step,
                             updates=int(metrics["updates_skipped_nonfinite"]))

    async def _step_finished(self, metrics: dict) -> None:
        # with explorers paced (max_ahead), the tasks taken off the stream so far: the core's count
        tasks = self.experiences_taken // self.engine.group_size if self.sync.max_ahead is not None else None
        self.tasks_reported = tasks or 0
        await self.session.publish(StepFinished(member=self.session.me, step=self.engine.step,
                                                version=self.version, metrics=metrics, tasks=tasks,
                                                staleness=self._staleness_tally()))
        self.step_ages.clear()
        self.step_verdicts.clear()
        self.log.info("train_step", step=self.engine.step, version=self.version,
                      reward=round(metrics.get("reward_mean", 0.0), 4), loss=round(metrics.get("loss", 0.0), 4))

    def _staleness_tally(self) -> StalenessTally | None:
        """The step's staleness verdicts and their ages, where staleness is bounded (else None; None
        too for a step reported again after a restart, whose verdicts died with the process)."""
        if self.sync.max_staleness is None or not self.step_ages:
            return None
        return StalenessTally(ages=tuple(sorted(self.step_ages.items())),
                              dropped=self.step_verdicts[Staleness.DROPPED],
                              corrected=self.step_verdicts[Staleness.CORRECTED])

    async def _sample(self):
        """Collect one step's experiences; while waiting, answer explorer-driven sync requests."""
        # `batch` stays the ledger's pending list while it fills: a stop mid-fill saves what it holds
        # as untrained (not acked), instead of acking experiences it never trained
        batch = self.ledger.pending
        with WaitNotice(self.log, f"experiences for step {self.engine.step + 1}",
                        detail=lambda: f"{len(batch)} of {self.experiences_per_step} in hand, "
                                       f"{self.dropped_stale} dropped as stale so far; {self._explorers_now()}"):
            return await self._fill(batch)

    def _explorers_now(self) -> str:
        explorers = self.session.view.state.explorers(alive_only=False)
        if not explorers:
            return "no explorer has joined the job yet"
        return ", ".join(f"{m.ref.id} {'at step ' + str(m.step) if m.alive else 'away'}" for m in explorers)

    async def _fill(self, batch: list):
        while len(batch) < self.experiences_per_step:
            await self._serve_sync_requests()
            received = await self.reader.fetch(max_batches=8, timeout=0.5)
            for msg in received:
                for index, exp in await self.ledger.receive(msg):
                    age = self.version - exp.model_version
                    verdict = verdict_of_age(age, self.sync)
                    self.step_ages[age] += 1
                    self.step_verdicts[verdict] += 1
                    if verdict is Staleness.DROPPED:
                        self.dropped_stale += 1
                        self.experiences_taken += 1
                    else:
                        batch.append((msg.seq, index, exp))
            self.ledger.record_held()
            await self._report_drops_to_paused_explorers()
            if not received and self._explorers_done():
                # Nobody will produce more: train on what is left, or stop.
                return self.ledger.start_step() or None
            await self.ledger.extend_held(self.cfg.buffer.ack_wait_s)
        return self.ledger.start_step(self.experiences_per_step)

    async def _report_drops_to_paused_explorers(self) -> None:
        """Explorers the core paused wait for our count of tasks taken to move; drops move it before
        our next step, which may need what they would produce: say it now (TasksTaken)."""
        if self.sync.max_ahead is None or not self.session.view.state.paused:
            return
        tasks = self.experiences_taken // self.engine.group_size
        if tasks > self.tasks_reported:
            await self.session.publish(TasksTaken(member=self.session.me, tasks=tasks))
            self.tasks_reported = tasks

    def _explorers_done(self) -> bool:
        """Nobody will produce more experiences: every explorer finished its task set, or all are
        gone (killed, expired) and none came back within `trainer.explorer_grace_s`."""
        view = self.session.view
        if view.all_finished(Role.EXPLORER):
            self._why_no_more = self._why_explorers_fell_short()
            return True
        away, grace = view.away_for(Role.EXPLORER), self.cfg.trainer.explorer_grace_s
        if away > grace:
            self._why_no_more = (f"every explorer has been gone for {away:.0f} s without finishing "
                                 f"(trainer.explorer_grace_s = {grace:g})")
            return True
        return False

    def _why_explorers_fell_short(self) -> str:
        """Every explorer finished: name what ran out — stale drops, or the task arithmetic."""
        explorers = self.cfg.explorers
        produced = explorers.total_steps * explorers.count * self.cfg.buffer.batch_size
        needed = self.total_steps * self.train_batch_tasks
        if self.dropped_stale:
            return (f"every explorer finished its task set, and {self.dropped_stale} experiences were dropped "
                    f"as stale (older than synchronizer.max_staleness = {self.sync.max_staleness} versions "
                    "when the trainer read them): raise max_staleness, or give the explorers more steps "
                    "(explorers.total_steps; they stop when the trainer finishes) so fresh ones keep coming")
        if dynamic_sampling_of(self.cfg.algorithm).dynamic_sampling:
            return ("every explorer finished its task set, and their dynamic sampling (algorithm.dynamic_sampling) "
                    "left out the groups whose rewards were all equal: give the explorers more steps "
                    "(explorers.total_steps) or generation batches (algorithm.max_num_gen_batches), or tasks the "
                    "policy gets right only sometimes")
        if produced < needed:
            return (f"every explorer finished its task set: explorers.total_steps x count x buffer.batch_size "
                    f"= {produced} tasks are fewer than trainer.total_steps x train_batch_tasks = {needed}")
        return "every explorer finished its task set before the trainer had enough experiences"

    async def _serve_sync_requests(self) -> None:
        """explorer_driven: an explorer's open round is our cue (the reference polls every 1 s)."""
        if self.sync.sync_style is not SyncStyle.EXPLORER_DRIVEN:
            return
        for round_id, rnd in list(self.session.view.state.rounds.items()):
            if round_id in self.answered_rounds or rnd.opened_by.role is not Role.EXPLORER:
                continue
            self.answered_rounds.add(round_id)
            if self.engine.step > self.last_sync_step or (
                self.method.is_rendezvous and self.engine.step > 0 and self.version < self.engine.step
            ):
                await self.sync_weight()
            else:
                self.log.info("no_new_version", round=round_id, version=self.version)
                await self.session.publish(NoNewVersion(member=self.session.me, version=self.version,
                                                        step=self.engine.step))

    async def need_sync(self) -> bool:
        if self.sync.sync_style is SyncStyle.EXPLORER_DRIVEN:
            await self._serve_sync_requests()
            return False
        return trainer_needs_sync(self.engine.step, self.last_sync_step, self.sync)

    def need_save(self) -> bool:
        return self.save_interval > 0 and self.engine.step % self.save_interval == 0

    async def sync_weight(self) -> None:
        started = time.monotonic()
        step = self.engine.step
        if self.method.is_rendezvous:
            await self._sync_rendezvous(step)
        elif step > 0 and step <= self.session.view.state.latest.version:
            # A restart from an older checkpoint trains these steps again; explorers already
            # hold a newer version, and versions never go down.
            self.log.info("version_already_published", step=step, latest=self.session.view.state.latest.version)
        elif step > 0:
            # bucket by bucket: a sharded trainer never gathers the whole model in one process
            streams = _WeightStreams(lambda: cast_source(self.engine.iter_weight_buckets(), wire_dtype(self.cfg)))
            try:
                ref = await self.transport.publish(step, streams)
            finally:
                streams.close()
            await self.session.publish(VersionPublished(member=self.session.me, version=step, step=step,
                                                        method=self.method, location=ref.location,
                                                        nbytes=ref.nbytes, digest=ref.digest))
            self.version = step
            self.session.version = step
            self.announced_versions.add(step)
            pruned = await self.transport.prune(self.cfg.trainer.keep_versions,
                                                announced=self.announced_versions)
            stored = ref.stored  # delta sync: what was stored (None from a transport that does not say)
            self.log.info("version_published", version=step, nbytes=ref.nbytes, kind=stored.kind if stored else None,
                          stored_bytes=stored.stored_bytes if stored else None,
                          seconds=round(time.monotonic() - started, 3), pruned=pruned)
        self.last_sync_step = step

    async def _sync_rendezvous(self, step: int) -> None:
        while True:
            try:
                return await self._sync_rendezvous_once(step)
            except MemberRejoined as exc:
                self.log.warning("sync_asked_again", reason=str(exc))

    async def _sync_rendezvous_once(self, step: int) -> None:
        offer = f"{_advertised_host()}:{self.transport.offer_port()}"
        seq = await self.session.set_status(RunningStatus.REQUIRE_SYNC, rendezvous=offer)
        me = self.session.me

        def for_us(d):
            if isinstance(d, RendezvousReady):
                return d
            if isinstance(d, MemberReleased) and d.released == me:
                return d
            return None

        decision = await self.session.wait_decision(for_us, after=seq, what="the rendezvous decision")
        if decision is None:
            return  # no synchronizer: keep training; explorers keep the weights they have
        if isinstance(decision, MemberReleased):
            self.log.info("rendezvous_released", reason=decision.reason.value, round=decision.round)
            self.session.status = RunningStatus.RUNNING
            return
        started = time.monotonic()
        try:
            nbytes = await self.transport.send(decision, self.engine.weights())
        except TransferError as exc:
            self.log.warning("broadcast_failed", round=decision.round, epoch=decision.epoch, error=describe(exc))
            await self.session.publish(SyncFailed(member=me, version=self.version, reason=str(exc),
                                                  round=decision.round))
            self.session.status = RunningStatus.RUNNING
            return
        seconds = time.monotonic() - started
        self.version = decision.version
        self.session.version = self.version
        self.session.status = RunningStatus.RUNNING
        await self.session.publish(WeightsBroadcast(member=me, version=decision.version, round=decision.round,
                                                    nbytes=nbytes, seconds=seconds))
        self.log.info("weights_broadcast", round=decision.round, epoch=decision.epoch, version=decision.version,
                      nbytes=nbytes, seconds=round(seconds, 3), world_size=decision.world_size)

    async def save_checkpoint(self) -> None:
        await self.session.fence()  # the checkpoint and the acks belong to the live incarnation only
        step = self.engine.step
        name = f"step-{step}"
        await asyncio.to_thread(self.engine.save_checkpoint, self.ckpt_dir / name)
        acks = self.ledger.at_checkpoint()  # which experiences are trained on, which messages done
        # If we die after this but before publishing the version, the restart publishes it.
        write_trainer_state(self.ckpt_dir, {"checkpoint": name, "step": step, "last_sync_step": self.last_sync_step,
                                            "version": self.version, "dropped_stale": self.dropped_stale,
                                            "corrected_stale": self.corrected_stale,
                                            "experiences_taken": self.experiences_taken,
                                            "metrics": self.last_metrics, **acks.state})
        # Only now are the experiences of these steps safe: ack them.
        await self.ledger.ack_trained(acks)

    async def _export_hf(self, name: str) -> None:
        await export_hf(self.engine, self.cfg, name, self.log)

    async def _cleanup(self) -> None:
        """Final save, STOPPED, close transports. Runs on normal end, Ctrl-C and errors; a replaced
        (fenced) trainer only closes: its successor owns the checkpoint and the experiences."""
        if self.session.replaced_by is not None:
            await self._close()
            self.log.error("trainer_fenced", step=self.engine.step, replaced_by=self.session.replaced_by.incarnation)
            return
        try:
            if self.engine.step > 0:
                await self.save_checkpoint()
                await self.ledger.confirm_before_exit(self.session.conn)
        except Exception as exc:
            self.log.error("final_save_failed", error=describe(exc))
        finished = self.engine.step >= self.total_steps
        if finished:
            try:
                await self._export_hf("final")  # before the job is declared done
            except Exception as exc:
                self.log.error("hf_export_failed", error=describe(exc))
        try:
            # final: the job is done, explorers may stop; otherwise a restart is expected
            await self.session.set_status(RunningStatus.STOPPED, final=finished, interrupted=self.interrupted,
                                          metrics={"dropped_stale_total": float(self.dropped_stale)})
        except Exception as exc:
            self.log.error("stopped_not_published", error=describe(exc))
        await self._close()
        self.log.info("trainer_finished" if finished else "trainer_stopped_early", step=self.engine.step,
                      total_steps=self.total_steps, version=self.version, dropped_stale=self.dropped_stale)

    async def _close(self) -> None:
        for closing in (self.transport.aclose, self.reader.aclose):
            try:
                await closing()
            except Exception as exc:  # closing must not hide how the run ended
                self.log.warning("close_failed", what=closing.__qualname__, error=describe(exc))


class _WeightStreams:
    """The engine's weight stream, made afresh each time a publish asks (a server restart
    interrupts an upload, which then starts again from the first bucket). Each new stream first
    finishes the one before: a sharded engine's stream is a collective every rank finishes."""

    def __init__(self, make: Callable[[], Iterator[Any]]) -> None:
        self._make = make
        self._open: Generator[Any, None, None] | None = None

    def __call__(self) -> Generator[Any, None, None]:
        self.close()
        self._open = _to_the_end(self._make())
        return self._open

    def close(self) -> None:
        if self._open is not None:
            self._open.close()
            self._open = None


def _to_the_end(stream: Iterator[Any]) -> Generator[Any, None, None]:
    """`stream`, and when the consumer stops early (a failed publish), the rest of it unread: a
    sharded engine's weight stream is a collective every rank must finish."""
    try:
        yield from stream
    finally:
        for _ in stream:
            pass


def gpu_memory_metrics() -> dict[str, float]:
    """This process's peak CUDA memory so far (torch's allocator: model, optimizer, activations,
    weight buckets), as a StepFinished metric; nothing when the process has not used a GPU."""
    import torch

    if not torch.cuda.is_initialized():
        return {}
    return {"gpu_peak_memory_bytes": float(torch.cuda.max_memory_allocated())}


def _advertised_host() -> str:
    """The address explorers reach our rank 0 at: ROLECTL_ADVERTISE_HOST, else this host's IP."""
    host = env_settings().advertise_host
    if host:
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def saved_trainer_state(cfg: JobConfig, member_id: str, view: Any, start_mode: StartMode, log: Any) -> dict | None:
    """The trainer state to resume from (`<checkpoint_dir>/trainer_state.json`) when this start is a
    restart (see roles.resume), else None, the saved state discarded. Shared by the RL trainer and
    the trainer-only stages (`roles.stage`)."""
    ckpt_dir = cfg.trainer_checkpoint_dir
    state_file = ckpt_dir / "trainer_state.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else None
    saved = SavedState(state_file, state["step"] if state else None)
    recorded = view.member(Role.TRAINER, member_id)
    if decide_resume(start_mode, saved, recorded, job=cfg.job, member=member_id, where=redact(cfg.nats_url)):
        log.warning("resuming_from_checkpoint", path=str(state_file), step=saved.step,
                    recorded_step=recorded.step if recorded else None, mode=start_mode.value)
        return state
    if state is not None:
        shutil.rmtree(ckpt_dir)
        log.warning("discarded_saved_state", path=str(ckpt_dir), step=saved.step)
    return None


def write_trainer_state(ckpt_dir: Path, state: dict) -> None:
    """The trainer state that names the checkpoint just saved (written last: it marks the save
    complete), and the checkpoints beyond the two newest pruned."""
    write_json_atomic(ckpt_dir / "trainer_state.json", state)
    _prune_checkpoints(ckpt_dir, keep=2)


async def export_hf(engine: Any, cfg: JobConfig, name: str, log: Any) -> None:
    """A Hugging Face `save_pretrained` directory of the current weights, by engines that can write
    one (`hf`, `fsdp`): `<run_dir>/<job>/hf/<name>`; `final` goes to `trainer.export_dir` when the
    job names one (the next stage's `model.path`)."""
    export = getattr(engine, "save_hf_model", None)
    if export is None:
        return
    path = cfg.final_export_dir if name == "final" else cfg.hf_export_dir / name
    started = time.monotonic()
    await asyncio.to_thread(export, path)
    log.info("hf_model_saved", path=str(path), step=engine.step, seconds=round(time.monotonic() - started, 3))


def _prune_checkpoints(root: Path, keep: int) -> None:
    import shutil

    steps = sorted((p for p in root.glob("step-*") if p.is_dir()), key=lambda p: int(p.name.split("-")[1]))
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
