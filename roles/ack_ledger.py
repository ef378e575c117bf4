"""The trainer's ack ledger: which experience messages it holds, has trained on, and has acked.

An experience message is acked only once a checkpoint covers every experience in it, so that a
restarted trainer neither loses an experience nor trains one twice:

- **held**: messages fetched and not acked, by stream seq. Their ack subjects are written to
  `held_batches.json` as they change, so a restart naks them at once (`give_back_predecessors`)
  instead of waiting `ack_wait_s` for the server to hand them out again.
- **pending** / **in_step**: the experiences fetched and not trained yet, and those of the step
  being trained (not trained until `train_step` returns: a save after a failed step must not ack
  them). A checkpoint records, per held message, the indices still untrained (`partial`). A step's
  experiences are the first pending ones in arrival order, trained in `train_order` (explore step,
  explorer, its message, index): which explorer's batch landed first does not change the rows of a
  step, nor so its minibatches (a synchronous job is reproducible).
- **acked at save**: seqs a checkpoint marked trained whose ack is not confirmed. If one comes back
  it is acked, not trained (`receive`); a restart forgets those below the consumer's ack floor.
- **unconfirmed**: those of them whose delivery this process still has: acked again at every save
  and before exit (`confirm_before_exit`), so a server away during an ack does not leave trained
  batches in the stream when the job ends.

Use: `receive` each fetched message, `start_step` / `step_trained` around a train step, and at a
save `at_checkpoint()` (what the trainer's state file records) then, once that file is written,
`ack_trained(plan)`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolectl.bus.errors import AckFailed, describe
from rolectl.bus.experiences import ExperienceReader, ReceivedBatch
from rolectl.roles.session import write_json_atomic
from rolectl.sync_protocol.experience import Experience, ExperienceBatch

__all__ = ["AckLedger", "Pending", "CheckpointAcks", "train_order"]

Pending = tuple[int, int, Experience]
"""(message seq, index in the message, experience): fetched, not trained on yet."""


def train_order(batch: ExperienceBatch, seq: int, index: int) -> tuple[int, str, int, int]:
    """Where experience `index` of message `seq` (holding `batch`) goes in a train step: by explore
    step, then explorer, then the explorer's own order (its messages of a step in the order it
    published them, each in its order: task, then response), as verl and TRL fix a batch's rows
    before they split it. Only the explorer's name and step decide, never which one arrived first:
    `seq` orders only the messages of one explorer's step, which it published one after another."""
    return batch.explore_step, batch.member, seq, index


@dataclass(frozen=True, slots=True)
class CheckpointAcks:
    """What a checkpoint records of the ledger, and the messages it lets the trainer ack."""

    state: dict[str, Any] = field(default_factory=dict)
    """`acked_seqs` and `partial`, for the trainer's state file."""
    done: tuple[ReceivedBatch, ...] = ()
    """Held messages every experience of which is trained on: acked once the state file is written."""


class AckLedger:
    """The trainer's experience messages from fetch to ack (see the module's docstring)."""

    def __init__(self, reader: ExperienceReader, *, held_file: Path, log: Any,
                 saved: Mapping[str, Any] | None = None) -> None:
        """`saved`: the trainer state of the checkpoint resumed from (its `acked_seqs`, `partial`)."""
        self.reader = reader
        self.held_file = held_file
        self.log = log
        self.held: dict[int, ReceivedBatch] = {}
        self.pending: list[Pending] = []
        self.in_step: list[Pending] = []
        saved = saved or {}
        self.acked_at_save: set[int] = set(saved.get("acked_seqs", ()))
        self.unconfirmed: dict[int, ReceivedBatch] = {}
        # seq -> indices not trained as of the checkpoint, for messages not redelivered yet
        self.partial: dict[int, set[int]] = {int(seq): set(idx) for seq, idx in saved.get("partial", {}).items()}
        self._held_written: frozenset[int] = frozenset()
        self._last_extend = 0.0

    # -- at start ----------------------------------------------------------------------------------
    async def give_back_predecessors(self) -> None:
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

    async def forget_confirmed(self) -> None:
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

    # -- fetching ----------------------------------------------------------------------------------
    async def receive(self, msg: ReceivedBatch) -> list[tuple[int, Experience]]:
        """Hold a fetched message; (index, experience) of those of its experiences still to train on:
        none for a redelivery of one held or already trained, the untrained rest of a partial one."""
        if msg.seq in self.held:  # redelivered while we hold it: keep the newer delivery
            self.held[msg.seq] = msg
            return []
        if msg.seq in self.acked_at_save:  # trained and acked by our checkpoint; the ack was lost
            await self._ack(msg)
            return []
        keep = self.partial.pop(msg.seq, None)  # part of it was trained before a restart
        self.held[msg.seq] = msg
        return [(index, exp) for index, exp in enumerate(msg.batch.experiences) if keep is None or index in keep]

    def record_held(self) -> None:
        """Write down the ack subjects of the batches we hold (only when the set changed)."""
        seqs = frozenset(self.held)
        if seqs == self._held_written:
            return
        write_json_atomic(self.held_file, {"batches": [
            {"seq": seq, "ack": msg.ack_subject} for seq, msg in sorted(self.held.items())]})
        self._held_written = seqs

    async def extend_held(self, ack_wait_s: float) -> None:
        """Tell the server we still work on the held messages (so they are not redelivered),
        every third of `ack_wait_s`; a failure during a reconnect only means trying next time."""
        now = time.monotonic()
        if now - self._last_extend < ack_wait_s / 3:
            return
        self._last_extend = now
        for msg in list(self.held.values()):
            try:
                await msg.in_progress()
            except AckFailed as exc:  # the server is away (reconnecting); the next call retries
                self.log.debug("in_progress_failed", seq=msg.seq, error=describe(exc))
                break

    # -- training ----------------------------------------------------------------------------------
    def start_step(self, size: int | None = None) -> list[Experience]:
        """The experiences of the next step: the first `size` pending ones (all with None), in
        `train_order`."""
        cut = len(self.pending) if size is None else size
        step, self.pending = self.pending[:cut], self.pending[cut:]
        self.in_step = sorted(step, key=lambda item: train_order(self.held[item[0]].batch, item[0], item[1]))
        return [exp for _, _, exp in self.in_step]

    def step_trained(self) -> None:
        """The step's experiences are trained on: the next checkpoint may ack them."""
        self.in_step = []

    # -- saving ------------------------------------------------------------------------------------
    def at_checkpoint(self) -> CheckpointAcks:
        """What a checkpoint saved now records: held messages whose experiences are all trained on are
        done (acked after the state file is written); the others (their rest is pending) stay held and
        the checkpoint lists which of their experiences remain. Messages of an earlier checkpoint not
        redelivered since the restart keep their record, or a save before their redelivery would have
        them trained again in full."""
        partial: dict[int, list[int]] = {seq: sorted(idx) for seq, idx in self.partial.items()}
        for seq, index, _ in self.pending + self.in_step:  # fetched, not trained: not acked
            partial.setdefault(seq, []).append(index)
        done = tuple(msg for seq, msg in self.held.items() if seq not in partial)
        return CheckpointAcks(state={"acked_seqs": sorted(self.acked_at_save | {msg.seq for msg in done}),
                                     "partial": {str(seq): indices for seq, indices in partial.items()}},
                              done=done)

    async def ack_trained(self, acks: CheckpointAcks) -> None:
        """After the checkpoint of `acks` is on disk: ack its done messages (and those still
        unconfirmed); one whose ack fails is remembered as acked at save."""
        await self._ack_unconfirmed()
        for msg in acks.done:
            del self.held[msg.seq]
            if not await self._ack(msg):
                self.acked_at_save.add(msg.seq)
        self.record_held()

    async def confirm_before_exit(self, conn: Any, within_s: float = 60.0) -> None:
        """The last save's acks, confirmed before the trainer goes, while the server comes back
        within `within_s`. Whatever is still unconfirmed then is not lost nor trained twice: the
        checkpoint lists it (`acked_seqs`), and a trainer that gets it back acks it untrained."""
        deadline = time.monotonic() + within_s
        while self.unconfirmed and time.monotonic() < deadline:
            try:
                await conn.wait_connected(timeout=max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                break
            await self._ack_unconfirmed()
            if self.unconfirmed:
                await asyncio.sleep(0.5)  # JetStream may answer at once while it recovers: back off
        if self.unconfirmed:
            self.log.warning("experience_acks_unconfirmed_at_exit", seqs=sorted(self.unconfirmed),
                             hint="the server redelivers them after buffer.ack_wait_s; a trainer of this "
                                  "job acks them without training (its checkpoint lists them)")

    async def _ack(self, msg: ReceivedBatch) -> bool:
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
