"""The reference task: reverse a digit string, scored 0..1 with partial credit per position.

Token layout (vocabulary of 14): digits 0-9 are their own ids, then BOS, SEP, EOS, PAD.
A prompt is `BOS d1 .. dL SEP`; the expected response is `dL .. d1 EOS`.

A job with an `agent:` section plays multi-turn episodes over a vocabulary of 15: the same and
QUERY, a token the model may sample to ask its environment, which ends its turn as EOS does (the
environment answers; `roles.engines.agent.render.TinyRenderer`).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from .base import Task

__all__ = [
    "BOS",
    "SEP",
    "EOS",
    "PAD",
    "VOCAB_SIZE",
    "RESPONSE_TOKENS",
    "QUERY",
    "AGENT_VOCAB_SIZE",
    "AGENT_RESPONSE_TOKENS",
    "ReverseDigitsTaskSet",
    "make_reverse_task",
    "score_response",
]

BOS, SEP, EOS, PAD = 10, 11, 12, 13
VOCAB_SIZE = 14
# A response may only contain digits and EOS; samplers and the trainer mask the rest the same way.
RESPONSE_TOKENS = tuple(range(10)) + (EOS,)
# An agent's episodes add one token the model may sample: the query (its environment answers it).
QUERY = 14
AGENT_VOCAB_SIZE = 15
AGENT_RESPONSE_TOKENS = RESPONSE_TOKENS + (QUERY,)


def make_reverse_task(task_id: str, digits: Sequence[int], *, prompt_length: int | None = None) -> Task:
    """The task of reversing `digits`; with `prompt_length`, its prompt left-padded with PAD to that
    many tokens (for a sampler whose rows must share one prompt length; the engines' need not)."""
    prompt = (BOS, *digits, SEP)
    if prompt_length is not None:
        if len(prompt) > prompt_length:
            raise ValueError(f"{len(digits)} digits do not fit a prompt of {prompt_length} tokens")
        prompt = (PAD,) * (prompt_length - len(prompt)) + prompt
    return Task(id=task_id, prompt=prompt, target=tuple(reversed(digits)))


def score_response(response: Sequence[int], target: Sequence[int]) -> float:
    """Fraction of target positions answered correctly.

    The answer is the response up to its first EOS. Dividing by the longer of answer and target
    makes padding an answer with extra digits cost credit instead of being free.
    """
    answer = list(response)
    if EOS in answer:
        answer = answer[: answer.index(EOS)]
    if not target:
        return 1.0 if not answer else 0.0
    correct = sum(a == t for a, t in zip(answer, target))
    return correct / max(len(answer), len(target))


class ReverseDigitsTaskSet:
    """Batches of random digit strings to reverse; batch `i` depends only on `(seed, i)`.

    Because a batch is a function of its index, the whole position is one integer: an explorer that
    restarts from `state_dict()` sees exactly the batches it would have seen.

    With `long_fraction` > 0 the lengths are long-tailed, as a reasoning model's responses are: each
    task is `long_length` digits with that probability, else `length`, and its prompt is just its
    own (the engines generate and train on rows of any prompt length: padding a 2-digit task's prompt
    to a 20-digit one's would be pure waste). Without, the stream is as it always was.
    """

    def __init__(
        self, *, seed: int, tasks_per_batch: int, length: int, num_batches: int | None = None,
        long_length: int | None = None, long_fraction: float = 0.0,
    ) -> None:
        if tasks_per_batch < 1 or length < 1:
            raise ValueError(f"tasks_per_batch and length must be >= 1, got {tasks_per_batch}, {length}")
        if not 0.0 <= long_fraction <= 1.0 or (long_fraction > 0 and (long_length or 0) <= length):
            raise ValueError(f"long_fraction must be in [0, 1] and, when above 0, long_length more than length "
                             f"({length}), got {long_fraction} and {long_length}")
        self.seed = seed
        self.tasks_per_batch = tasks_per_batch
        self.length = length
        self.long_length = long_length if long_fraction > 0 else None
        self.long_fraction = long_fraction
        self.num_batches = num_batches
        self.next_index = 0

    def _task(self, rng: random.Random, task_id: str) -> Task:
        if self.long_length is None:  # no draw for the length: the stream of a job without long tasks
            return make_reverse_task(task_id, [rng.randrange(10) for _ in range(self.length)])
        length = self.long_length if rng.random() < self.long_fraction else self.length
        return make_reverse_task(task_id, [rng.randrange(10) for _ in range(length)])

    def next_batch(self) -> list[Task] | None:
        if self.num_batches is not None and self.next_index >= self.num_batches:
            return None
        index = self.next_index
        rng = random.Random(f"reverse-digits/{self.seed}/{index}")
        batch = [self._task(rng, f"s{self.seed}-b{index}-t{i}") for i in range(self.tasks_per_batch)]
        self.next_index += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "next_index": self.next_index}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"task set state is for seed {state['seed']}, this set has seed {self.seed}")
        self.next_index = int(state["next_index"])
