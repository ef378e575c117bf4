"""The one training step every train engine runs: `TrainStep.train_batch(batch, loss_fn)`.

As verl's `BaseEngine.train_batch`: for each minibatch (a slice of the batch's groups), zero the
gradients, run forward and backward over micro-batches with the loss function it is given, clip,
skip the update if the loss or the gradient is not finite, else step the optimizer. The step is the
same at any number of ranks (torchtitan): each rank runs its share of each minibatch's rows, every
rank the same number of passes (a pass is a collective under FSDP), and the minibatch's loss is
summed over ranks; with one rank there is nothing to sum. Engines differ only in what they hand it:
a model and optimizer, a `Forward` (how the model scores a batch's rows), and their rank.

With an off-policy correction (`algorithm.rollout_correction`), one pass without gradient first
scores every row under the weights before the update (the proximal policy, decoupled PPO); the
correction compares them with the sampler's logprobs, gives importance weights and masks rejected
tokens, and its metrics join the step's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from rolectl.sync_protocol.experience import Experience

from .losses import LossFunction, LossSum, MicroBatch, TokenScores, TrainBatch

__all__ = ["Forward", "StepResult", "TrainStep", "micro_batches", "step_metrics", "stage_metrics", "lr_schedule"]


class Forward(Protocol):
    """How an engine's model scores rows of a batch: `(len(rows), width)` logprobs of their response
    tokens, and with `entropy` the entropy of the model's distribution at each (`width` at most the
    batch's). Only the tokens under `loss_mask` count: elsewhere (padding, a tool's tokens) a value
    may be anything, -inf included; the step sets it to 0 before a loss sees it."""

    def __call__(self, model: Any, batch: TrainBatch, rows: Sequence[int], *, entropy: bool) -> TokenScores: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    """What one `train_batch` did."""

    loss: float
    """Mean over the applied updates of their minibatch loss; 0.0 when none was applied."""
    grad_norm: float
    """Largest gradient norm (before clipping) of the applied updates."""
    updates_skipped: int
    """Updates dropped because their loss or gradient was not finite (the weights stayed)."""
    metrics: dict[str, float]
    """The loss function's metrics, averaged over every micro-batch of every rank, and the
    off-policy correction's, of the whole batch."""


Correction = Callable[..., tuple[Tensor | None, Tensor, dict[str, float]]]
"""`(proximal logprobs, behaviour logprobs, loss mask, *, on_policy=None) -> (importance weights or
None, loss mask with rejected tokens off, metrics)`, all `(rows, width)` (`algorithms.RolloutCorrection`)."""


def micro_batches(rows: Sequence[int], groups: Sequence[str], *, size: int | None, rank: int = 0,
                  world_size: int = 1, keep_groups: bool = False, max_tokens: int | None = None,
                  lengths: Sequence[int] | None = None) -> tuple[list[list[int]], int]:
    """This rank's micro-batches of a minibatch's `rows`, and how many passes every rank makes.

    Rows are dealt to ranks in turn, one at a time (with `keep_groups`, a group at a time), and each
    rank's cut into micro-batches of at most `size` rows (a group larger than that stands alone;
    `size` None: one micro-batch per rank).

    With a token budget `max_tokens` (verl's dynamic batch size), `lengths[row]` being the tokens a
    row's forward pads to: the rows (groups) are dealt longest first, each to the rank with the
    fewest tokens so far, and each rank's are sorted longest first and cut where a micro-batch would
    cost more than `max_tokens` counted as its padded forward costs them (rows x its longest row),
    or hold more than `size` rows. A row (group) over the budget alone stands alone.
    """
    if keep_groups:
        by_group: dict[str, list[int]] = {}
        for row in rows:
            by_group.setdefault(groups[row], []).append(row)
        units = list(by_group.values())
    else:
        units = [[row] for row in rows]
    if max_tokens is None:
        per_rank = [_pack(units[r::world_size], size) for r in range(world_size)]
    else:
        if lengths is None:
            raise ValueError("micro_batches: a token budget (max_tokens) needs each row's length (lengths)")
        longest = {id(unit): max(lengths[row] for row in unit) for unit in units}
        per_rank = [_pack_tokens(share, size, max_tokens, longest)
                    for share in _deal_by_tokens(units, longest, world_size)]
    return per_rank[rank], max(len(batches) for batches in per_rank)


def _pack(units: list[list[int]], size: int | None) -> list[list[int]]:
    packed: list[list[int]] = []
    current: list[int] = []
    for unit in units:
        if current and size is not None and len(current) + len(unit) > size:
            packed.append(current)
            current = []
        current = current + unit
    return [*packed, current] if current else packed


def _deal_by_tokens(units: list[list[int]], longest: dict[int, int], world_size: int) -> list[list[list[int]]]:
    """`units` dealt to `world_size` ranks, the costliest first (rows x longest row), each to the rank
    with the fewest tokens so far (the lowest rank of equals): longest-processing-time-first, as
    verl's `rearrange_micro_batches` balances its sequence-length partitions."""
    shares: list[list[list[int]]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for unit in sorted(units, key=lambda unit: -len(unit) * longest[id(unit)]):  # stable: equals keep row order
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(unit)
        loads[rank] += len(unit) * longest[id(unit)]
    return shares


def _pack_tokens(units: list[list[int]], size: int | None, max_tokens: int,
                 longest: dict[int, int]) -> list[list[int]]:
    """`units` sorted longest first and cut where a micro-batch would cost more than `max_tokens`
    (rows x its longest row: the first unit's, as they come longest first) or hold more than `size` rows."""
    packed: list[list[int]] = []
    current: list[int] = []
    width = 0
    for unit in sorted(units, key=lambda unit: -longest[id(unit)]):
        over_rows = size is not None and len(current) + len(unit) > size
        if current and (over_rows or (len(current) + len(unit)) * width > max_tokens):
            packed.append(current)
            current = []
        width = width if current else longest[id(unit)]
        current = current + unit
    return [*packed, current] if current else packed


class _MetricSums:
    """A loss function's metrics summed over this rank's micro-batches, and how many there were."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.count = 0

    def add(self, metrics: dict[str, float]) -> None:
        self.count += 1
        for key, value in metrics.items():
            self.sums[key] = self.sums.get(key, 0.0) + value


def _borrowed(rows: list[int], groups: Sequence[str], *, keep_groups: bool) -> list[int]:
    """The rows of an idle rank's pass: the minibatch's first row (its first group with `keep_groups`)."""
    return [row for row in rows if groups[row] == groups[rows[0]]] if keep_groups else rows[:1]


def _trained_only(values: Tensor, trained: Tensor) -> Tensor:
    """`values` where `trained`, else 0: a token the policy did not sample (a tool's, which the
    policy may give probability 0) reaches no loss, not even as 0 x -inf, and gets no gradient."""
    return torch.where(trained, values, torch.zeros((), dtype=values.dtype, device=values.device))


class TrainStep:
    """The training step of one engine's model: built once, run on every batch with a loss function.

    `minibatches` optimizer steps per batch, each over a slice of its groups; `micro_batch_size`
    rows per forward/backward (None: a rank's whole share in one pass); with `micro_batch_tokens`,
    also at most that many tokens per forward/backward, rows of like length together (counted as the
    padded forward costs them: rows x the longest's prompt and response; `micro_batches`), a
    different cut of the same loss. `reference` is the frozen
    model a loss that `needs_reference` is compared with. `rank`/`world_size` > 1: a sharded model
    whose ranks all call `train_batch` with the same batch. `correction`: the off-policy correction
    applied to every batch (None: PPO's ratio against the sampler's logprobs).
    """

    def __init__(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, forward: Forward,
                 max_grad_norm: float, minibatches: int, micro_batch_size: int | None, reference: Any = None,
                 rank: int = 0, world_size: int = 1, correction: Correction | None = None,
                 micro_batch_tokens: int | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.forward = forward
        self.max_grad_norm = max_grad_norm
        self.minibatches = minibatches
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.reference = reference
        self.rank, self.world_size = rank, world_size
        self.correction = correction
        self.scheduler: Any = None  # a torch LR scheduler stepped after each optimizer step (`lr_schedule`)

    def train_batch(self, batch: TrainBatch, loss_fn: LossFunction) -> StepResult:
        """One optimizer step per minibatch of `batch`, on `loss_fn`; every rank passes the same batch."""
        if loss_fn.needs_reference and self.reference is None:
            name = str(loss_fn) if isinstance(loss_fn, LossSum) else type(loss_fn).__name__
            raise ValueError(f"the loss {name} needs a frozen reference model and this engine has none "
                             "(it keeps one when algorithm.kl_coef > 0, and for `stage: dpo`)")
        batch, corrected = self._corrected(batch)
        group_order = list(dict.fromkeys(batch.groups))
        count = min(self.minibatches, len(group_order))
        losses, grad_norms, skipped = [], [], 0
        measured = _MetricSums()
        for index in range(count):
            chosen = set(group_order[index::count])
            rows = [row for row, group in enumerate(batch.groups) if group in chosen]
            if not batch.loss_mask[rows].any():
                continue  # no token the policy sampled (every episode failed at once): nothing to learn
            self.optimizer.zero_grad(set_to_none=True)
            minibatch_loss = self._forward_backward(batch, rows, loss_fn, measured)
            grad_norm = self._clip_gradients()
            if not (math.isfinite(minibatch_loss) and math.isfinite(grad_norm)):
                # a non-finite loss or gradient would poison the weights: skip this update, count it
                self.optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            grad_norms.append(grad_norm)
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            losses.append(minibatch_loss)
        return StepResult(loss=sum(losses) / len(losses) if losses else 0.0, grad_norm=max(grad_norms, default=0.0),
                          updates_skipped=skipped, metrics={**self._averaged(measured), **corrected})

    def _corrected(self, batch: TrainBatch) -> tuple[TrainBatch, dict[str, float]]:
        """`batch` with the off-policy correction's proximal logprobs, weights and mask, and its metrics."""
        if self.correction is None or not batch.loss_mask.any():
            return batch, {}
        proximal = self._proximal_logprobs(batch)
        weights, mask, metrics = self.correction(proximal, batch.old_logprobs, batch.loss_mask,
                                                 on_policy=batch.on_policy)
        return dataclasses.replace(batch, proximal_logprobs=proximal, is_weights=weights, loss_mask=mask), metrics

    def _proximal_logprobs(self, batch: TrainBatch) -> Tensor:
        """Every row's logprobs under the weights before the update, without gradient, 0 where
        `loss_mask` is: each rank scores its share (all making the same passes), and the ranks add
        their shares up, so every rank holds the whole batch's."""
        rows = list(range(len(batch)))
        mine, passes = self._micro_batches(batch, rows, keep_groups=False)
        proximal = torch.zeros_like(batch.old_logprobs)
        with torch.no_grad():
            for index in range(passes):
                real = index < len(mine)
                micro = mine[index] if real else _borrowed(rows, batch.groups, keep_groups=False)
                logprobs = self.forward(self.model, batch, micro, entropy=False).logprobs
                if real:
                    width = logprobs.shape[1]
                    trained = batch.loss_mask[micro, :width].to(logprobs.device)
                    proximal[micro, :width] = _trained_only(logprobs, trained).float().cpu()
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(proximal, op=dist.ReduceOp.SUM)  # the rows are dealt once: a sum gathers them
        return proximal

    def evaluate_batch(self, batch: TrainBatch, loss_fn: LossFunction) -> StepResult:
        """`loss_fn` on the whole of `batch` as one minibatch, without gradients or an update (a
        held-out file's loss); every rank passes the same batch and gets the same figures."""
        measured = _MetricSums()
        training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                loss = self._forward_backward(batch, list(range(len(batch))), loss_fn, measured, backward=False)
        finally:
            self.model.train(training)
        return StepResult(loss=loss, grad_norm=0.0, updates_skipped=0, metrics=self._averaged(measured))

    def _forward_backward(self, batch: TrainBatch, rows: list[int], loss_fn: LossFunction,
                          measured: _MetricSums, *, backward: bool = True) -> float:
        """Accumulate this rank's gradients of one minibatch (`backward`); its loss summed over
        ranks. Each real micro-batch's metrics go to `measured`."""
        mine, passes = self._micro_batches(batch, rows, keep_groups=loss_fn.keeps_groups)
        tokens = int(batch.loss_mask[rows].sum())
        local_loss = 0.0
        for index in range(passes):
            # A rank out of rows still makes the pass (a collective), on borrowed rows, its loss zeroed.
            real = index < len(mine)
            micro = mine[index] if real else _borrowed(rows, batch.groups, keep_groups=loss_fn.keeps_groups)
            loss, metrics = loss_fn(self._micro_batch(batch, micro, loss_fn, tokens=tokens, sequences=len(rows),
                                                      minibatch=rows))
            if not real:
                loss = loss * 0.0
            if backward:
                loss.backward()
            if real:
                local_loss += float(loss.detach())
                measured.add(metrics)
        return self._sum_over_ranks([local_loss])[0]

    def _micro_batches(self, batch: TrainBatch, rows: list[int], *, keep_groups: bool) -> tuple[list[list[int]], int]:
        """This rank's micro-batches of `rows` and every rank's passes (`micro_batches`); a row's
        length is its prompt and response, the width a causal LM's forward pads it to."""
        lengths = None
        if self.micro_batch_tokens is not None:
            lengths = [len(prompt) + len(response) for prompt, response in zip(batch.prompts, batch.responses)]
        return micro_batches(rows, batch.groups, size=self.micro_batch_size, rank=self.rank,
                             world_size=self.world_size, keep_groups=keep_groups,
                             max_tokens=self.micro_batch_tokens, lengths=lengths)

    def _micro_batch(self, batch: TrainBatch, rows: list[int], loss_fn: LossFunction, *, tokens: int,
                     sequences: int, minibatch: list[int]) -> MicroBatch:
        scores = self.forward(self.model, batch, rows, entropy=True)
        trained = batch.loss_mask[rows, :scores.logprobs.shape[1]].to(scores.logprobs.device)
        ref_logprobs = None
        if loss_fn.needs_reference:
            with torch.no_grad():
                ref_logprobs = _trained_only(self.forward(self.reference, batch, rows, entropy=False).logprobs,
                                             trained)
        entropy = None if scores.entropy is None else _trained_only(scores.entropy, trained)
        return MicroBatch(batch=batch, rows=rows, logprobs=_trained_only(scores.logprobs, trained),
                          ref_logprobs=ref_logprobs, num_tokens=tokens, num_sequences=sequences, entropy=entropy,
                          minibatch=minibatch)

    def _clip_gradients(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        full = getattr(norm, "full_tensor", None)  # a sharded model's norm is a DTensor
        return float(full() if full is not None else norm)

    def _averaged(self, measured: _MetricSums) -> dict[str, float]:
        """The metrics' means over every rank's micro-batches."""
        keys = sorted(measured.sums)  # every rank reduces in the same order
        *totals, count = self._sum_over_ranks([measured.sums[k] for k in keys] + [float(measured.count)])
        by_key = dict(zip(keys, totals))
        return {key: by_key[key] / max(count, 1.0) for key in measured.sums}

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        if self.world_size == 1:
            return values
        import torch.distributed as dist

        buffer = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM)  # CPU tensor: gloo (beside NCCL on GPUs)
        return buffer.tolist()


def step_metrics(result: StepResult, batch: TrainBatch, experiences: Sequence[Experience], *,
                 current_version: int, updates_skipped: int) -> dict[str, float]:
    """A train step's figures: its loss and gradient, the batch's rewards, staleness, response
    lengths and size, the response tokens it trained on (`trained_tokens`: those the policy
    sampled) and those it did not (`masked_tokens`: an environment's, a tool's, the template's),
    and the loss function's metrics. Engines add their model's figures."""
    staleness = [current_version - e.model_version for e in experiences]
    trained = sum(e.trained_tokens for e in experiences)
    return {
        "loss": result.loss,
        "updates_skipped_nonfinite": float(updates_skipped),
        "reward_mean": float(batch.rewards.mean()),
        "reward_std": float(batch.rewards.std(correction=0)),
        "reward_max": float(batch.rewards.max()),
        "staleness_mean": sum(staleness) / len(staleness),
        "staleness_max": float(max(staleness)),
        "response_length_mean": float(torch.tensor([float(len(e.response)) for e in experiences]).mean()),
        "num_experiences": float(len(experiences)),
        "trained_tokens": float(trained),
        "masked_tokens": float(sum(len(e.response) for e in experiences) - trained),
        "grad_norm": result.grad_norm,
        **result.metrics,
    }


def stage_metrics(result: StepResult, batch: TrainBatch, *, lr: float, updates_skipped: int) -> dict[str, float]:
    """A trainer-only stage's step figures: its loss and gradient, the learning rate it stepped with,
    the rows and trained tokens of its batch, and the loss function's metrics."""
    return {
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "lr": lr,
        "updates_skipped_nonfinite": float(updates_skipped),
        "rows": float(len(batch)),
        "tokens": float(batch.loss_mask.sum()),
        **result.metrics,
    }


def _lr_factor(step: int, *, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The share of the base learning rate at optimizer step `step`: a linear warm-up from 0, then
    constant, or a linear or cosine decay to `min_lr_ratio` at `total_steps`."""
    if step < warmup_steps:
        return step / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def lr_schedule(optimizer: torch.optim.Optimizer, schedule: str, *, warmup_steps: int, total_steps: int,
                min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    """torch's `LambdaLR` over `optimizer` with `_lr_factor`: its state (`state_dict`) is numbers only,
    so a checkpoint keeps it as JSON and a resumed stage steps on from where it was."""
    if schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"unknown lr schedule {schedule!r}; use constant, linear or cosine")
    factor = functools.partial(_lr_factor, schedule=schedule, warmup_steps=warmup_steps, total_steps=total_steps,
                               min_lr_ratio=min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class StageTraining:
    """The steps the `hf` and `fsdp` engines share on top of their `TrainStep` (`self.update`),
    `optimizer`, `step` and counters: an RL step on experiences (with the demonstrations
    `trainer.expert_data` mixes in: `self.expert`, or None), and for a trainer-only stage
    (`roles.stage`) train or evaluate one `TrainBatch` with a given loss and a learning-rate
    schedule kept in its checkpoints."""

    update: TrainStep
    optimizer: torch.optim.Optimizer
    step: int
    updates_skipped_nonfinite: int
    algorithm: Any  # the `algorithm:` section: its advantage estimator
    loss_fn: LossFunction  # the RL loss (policy loss, plus the KL penalty when asked)
    expert: Any = None

    def train_step(self, experiences: Sequence[Experience], *, current_version: int) -> dict[str, float]:
        """One RL step: the one training step on `experiences` (this rank's share of each minibatch;
        every rank passes the same experiences and gets the whole batch's metrics)."""
        batch, trained, loss_fn = self._rl_batch(experiences, self.algorithm.advantages, self.loss_fn,
                                                 current_version=current_version)
        result = self.update.train_batch(trained, loss_fn)
        self.step += 1
        self.updates_skipped_nonfinite += result.updates_skipped
        return {**step_metrics(result, batch, experiences, current_version=current_version,
                               updates_skipped=self.updates_skipped_nonfinite),
                **({"expert_rows": float(len(trained) - len(batch))} if trained is not batch else {}),
                **self.model_figures()}

    def set_lr_schedule(self, schedule: str, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> None:
        """From now on the learning rate follows `schedule` over `total_steps` optimizer steps (see
        `lr_schedule`); every rank sets the same."""
        self.update.scheduler = lr_schedule(self.optimizer, schedule, warmup_steps=warmup_steps,
                                            total_steps=total_steps, min_lr_ratio=min_lr_ratio)

    def train_batch(self, batch: TrainBatch, loss_fn: LossFunction) -> dict[str, float]:
        """One train step of a stage: the one training step on `batch` with `loss_fn`; its figures
        (`stage_metrics`) and the model's. Every rank passes the same batch."""
        lr = float(self.optimizer.param_groups[0]["lr"])
        result = self.update.train_batch(batch, loss_fn)
        self.step += 1
        self.updates_skipped_nonfinite += result.updates_skipped
        return {**stage_metrics(result, batch, lr=lr, updates_skipped=self.updates_skipped_nonfinite),
                **self.model_figures()}

    def evaluate_batch(self, batch: TrainBatch, loss_fn: LossFunction) -> dict[str, float]:
        """`loss_fn`'s loss (and metrics) on `batch`, nothing trained."""
        result = self.update.evaluate_batch(batch, loss_fn)
        return {"loss": result.loss, **result.metrics}

    def model_figures(self) -> dict[str, float]:
        """The model's own figures beside a step's (parameters; ranks)."""
        return {}

    def _rl_batch(self, experiences: Sequence[Experience], advantages: Any, loss_fn: LossFunction, *,
                  current_version: int | None = None) -> tuple[TrainBatch, TrainBatch, LossFunction]:
        """(the experiences' batch, what is trained: with `trainer.expert_data` the demonstrations of
        this step beside them, and the loss for it)."""
        from .losses import experience_batch

        batch = experience_batch(experiences, advantages, current_version=current_version)
        if self.expert is None:
            return batch, batch, loss_fn
        return batch, self.expert.batch(batch, self.step), self.expert.loss

    def scheduler_state(self) -> dict[str, Any] | None:
        """The learning-rate schedule's position, JSON-able (None: no schedule)."""
        scheduler = self.update.scheduler
        return None if scheduler is None else scheduler.state_dict()

    def load_scheduler_state(self, state: dict[str, Any] | None) -> None:
        if state is not None and self.update.scheduler is not None:
            self.update.scheduler.load_state_dict(state)
