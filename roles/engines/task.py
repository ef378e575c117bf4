"""The reference task: reverse a digit string, scored 0..1 with partial credit per position.

Token layout (vocabulary of 14): digits 0-9 are their own ids, then BOS, SEP, EOS, PAD.
A prompt is `BOS d1 .. dL SEP`; the expected response is `dL .. d1 EOS`.

A job with an `agent:` section plays multi-turn episodes over a vocabulary of 15: the same and
QUERY, a token the model may sample to ask its environment (`roles.engines.agent.render.TinyRenderer`).
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


def make_reverse_task(task_id: str, digits: Sequence[int]) -> Task:
    return Task(id=task_id, prompt=(BOS, *digits, SEP), target=tuple(reversed(digits)))


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
    """

    def __init__(
        self, *, seed: int, tasks_per_batch: int, length: int, num_batches: int | None = None
    ) -> None:
        if tasks_per_batch < 1 or length < 1:
            raise ValueError(f"tasks_per_batch and length must be >= 1, got {tasks_per_batch}, {length}")
        self.seed = seed
        self.tasks_per_batch = tasks_per_batch
        self.length = length
        self.num_batches = num_batches
        self.next_index = 0

    def next_batch(self) -> list[Task] | None:
        if self.num_batches is not None and self.next_index >= self.num_batches:
            return None
        index = self.next_index
        rng = random.Random(f"reverse-digits/{self.seed}/{index}")
        batch = [
            make_reverse_task(
                f"s{self.seed}-b{index}-t{i}", [rng.randrange(10) for _ in range(self.length)]
            )
            for i in range(self.tasks_per_batch)
        ]
        self.next_index += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "next_index": self.next_index}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"task set state is for seed {state['seed']}, this set has seed {self.seed}")
        self.next_index = int(state["next_index"])
