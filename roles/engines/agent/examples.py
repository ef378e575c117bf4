"""Built-in example environments: small tasks that cannot be solved in one turn.

`HiddenReverse` (`environment: hidden_reverse`): reverse digits the prompt hides. The model must
first ask (`?`, the tiny engine's query token); the environment answers with the digits, and the
model's next turn must give them reversed. It needs the environment's answer to the first turn for
the second: a policy that never asks scores nothing, one that asks and then guesses scores chance.
It runs on the tiny engine (`examples/agent_multiturn.yaml`) and on text tasks whose answer is digits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..rewards import positional_match
from .environment import StepResult

if TYPE_CHECKING:
    from ..base import Task

__all__ = ["HiddenReverse"]

QUERY = "?"
BLANK = "_"


class HiddenReverse:
    """Reverse the digits the prompt hides: ask with `?`, then answer (see the module's docstring).

    The first observation is one blank per digit. A turn that asks (holds `?`) is answered with the
    digits (counted `tool_calls/reveal/ok`); a turn that does not ask before they were revealed is
    answered with a blank; the first turn without `?` after that is the answer: its reward is the
    fraction of positions right (`positional_match`), and the episode is done.
    """

    tools: tuple[dict[str, Any], ...] = ()

    def __init__(self) -> None:
        self.digits: list[str] = []
        self.revealed = False

    def reset(self, task: Task) -> str:
        # a tiny task's target is the digits reversed; a text task's answer is (the reverse's)
        self.digits = [str(t) for t in reversed(task.target)] if task.target else task.answer.split()[::-1]
        if not self.digits or not all(d.isdigit() for d in self.digits):
            raise ValueError(f"task {task.id}: HiddenReverse needs digits to hide, got {self.digits}")
        self.revealed = False
        return " ".join(BLANK for _ in self.digits)

    def step(self, model_text: str) -> StepResult:
        if QUERY in model_text.split():
            self.revealed = True
            return StepResult(observation=" ".join(self.digits), info={"tool_calls/reveal/ok": 1.0})
        if not self.revealed:
            return StepResult(observation=BLANK)
        return StepResult(reward=positional_match(model_text, " ".join(reversed(self.digits))), done=True)
