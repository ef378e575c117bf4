"""The trainer role: sample experiences, train a step, publish weights per the sync style, save.

Reads top to bottom like the reference train loop (init → setup → train → cleanup):

- a step consumes `train_batch_tasks` tasks' worth of experiences from the durable experience
  consumer; experiences older than `max_staleness` versions are dropped and counted;
- `need_sync` follows the reference (fixed / trainer_driven / fully_async: every `sync_interval`
  steps; explorer_driven: when an explorer's round is open, answering "no new version" if nothing
  was trained since the last sync);
- a checkpoint (model, optimizer, step, last synced step) is saved *before* the version is
  announced and before experiences are acked, so a restart neither repeats nor skips a version and
  loses no experience; the ack subjects of the batches it holds are written down as they arrive,
  so a restart gives them back to the stream at once instead of after `ack_wait_s`;
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
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

from rolectl.bus.errors import AckFailed, describe
from rolectl.bus.experiences import ExperienceReader
from rolectl.bus.security import redact
from rolectl.bus.weights import TransferError
from rolectl.bus.weights.delta import cast_source
from rolectl.roles.config import JobConfig, env_settings
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
    StepFinished,
    StepsRolledBack,
    SyncFailed,
    SyncStyle,
    VersionPublished,
    WeightsBroadcast,
)
from rolectl.sync_protocol.boundaries import is_stale, trainer_needs_sync

__all__ = ["Trainer"]


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
        self.last_sync_step = 0
        self.version = 0  # the base model
        self.dropped_stale = 0
        # Experience messages fetched and not yet acked, by stream seq. One is acked only at a
        # checkpoint that covers all its experiences, so a restart neither loses nor repeats any.
        self.held: dict[int, object] = {}
        self.leftover: list = []  # (seq, index, experience) fetched but not yet trained on
        # (seq, index, experience) of the step being trained: not trained until train_step returns,
        # so a save after a failed step (the final save in _cleanup) must not ack them.
        self.in_step: list = []
        # Seqs a checkpoint marked trained whose ack is not confirmed (lost in a crash or refused):
        # if one comes back it is acked, not trained again. Kept across saves until seen.
        self.acked_at_save: set[int] = set()
        # Those of them this process still has the delivery of: acked again at every save and
        # before exit, so a server that was away during an ack does not leave trained batches in
        # the stream when the job ends (they would come back only after ack_wait_s).
        self.unconfirmed: dict[int, object] = {}
        # seq -> indices not trained as of the checkpoint, for messages not redelivered yet
        self.partial: dict[int, set[int]] = {}
        self.last_metrics: dict | None = None  # the saved step's StepFinished metrics
        self.answered_rounds: set[int] = set()
        self.end_reason = ""
        self.interrupted = False  # stopped by a stop signal (Ctrl-C, SIGTERM): its STOPPED says so
        self._why_no_more = ""
        # Versions the stream announced (ours, and the latest at start): prune keeps the newest of
        # these and nothing else, so junk with a high version number never pushes them out.
        self.announced_versions: set[int] = set()
        self._last_extend = 0.0
        # Ack subjects of the batches we hold, on disk: a restart naks them so the stream hands
        # them out at once (the server would otherwise keep them for ack_wait_s).
        self.held_file = self.ckpt_dir / "held_batches.json"
        self._held_written: frozenset[int] = frozenset()
        self.start_mode = start_mode  # resumed or not in run(), once the stream says whether this is a restart

    # -- setup -------------------------------------------------------------------------------------
    def _resume_or_start_fresh(self, view) -> None:
        """Resume from the saved checkpoint if this is a restart (see roles.resume), else start at 0."""
        state_file = self.ckpt_dir / "trainer_state.json"
        state = json.loads(state_file.read_text()) if state_file.exists() else None
        saved = SavedState(state_file, state["step"] if state else None)
        recorded = view.member(Role.TRAINER, self.member_id)
        if decide_resume(self.start_mode, saved, recorded, job=self.cfg.job, member=self.member_id,
                         where=redact(self.cfg.nats_url)):
            self.log.warning("resuming_from_checkpoint", path=str(state_file), step=saved.step,
                             recorded_step=recorded.step if recorded else None, mode=self.start_mode.value)
            self._resume(state)
        elif state is not None:
            shutil.rmtree(self.ckpt_dir)
            self.log.warning("discarded_saved_state", path=str(self.ckpt_dir), step=saved.step)

    def _resume(self, state: dict) -> None:
        self.engine.load_checkpoint(self.ckpt_dir / state["checkpoint"])
        self.last_sync_step = state["last_sync_step"]
        self.version = state["version"]
        self.dropped_stale = state.get("dropped_stale", 0)
        self.acked_at_save = set(state.get("acked_seqs", ()))
        self.partial = {int(seq): set(idx) for seq, idx in state.get("partial", {}).items()}
        self.last_metrics = state.get("metrics")

    async def run(self) -> None:
        async with MemberSession(self.cfg, Role.TRAINER, self.member_id) as session:
            self.s = session
            self.log = session.log
            await session.view.start()
            await session.refuse_if_live()  # before anything that touches its state (checkpoint, held batches)
            self._resume_or_start_fresh(session.view)
            latest = session.view.state.latest
            if latest.version > 0:
                self.announced_versions.add(latest.version)
            previous = session.view.member(Role.TRAINER, self.member_id)
            reported_step = previous.step if previous is not None else 0
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
            if self.sync.sync_method.is_rendezvous and session.view.broadcast_version > self.version:
                # Likewise for a broadcast our previous incarnation sent after the checkpoint.
                self.version = session.view.broadcast_version
                self.last_sync_step = max(self.last_sync_step, self.version)
            session.step = self.engine.step
            session.version = self.version
            self.method = self.sync.sync_method
            if self.method.is_rendezvous:
                self.transport = await make_rendezvous_transport(self.cfg, session)
            else:
                self.transport = make_pull_transport(self.cfg, session.conn)
            # Batches that do not fit the engine are refused (terminated, counted) before training.
            self.reader = ExperienceReader(session.conn, ack_wait_s=self.cfg.buffer.ack_wait_s,
                                           limits=self.engine.experience_limits)
            await self._give_back_predecessors_batches()
            await self._forget_confirmed_acks()
            await session.join(step=self.engine.step, version=self.version)
            self.log.info("trainer_ready", step=self.engine.step, version=self.version,
                          method=self.method.value, style=self.sync.sync_style.value)
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
    async def _give_back_predecessors_batches(self) -> None:
        """Nak the batches a previous incarnation held (fetched, not acked) so they come back now."""
        if not self.held_file.exists():
            return
        try:
            held = json.loads(self.held_file.read_text())
        except (OSError, ValueError) as exc:
            self.log.warning("held_batches_unreadable", file=str(self.held_file), error=describe(exc))
            return
        given = await self.reader.give_back([item["ack"] for item in held.get("batches", ())])
        if given:
            self.log.info("predecessor_batches_given_back", batches=given)

    async def _forget_confirmed_acks(self) -> None:
        """Drop from the checkpoint's `acked_seqs` what the server has confirmed since (below the
        consumer's ack floor): a predecessor killed after its acks went through left them there, and
        each restart would otherwise carry them on for the life of the job."""
        if not self.acked_at_save:
            return
        try:
            floor = await self.reader.ack_floor()
        except Exception as exc:  # only bookkeeping: the next restart tries again
            self.log.info("ack_floor_unread", error=describe(exc))
            return
        confirmed = {seq for seq in self.acked_at_save if seq <= floor}
        self.acked_at_save -= confirmed
        if confirmed:
            self.log.info("acked_seqs_confirmed", forgotten=len(confirmed), kept=len(self.acked_at_save))

    def _record_held(self) -> None:
        """Write down the ack subjects of the batches we hold (only when the set changed)."""
        seqs = frozenset(self.held)
        if seqs == self._held_written:
            return
        write_json_atomic(self.held_file, {"batches": [
            {"seq": seq, "ack": msg.ack_subject} for seq, msg in sorted(self.held.items())]})
        self._held_written = seqs

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
                                         unless=lambda: self.s.replaced_by is not None)
            if await self.need_sync():
                await self.sync_weight()

    async def _train_step(self, batch: list) -> None:
        """Train one step on `batch`, save when due, report the step."""
        await self.s.fence()  # a process back from a pause must not train what its successor trains
        metrics = await asyncio.to_thread(self.engine.train_step, batch, current_version=self.version)
        self.in_step = []  # trained: the next save may ack them
        self._guard_metrics(metrics)
        self.s.step = self.engine.step
        metrics["dropped_stale_total"] = float(self.dropped_stale)
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
        await self.s.publish(StepFinished(member=self.s.me, step=self.engine.step,
                                          version=self.version, metrics=metrics))
        self.log.info("train_step", step=self.engine.step, version=self.version,
                      reward=round(metrics.get("reward_mean", 0.0), 4), loss=round(metrics.get("loss", 0.0), 4))

    async def _sample(self):
        """Collect one step's experiences; while waiting, answer explorer-driven sync requests."""
        # `batch` stays `self.leftover` while it fills: a stop mid-fill saves what it holds as
        # untrained (not acked), instead of acking experiences it never trained
        batch = self.leftover
        with WaitNotice(self.log, f"experiences for step {self.engine.step + 1}",
                        detail=lambda: f"{len(batch)} of {self.experiences_per_step} in hand, "
                                       f"{self.dropped_stale} dropped as stale so far; {self._explorers_now()}"):
            return await self._fill(batch)

    def _explorers_now(self) -> str:
        explorers = self.s.view.state.explorers(alive_only=False)
        if not explorers:
            return "no explorer has joined the job yet"
        return ", ".join(f"{m.ref.id} {'at step ' + str(m.step) if m.alive else 'away'}" for m in explorers)

    async def _fill(self, batch: list):
        while len(batch) < self.experiences_per_step:
            await self._serve_sync_requests()
            received = await self.reader.fetch(max_batches=8, timeout=0.5)
            for msg in received:
                if msg.seq in self.held:  # redelivered while we hold it: keep the newer delivery
                    self.held[msg.seq] = msg
                    continue
                if msg.seq in self.acked_at_save:  # trained and acked by our checkpoint; the ack was lost
                    await self._ack(msg)
                    continue
                keep = self.partial.pop(msg.seq, None)  # part of it was trained before a restart
                self.held[msg.seq] = msg
                for index, exp in enumerate(msg.batch.experiences):
                    if keep is not None and index not in keep:
                        continue
                    if is_stale(exp.model_version, self.version, self.sync.max_staleness):
                        self.dropped_stale += 1
                    else:
                        batch.append((msg.seq, index, exp))
            self._record_held()
            if not received and self._explorers_done():
                # Nobody will produce more: train on what is left, or stop.
                self.in_step, self.leftover = batch, []
                return [exp for _, _, exp in batch] or None
            await self._extend_held()
        self.leftover = batch[self.experiences_per_step:]
        self.in_step = batch[: self.experiences_per_step]
        return [exp for _, _, exp in self.in_step]

    async def _extend_held(self) -> None:
        """Tell the server we still work on the held messages (so they are not redelivered),
        every third of ack_wait; a failure during a reconnect only means trying next time."""
        now = time.monotonic()
        if now - self._last_extend < self.cfg.buffer.ack_wait_s / 3:
            return
        self._last_extend = now
        for msg in list(self.held.values()):
            try:
                await msg.in_progress()
            except AckFailed as exc:  # the server is away (reconnecting); the next call retries
                self.log.debug("in_progress_failed", seq=msg.seq, error=describe(exc))
                break

    def _explorers_done(self) -> bool:
        """Nobody will produce more experiences: every explorer finished its task set, or all are
        gone (killed, expired) and none came back within `trainer.explorer_grace_s`."""
        view = self.s.view
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
        if produced < needed:
            return (f"every explorer finished its task set: explorers.total_steps x count x buffer.batch_size "
                    f"= {produced} tasks are fewer than trainer.total_steps x train_batch_tasks = {needed}")
        return "every explorer finished its task set before the trainer had enough experiences"

    async def _serve_sync_requests(self) -> None:
        """explorer_driven: an explorer's open round is our cue (the reference polls every 1 s)."""
        if self.sync.sync_style is not SyncStyle.EXPLORER_DRIVEN:
            return
        for round_id, rnd in list(self.s.view.state.rounds.items()):
            if round_id in self.answered_rounds or rnd.opened_by.role is not Role.EXPLORER:
                continue
            self.answered_rounds.add(round_id)
            if self.engine.step > self.last_sync_step or (
                self.method.is_rendezvous and self.engine.step > 0 and self.version < self.engine.step
            ):
                await self.sync_weight()
            else:
                self.log.info("no_new_version", round=round_id, version=self.version)
                await self.s.publish(NoNewVersion(member=self.s.me, version=self.version, step=self.engine.step))

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
        elif step > 0 and step <= self.s.view.state.latest.version:
            # A restart from an older checkpoint trains these steps again; explorers already
            # hold a newer version, and versions never go down.
            self.log.info("version_already_published", step=step, latest=self.s.view.state.latest.version)
        elif step > 0:
            # bucket by bucket: a sharded trainer never gathers the whole model in one process
            streams = _WeightStreams(lambda: cast_source(self.engine.iter_weight_buckets(), wire_dtype(self.cfg)))
            try:
                ref = await self.transport.publish(step, streams)
            finally:
                streams.close()
            await self.s.publish(VersionPublished(member=self.s.me, version=step, step=step,
                                                  method=self.method, location=ref.location,
                                                  nbytes=ref.nbytes, digest=ref.digest))
            self.version = step
            self.s.version = step
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
        seq = await self.s.set_status(RunningStatus.REQUIRE_SYNC, rendezvous=offer)
        me = self.s.me

        def for_us(d):
            if isinstance(d, RendezvousReady):
                return d
            if isinstance(d, MemberReleased) and d.released == me:
                return d
            return None

        decision = await self.s.wait_decision(for_us, after=seq, what="the rendezvous decision")
        if decision is None:
            return  # no synchronizer: keep training; explorers keep the weights they have
        if isinstance(decision, MemberReleased):
            self.log.info("rendezvous_released", reason=decision.reason.value, round=decision.round)
            self.s.status = RunningStatus.RUNNING
            return
        started = time.monotonic()
        try:
            nbytes = await self.transport.send(decision, self.engine.weights())
        except TransferError as exc:
            self.log.warning("broadcast_failed", round=decision.round, epoch=decision.epoch, error=describe(exc))
            await self.s.publish(SyncFailed(member=me, version=self.version, reason=str(exc), round=decision.round))
            self.s.status = RunningStatus.RUNNING
            return
        seconds = time.monotonic() - started
        self.version = decision.version
        self.s.version = self.version
        self.s.status = RunningStatus.RUNNING
        await self.s.publish(WeightsBroadcast(member=me, version=decision.version, round=decision.round,
                                              nbytes=nbytes, seconds=seconds))
        self.log.info("weights_broadcast", round=decision.round, epoch=decision.epoch, version=decision.version,
                      nbytes=nbytes, seconds=round(seconds, 3), world_size=decision.world_size)

    async def save_checkpoint(self) -> None:
        await self.s.fence()  # the checkpoint and the acks belong to the live incarnation only
        step = self.engine.step
        name = f"step-{step}"
        await asyncio.to_thread(self.engine.save_checkpoint, self.ckpt_dir / name)
        # Messages whose experiences are all trained on are acked; the others (their rest is in
        # `leftover`) stay held, and the checkpoint says which of their experiences remain.
        # Messages of an earlier checkpoint not redelivered since the restart keep their record,
        # or a save before their redelivery would have them trained again in full.
        partial: dict[int, list[int]] = {seq: sorted(idx) for seq, idx in self.partial.items()}
        for seq, index, _ in self.leftover + self.in_step:  # fetched, not trained: not acked
            partial.setdefault(seq, []).append(index)
        done = [msg for seq, msg in self.held.items() if seq not in partial]
        state = {"checkpoint": name, "step": step, "last_sync_step": self.last_sync_step,
                 "version": self.version, "dropped_stale": self.dropped_stale,
                 "metrics": self.last_metrics,
                 "acked_seqs": sorted(self.acked_at_save | {msg.seq for msg in done}),
                 "partial": {str(seq): indices for seq, indices in partial.items()}}
        # If we die after this but before publishing the version, the restart publishes it.
        write_json_atomic(self.ckpt_dir / "trainer_state.json", state)
        _prune_checkpoints(self.ckpt_dir, keep=2)
        # Only now are the experiences of these steps safe: ack them.
        await self._ack_unconfirmed()
        for msg in done:
            del self.held[msg.seq]
            if not await self._ack(msg):
                self.acked_at_save.add(msg.seq)
        self._record_held()

    async def _export_hf(self, name: str) -> None:
        """A Hugging Face `save_pretrained` directory of the current weights, by engines that can
        write one (`fsdp`): `<run_dir>/<job>/hf/<name>`."""
        export = getattr(self.engine, "save_hf_model", None)
        if export is None:
            return
        path = self.cfg.hf_export_dir / name
        started = time.monotonic()
        await asyncio.to_thread(export, path)
        self.log.info("hf_model_saved", path=str(path), step=self.engine.step,
                      seconds=round(time.monotonic() - started, 3))

    async def _ack(self, msg) -> bool:
        """Ack a trained message; an unconfirmed ack is logged, not fatal (it comes back and is acked)."""
        try:
            await msg.ack()
        except AckFailed as exc:
            self.log.warning("experience_ack_failed", seq=msg.seq, error=describe(exc))
            self.unconfirmed[msg.seq] = msg
            return False
        self.acked_at_save.discard(msg.seq)
        self.unconfirmed.pop(msg.seq, None)
        return True

    async def _ack_unconfirmed(self) -> None:
        """Ack again the trained batches whose ack was not confirmed (the delivery's ack subject
        stays valid across a server restart)."""
        for msg in list(self.unconfirmed.values()):
            if not await self._ack(msg):
                return  # the server is still away: the next save tries again

    async def _confirm_acks_before_exit(self, within_s: float = 60.0) -> None:
        """The last save's acks, confirmed before the trainer goes, while the server comes back
        within `within_s`. Whatever is still unconfirmed then is not lost nor trained twice: the
        checkpoint lists it (`acked_seqs`), and a trainer that gets it back acks it untrained."""
        deadline = time.monotonic() + within_s
        while self.unconfirmed and time.monotonic() < deadline:
            try:
                await self.s.conn.wait_connected(timeout=max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                break
            await self._ack_unconfirmed()
            if self.unconfirmed:
                await asyncio.sleep(0.5)  # JetStream may answer at once while it recovers: back off
        if self.unconfirmed:
            self.log.warning("experience_acks_unconfirmed_at_exit", seqs=sorted(self.unconfirmed),
                             hint="the server redelivers them after buffer.ack_wait_s; a trainer of this "
                                  "job acks them without training (its checkpoint lists them)")

    async def _cleanup(self) -> None:
        """Final save, STOPPED, close transports. Runs on normal end, Ctrl-C and errors; a replaced
        (fenced) trainer only closes: its successor owns the checkpoint and the experiences."""
        if self.s.replaced_by is not None:
            await self._close()
            self.log.error("trainer_fenced", step=self.engine.step, replaced_by=self.s.replaced_by.incarnation)
            return
        try:
            if self.engine.step > 0:
                await self.save_checkpoint()
                await self._confirm_acks_before_exit()
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
            await self.s.set_status(RunningStatus.STOPPED, final=finished, interrupted=self.interrupted,
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


def _prune_checkpoints(root: Path, keep: int) -> None:
    import shutil

    steps = sorted((p for p in root.glob("step-*") if p.is_dir()), key=lambda p: int(p.name.split("-")[1]))
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
