"""The tiny policy's generation as an inference engine does it: a KV cache, rows of any prompt length
and continuous batching (a finished row leaves at once; new rows join between tokens).

`GenerationPool` prefills newly admitted rows (grouped by length: no row is padded), then decodes
one token per live row per forward, each row attending to its own cached positions. New weights
make every cached key/value stale: the next step re-prefills the live rows (as vLLM recomputes a
preempted sequence), and each token records the version that sampled it. `GroupedGenerations`
tracks a task's `group_size` rows and hands out whole groups in the order they finished.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .model import KVCache, TinyPolicy, _masked_log_softmax

__all__ = ["GenerationPool", "GenerationRow", "GroupedGenerations", "FinishedGroup", "row_seed"]


def row_seed(*parts: int) -> int:
    """A row's sampling seed from the integers that name it (e.g. sampling seed, step, task, k)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


@dataclass(slots=True, eq=False)
class GenerationRow:
    """One sequence being generated: its prompt, the tokens so far with their logprobs and the
    weights version that sampled each, and its own Gumbel noise (one draw per token, so it samples
    the same tokens whatever else is in the batch)."""

    key: Hashable
    prompt: tuple[int, ...]
    max_new_tokens: int
    noise: Tensor | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stopped: bool = False


class GenerationPool:
    """The rows in flight on one policy, their KV cache aligned with them, one token per `step`."""

    def __init__(self, policy: TinyPolicy, *, allowed_tokens: Tensor, stop_tokens: Sequence[int],
                 temperature: float) -> None:
        self.policy = policy
        self.allowed_tokens = allowed_tokens
        self.stop_tokens = frozenset(stop_tokens)
        self.temperature = temperature
        self.rows: list[GenerationRow] = []
        self._cache = KVCache(policy, 0)
        self._stale: list[bool] = []  # per row: its cache must be (re)computed before its next token
        self._weights_epoch: int | None = None
        self.forwards = 0  # policy forwards so far (prefill groups and decodes)

    @property
    def live(self) -> int:
        return len(self.rows)

    def admit(self, key: Hashable, prompt: Sequence[int], *, max_new_tokens: int, seed: int) -> None:
        """A new row: `prompt` continued by at most `max_new_tokens`, sampled from `seed`'s noise."""
        if max_new_tokens < 1 or len(prompt) + max_new_tokens > self.policy.max_seq_len or not prompt:
            raise ValueError(f"row {key!r}: a prompt of {len(prompt)} tokens and {max_new_tokens} new ones do not fit "
                             f"the tiny policy's {self.policy.max_seq_len} positions (prompt_length + response)")
        noise = None
        if self.temperature != 0:
            uniform = torch.rand((max_new_tokens, self.policy.head.out_features),
                                 generator=torch.Generator().manual_seed(seed))
            noise = -torch.log(-torch.log(uniform.clamp(min=1e-20)))
        self.rows.append(GenerationRow(key=key, prompt=tuple(prompt), max_new_tokens=max_new_tokens, noise=noise))
        self._stale.append(True)  # its cache rows are allocated at the next step, all admitted at once

    def clear(self) -> list[GenerationRow]:
        """Drop every row in flight; returns them."""
        dropped, self.rows, self._stale = self.rows, [], []
        self._cache = KVCache(self.policy, 0)
        return dropped

    @torch.no_grad()
    def step(self, *, version: int, weights_epoch: int) -> list[GenerationRow]:
        """One token for every live row, sampled by the weights `weights_epoch` names (a new epoch
        recomputes every row's cache first); returns the rows that finished (they leave the pool)."""
        if not self.rows:
            return []
        if len(self._cache) < len(self.rows):
            self._cache.extend(KVCache(self.policy, len(self.rows) - len(self._cache)))
        if weights_epoch != self._weights_epoch:
            self._stale = [True] * len(self.rows)
            self._weights_epoch = weights_epoch
        logits = torch.empty(len(self.rows), self.policy.head.out_features, dtype=self.policy.head.weight.dtype)
        self._prefill(logits)
        self._decode(logits)
        return self._sample(logits, version)

    def run_to_end(self, *, version: int, weights_epoch: int) -> Iterator[GenerationRow]:
        """`step` until no row is left, each row as it finishes."""
        while self.rows:
            yield from self.step(version=version, weights_epoch=weights_epoch)

    def _prefill(self, logits: Tensor) -> None:
        """Compute the cache of the stale rows from their whole sequence, rows of one length together."""
        by_length: dict[int, list[int]] = defaultdict(list)
        for index, row in enumerate(self.rows):
            if self._stale[index]:
                by_length[len(row.prompt) + len(row.tokens)].append(index)
        for indices in by_length.values():
            sequences = torch.tensor([[*self.rows[i].prompt, *self.rows[i].tokens] for i in indices])
            fresh = KVCache(self.policy, len(indices))
            logits[indices] = self.policy.forward_cached(sequences, fresh)[:, -1]
            self._cache.assign(torch.tensor(indices), fresh)
            self.forwards += 1
        self._stale = [False] * len(self.rows)  # only rows admitted after this step are stale

    def _decode(self, logits: Tensor) -> None:
        """One forward over the rows whose cache holds all but their last sampled token."""
        cached = self._cache.lengths.tolist()
        behind = [i for i, row in enumerate(self.rows) if row.tokens and
                  cached[i] == len(row.prompt) + len(row.tokens) - 1]
        if not behind:
            return
        last = torch.tensor([[self.rows[i].tokens[-1]] for i in behind])
        if len(behind) == len(self.rows):
            logits[:] = self.policy.forward_cached(last, self._cache)[:, -1]
        else:  # some rows were prefilled this step: decode the others on a copy of their cache
            rows = torch.tensor(behind)
            cache = self._cache.select(rows)
            logits[rows] = self.policy.forward_cached(last, cache)[:, -1]
            self._cache.assign(rows, cache)
        self.forwards += 1

    def _sample(self, logits: Tensor, version: int) -> list[GenerationRow]:
        # temperature 0 is greedy: the most likely allowed token (its logprob at temperature 1)
        logprobs = _masked_log_softmax(logits, self.allowed_tokens, self.temperature or 1.0)
        if self.temperature == 0:
            picked = logprobs.argmax(-1)
        else:
            noise = torch.stack([row.noise[len(row.tokens)] for row in self.rows])  # type: ignore[index]
            picked = (logprobs + noise).argmax(-1)
        chosen = logprobs.gather(-1, picked.unsqueeze(-1)).squeeze(-1)
        finished, keep = [], []
        for index, (row, token, logprob) in enumerate(zip(self.rows, picked.tolist(), chosen.tolist())):
            row.tokens.append(token)
            row.logprobs.append(logprob)
            row.versions.append(version)
            row.stopped = token in self.stop_tokens
            if row.stopped or len(row.tokens) >= row.max_new_tokens:
                finished.append(row)
            else:
                keep.append(index)
        if finished:  # continuous batching: a finished row costs nothing more
            self.rows = [self.rows[i] for i in keep]
            self._stale = [self._stale[i] for i in keep]
            self._cache.keep(torch.tensor(keep, dtype=torch.long))
        return finished


@dataclass(slots=True, eq=False)
class FinishedGroup:
    """A task's whole group of rows, in `k` order."""

    name: str
    task_index: int
    payload: object
    rows: list[GenerationRow]


@dataclass(slots=True, eq=False)
class _OpenGroup:
    name: str
    task_index: int
    payload: object
    admitted: int
    rows: list[GenerationRow | None]
    finished_at: int | None = None


class GroupedGenerations:
    """Groups of rows on a `GenerationPool`: `admit` a group's rows, `collect` whole groups, the
    earliest finished first (ties: admission order); the rest stay in flight."""

    def __init__(self, pool: GenerationPool) -> None:
        self.pool = pool
        self._open: dict[str, _OpenGroup] = {}
        self._admitted = 0
        self._tick = 0

    def admit(self, name: str, *, task_index: int, payload: object, prompt: Sequence[int], seeds: Sequence[int],
              max_new_tokens: int) -> None:
        """`len(seeds)` rows of `prompt` as group `name` (a name in flight may not be reused)."""
        if name in self._open:
            raise ValueError(f"group {name!r} is already in flight")
        for k, seed in enumerate(seeds):
            self.pool.admit((name, k), prompt, max_new_tokens=max_new_tokens, seed=seed)
        self._open[name] = _OpenGroup(name, task_index, payload, self._admitted, [None] * len(seeds))
        self._admitted += 1

    @property
    def in_flight(self) -> int:
        return len(self._open)

    def finished(self) -> int:
        return sum(group.finished_at is not None for group in self._open.values())

    def step(self, *, version: int, weights_epoch: int) -> None:
        self._tick += 1
        for row in self.pool.step(version=version, weights_epoch=weights_epoch):
            name, k = row.key  # type: ignore[misc]
            group = self._open[name]
            group.rows[k] = row
            if all(r is not None for r in group.rows):
                group.finished_at = self._tick

    def take(self, groups: int) -> list[FinishedGroup]:
        """Up to `groups` finished groups, earliest finished first (ties: admission order)."""
        done = sorted((g for g in self._open.values() if g.finished_at is not None),
                      key=lambda g: (g.finished_at, g.admitted))[:max(groups, 0)]
        for group in done:
            del self._open[group.name]
        return [FinishedGroup(g.name, g.task_index, g.payload, list(g.rows)) for g in done]  # type: ignore[arg-type]

    def abandon(self) -> int:
        dropped = len(self._open)
        self._open.clear()
        self.pool.clear()
        return dropped
