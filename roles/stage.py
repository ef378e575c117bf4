"""A trainer-only stage (`stage: sft`): the trainer's member, session, checkpoints and exports, and a
loop over a data file instead of experiences.

Reads top to bottom like the RL trainer (`roles.trainer`), whose machinery it shares (the resume
decision, the trainer state that names each checkpoint, the Hugging Face export; a trainer of
several ranks is the same `RankLeader`):

- the stage's data (`StageData`, one builder per stage name in `STAGE_DATA`) is tokenized once; a
  `StagePlan` walks it: epochs of a seeded permutation, `batch_size` rows per train step, so the
  rows of step `s` are a function of `s` alone and the data position is the step;
- each step trains `data.batch(rows)` with the stage's loss through the engine's `train_batch`
  (the one training step); the learning rate follows the stage's schedule, kept in the checkpoint;
- a checkpoint (model, optimizer, schedule, RNG, and the position) is saved before the step is
  reported, so a restart after kill -9 resumes exactly where the last checkpoint stopped;
- evals on the held-out file (its loss; the reward of greedy generations where rows have answers)
  run every `eval_interval` steps and after the last; every figure goes out in `StepFinished`
  (trackers, `status`, the dashboard); the last step exports the model (`trainer.export_dir`).

No explorer and no synchronizer take part: the job ends when the trainer reports its final STOPPED.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from rolectl.roles.config import JobConfig
from rolectl.roles.resume import StartMode
from rolectl.roles.session import JobIncomplete, MemberSession, finish_before_stopping
from rolectl.roles.trainer import export_hf, gpu_memory_metrics, saved_trainer_state, write_trainer_state
from rolectl.sync_protocol import Role, RunningStatus, StepFinished

__all__ = ["StageData", "StagePlan", "StageRunner", "STAGE_DATA", "stage_section", "stage_loss"]


class StageData(Protocol):
    """What a trainer-only stage trains on and is evaluated with, tokenized (`roles.engines.sft.SFTData`
    for `sft`). A new stage implements it and registers its builder in `STAGE_DATA`."""

    loss: Any
    """The stage's `LossFunction`."""

    def __len__(self) -> int:
        """Training rows."""

    def batch(self, rows: Sequence[int]) -> Any:
        """The `TrainBatch` of these training rows."""

    def eval_batches(self, size: int) -> list[Any]:
        """The held-out rows as `TrainBatch`es of at most `size` rows (empty: no eval file)."""

    def eval_tasks(self) -> list[Any]:
        """The held-out rows with an answer, as `Task`s a greedy generation is scored on."""


def _sft_data(cfg: JobConfig, tokenizer: Any) -> StageData:
    from rolectl.roles.engines.sft import SFTData

    return SFTData(cfg.sft, tokenizer)


def _sft_loss(cfg: JobConfig) -> Any:
    from rolectl.roles.engines.sft import SFTLoss

    return SFTLoss(cfg.sft.loss_agg_mode)


def _dpo_data(cfg: JobConfig, tokenizer: Any) -> StageData:
    from rolectl.roles.engines.dpo import DPOData

    return DPOData(cfg.dpo, tokenizer)


def _dpo_loss(cfg: JobConfig) -> Any:
    from rolectl.roles.engines.dpo import DPOLoss

    return DPOLoss(beta=cfg.dpo.beta, loss=cfg.dpo.loss)


STAGE_DATA: dict[str, tuple[Callable[[JobConfig, Any], StageData], Callable[[JobConfig], Any]]] = {
    "sft": (_sft_data, _sft_loss),
    "dpo": (_dpo_data, _dpo_loss),
}
"""Per stage name: (its data from the job and the engine's tokenizer, its loss from the job alone:
what every rank of a sharded trainer builds)."""


def stage_section(cfg: JobConfig) -> Any:
    """The job's stage section (`sft:`)."""
    return getattr(cfg, cfg.stage)


def stage_loss(cfg: JobConfig) -> Any:
    """The stage's loss function, as every rank builds it."""
    return STAGE_DATA[cfg.stage][1](cfg)


class StagePlan:
    """Which rows each train step takes: epoch `e` is a permutation of the rows drawn from
    `(shuffle_seed, e)`, cut into batches of `batch_size` (the last may be smaller). Step `s`
    (0-based) is batch `s % steps_per_epoch` of epoch `s // steps_per_epoch`; `total_steps` is
    `epochs x steps_per_epoch`, or `cap` when that is fewer."""

    def __init__(self, rows: int, *, batch_size: int, epochs: int, shuffle_seed: int, cap: int | None = None) -> None:
        if rows == 0:
            raise ValueError("the stage's data file has no rows")
        self.rows, self.batch_size, self.shuffle_seed = rows, batch_size, shuffle_seed
        self.steps_per_epoch = math.ceil(rows / batch_size)
        self.total_steps = min(cap or epochs * self.steps_per_epoch, epochs * self.steps_per_epoch)
        self._order: tuple[int, list[int]] | None = None

    def rows_of(self, step: int) -> list[int]:
        """The rows train step `step` (0-based) trains on."""
        epoch, index = divmod(step, self.steps_per_epoch)
        return self.order(epoch)[index * self.batch_size:(index + 1) * self.batch_size]

    def order(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            order = list(range(self.rows))
            random.Random(f"stage/{self.shuffle_seed}/{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def position(self, steps_done: int) -> dict[str, Any]:
        """Where the walk stands after `steps_done` steps, JSON-able (kept with each checkpoint)."""
        epoch, batch = divmod(steps_done, self.steps_per_epoch)
        return {"rows": self.rows, "batch_size": self.batch_size, "shuffle_seed": self.shuffle_seed,
                "epoch": epoch, "batch": batch, "epochs_done": round(self.epochs_done(steps_done), 6)}

    def epochs_done(self, steps_done: int) -> float:
        """Epochs trained after `steps_done` steps (rows seen / rows)."""
        epoch, batch = divmod(steps_done, self.steps_per_epoch)
        return epoch + min(batch * self.batch_size, self.rows) / self.rows

    def check(self, saved: dict[str, Any], *, where: str) -> None:
        """Refuse to resume a walk over other data: the saved rows, batch size and seed are ours."""
        mine = {k: v for k, v in self.position(0).items() if k in ("rows", "batch_size", "shuffle_seed")}
        theirs = {k: saved.get(k) for k in mine}
        if mine != theirs:
            raise ValueError(f"{where}: the checkpoint walked {theirs}, this job {mine}: the data file or the "
                             "stage's batch_size / shuffle_seed changed; start fresh (--fresh) or restore them")


class StageRunner:
    """The trainer member of a trainer-only stage; `run()` trains the stage to its end."""

    def __init__(self, cfg: JobConfig, member_id: str = "trainer", *, start_mode: StartMode = StartMode.AUTO,
                 engine: Any = None) -> None:
        from rolectl.roles.engines import make_train_engine

        self.cfg = cfg
        self.member_id = member_id
        self.start_mode = start_mode
        self.section = stage_section(cfg)
        self.engine = engine if engine is not None else make_train_engine(cfg)
        self.data = STAGE_DATA[cfg.stage][0](cfg, self.engine.tokenizer)
        self.plan = StagePlan(len(self.data), batch_size=self.section.batch_size, epochs=self.section.epochs,
                              shuffle_seed=self.section.shuffle_seed, cap=self.section.max_steps)
        self.total_steps = self.plan.total_steps
        updates = self.total_steps * self.engine.config.minibatches  # optimizer steps the schedule spans
        warmup = (self.section.warmup_steps if self.section.warmup_steps is not None
                  else int(self.section.warmup_ratio * updates))
        self.engine.set_lr_schedule(self.section.lr_schedule, warmup_steps=warmup, total_steps=updates,
                                    min_lr_ratio=self.section.min_lr_ratio)
        self.ckpt_dir = cfg.trainer_checkpoint_dir
        self.save_interval = cfg.trainer.save_interval
        self.totals = {"tokens": 0.0, "rows": 0.0}  # trained so far (kept with each checkpoint)
        self.last_metrics: dict | None = None
        self.evaluator: Evaluator | None = None  # built at the first eval that generates
        self.session: MemberSession | None = None
        self.log: Any = None

    # -- setup -------------------------------------------------------------------------------------
    async def _setup(self, session: MemberSession) -> int:
        """Resume (or not), join; the step the stream last heard of from this member."""
        self.session, self.log = session, session.log
        await session.view.start()
        await session.refuse_if_live()
        state = saved_trainer_state(self.cfg, self.member_id, session.view, self.start_mode, self.log)
        if state is not None:
            self.engine.load_checkpoint(self.ckpt_dir / state["checkpoint"])
            self.plan.check(state["position"], where=str(self.ckpt_dir))
            self.totals = dict(state["totals"])
            self.last_metrics = state.get("metrics")
        previous = session.view.member(Role.TRAINER, self.member_id)
        await session.join(step=self.engine.step, version=self.engine.step)
        self.log.info("stage_ready", stage=self.cfg.stage, step=self.engine.step, total_steps=self.total_steps,
                      rows=self.plan.rows, steps_per_epoch=self.plan.steps_per_epoch)
        return previous.step if previous is not None else 0

    async def run(self) -> None:
        async with MemberSession(self.cfg, Role.TRAINER, self.member_id) as session:
            reported = await self._setup(session)
            try:
                if self.engine.step > reported and self.last_metrics is not None:
                    await self._step_finished(self.last_metrics)  # saved, not yet reported: report it once
                await self.train()
            finally:
                await self._cleanup()
            if self.engine.step < self.total_steps:
                raise JobIncomplete(f"stage {self.cfg.stage} stopped after step {self.engine.step} of "
                                    f"{self.total_steps}")

    # -- loop --------------------------------------------------------------------------------------
    async def train(self) -> None:
        while self.engine.step < self.total_steps:
            # as the RL trainer: a stop waits for the step in flight to be trained, saved and reported
            await finish_before_stopping(self._train_step(), log=self.log,
                                         what=f"train step {self.engine.step + 1}: train, save, report",
                                         unless=lambda: self.session.replaced_by is not None)

    async def _train_step(self) -> None:
        await self.session.fence()
        batch = self.data.batch(self.plan.rows_of(self.engine.step))
        metrics = await asyncio.to_thread(self.engine.train_batch, batch, self.data.loss)
        self.session.step = self.session.version = self.engine.step
        stage = self.cfg.stage
        self.totals["tokens"] += metrics["tokens"]
        self.totals["rows"] += metrics["rows"]
        metrics.update({f"{stage}/epoch": self.plan.epochs_done(self.engine.step),
                        f"{stage}/tokens": self.totals["tokens"], f"{stage}/rows": self.totals["rows"],
                        "total_steps": float(self.total_steps), **gpu_memory_metrics()})
        if self._eval_due():
            metrics.update(await self._evaluate())
        self.last_metrics = metrics
        if self._save_due():
            await self._save()
        interval = self.cfg.trainer.hf_save_interval
        if interval and self.engine.step % interval == 0:
            await export_hf(self.engine, self.cfg, f"step-{self.engine.step}", self.log)
        await self._step_finished(metrics)

    def _eval_due(self) -> bool:
        interval = self.section.eval_interval
        return self.section.eval_path is not None and (
            self.engine.step == self.total_steps or (interval > 0 and self.engine.step % interval == 0))

    def _save_due(self) -> bool:
        return self.engine.step == self.total_steps or (
            self.save_interval > 0 and self.engine.step % self.save_interval == 0)

    async def _evaluate(self) -> dict[str, float]:
        """The held-out file's loss (and the loss's own figures, `dpo/eval_accuracy` ...), and each
        eval reward's mean over greedy generations."""
        started = time.monotonic()
        stage = self.cfg.stage
        figures: dict[str, float] = {}
        batches = self.data.eval_batches(self.section.batch_size)
        if batches:
            losses = [await asyncio.to_thread(self.engine.evaluate_batch, b, self.data.loss) for b in batches]
            sizes = [len(b) for b in batches]
            figures[f"{stage}/eval_loss"] = sum(r["loss"] * n for r, n in zip(losses, sizes)) / sum(sizes)
            own = {key for key in losses[0] if key.startswith(f"{stage}/") and key != f"{stage}/loss"}
            figures.update({f"{stage}/eval_{key.split('/', 1)[1]}": sum(r[key] * n for r, n in zip(losses, sizes))
                            / sum(sizes) for key in sorted(own)})
        tasks = self.data.eval_tasks()
        if tasks:
            self.evaluator = self.evaluator or Evaluator(self.cfg)
            rewards = await asyncio.to_thread(self.evaluator.rewards_of, self.engine, tasks)
            figures.update({f"{stage}/eval/{name}": mean for name, mean in rewards.items()})
        self.log.info("stage_eval", step=self.engine.step, seconds=round(time.monotonic() - started, 3),
                      **{k.split("/", 1)[1]: round(v, 4) for k, v in figures.items()})
        return figures

    async def _save(self) -> None:
        await self.session.fence()
        name = f"step-{self.engine.step}"
        await asyncio.to_thread(self.engine.save_checkpoint, self.ckpt_dir / name)
        write_trainer_state(self.ckpt_dir, {"checkpoint": name, "step": self.engine.step, "stage": self.cfg.stage,
                                            "position": self.plan.position(self.engine.step),
                                            "totals": self.totals, "metrics": self.last_metrics})

    async def _step_finished(self, metrics: dict) -> None:
        await self.session.publish(StepFinished(member=self.session.me, step=self.engine.step,
                                                version=self.engine.step, metrics=metrics))
        self.log.info("stage_step", stage=self.cfg.stage, step=self.engine.step, loss=round(metrics["loss"], 4),
                      lr=metrics["lr"], epoch=round(metrics[f"{self.cfg.stage}/epoch"], 3))

    async def _cleanup(self) -> None:
        """The final export (the job's end), STOPPED; a fenced runner only leaves."""
        if self.session.replaced_by is not None:
            self.log.error("trainer_fenced", step=self.engine.step)
            return
        finished = self.engine.step >= self.total_steps
        if finished:
            try:
                await export_hf(self.engine, self.cfg, "final", self.log)  # before the job is declared done
            except Exception as exc:
                self.log.error("hf_export_failed", error=str(exc))
                finished = False
        await self.session.set_status(RunningStatus.STOPPED, final=finished)
        self.log.info("stage_finished" if finished else "stage_stopped_early", step=self.engine.step,
                      total_steps=self.total_steps)


class Evaluator:
    """Greedy generations of the stage's model on eval tasks, scored by the eval rewards: a rollout
    engine of the job's kind (`hf`), on rank 0, loaded with the trainer's weights at each eval."""

    def __init__(self, cfg: JobConfig) -> None:
        from rolectl.roles.engines import make_rollout_engine
        from rolectl.roles.engines.rewards import parse_reward_specs

        self.engine = make_rollout_engine(cfg.with_overrides(model=cfg.model.replace(rollout_engine="hf",
                                                                                     init_from=None)), "trainer-eval")
        self.rewards = parse_reward_specs(list(eval_reward_names(cfg)))

    def rewards_of(self, trainer: Any, tasks: Sequence[Any]) -> dict[str, float]:
        from rolectl.roles.engines.rewards import score_all

        self.engine.load_weights(trainer.weights(), trainer.step)
        texts = self.engine.generate(tasks, temperature=0.0, samples=1, seed=0)
        totals = dict.fromkeys((reward.name for reward in self.rewards), 0.0)
        for task, (text,) in zip(tasks, texts):  # scored as every caller scores (a reward may read the row)
            for name, score in score_all(self.rewards, text, task)[1].items():
                totals[name] += score
        return {name: total / len(tasks) for name, total in totals.items()}


def eval_reward_names(cfg: JobConfig) -> tuple[str, ...]:
    """A stage's eval rewards: its `eval_rewards`, else `data.rewards`' names, else `exact_match`."""
    section = stage_section(cfg)
    if getattr(section, "eval_rewards", None):
        return tuple(section.eval_rewards)
    if cfg.data is not None:
        from rolectl.roles.engines.rewards import parse_reward_specs

        return tuple(r.name for r in parse_reward_specs(cfg.data.rewards))
    return ("exact_match",)
