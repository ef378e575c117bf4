"""A turn generator for the agent loop's tests: a policy written as a rule, no model."""

from __future__ import annotations

from rolectl.roles.engines.agent.environment import TurnOutput

__all__ = ["ScriptedTurns"]


class ScriptedTurns:
    """A `TurnGenerator` whose policy is a rule `sequence -> tokens` (cut at each turn's limit);
    every call is recorded. Logprobs are -0.5 a token; `version` is what the turns are tagged with."""

    def __init__(self, policy, version: int = 3) -> None:
        self.policy = policy
        self.version = version
        self.calls: list[tuple[list[list[int]], list[int], list[int]]] = []

    def generate_turns(self, sequences, *, max_tokens, seeds):
        self.calls.append(([list(s) for s in sequences], list(max_tokens), list(seeds)))
        outputs = []
        for sequence, limit in zip(sequences, max_tokens):
            wanted = list(self.policy(list(sequence)))
            tokens = tuple(wanted[:limit])
            outputs.append(TurnOutput(tokens=tokens, logprobs=(-0.5,) * len(tokens), version=self.version,
                                      finished=len(wanted) <= limit))
        return outputs
