"""Agents: multi-turn episodes in which an environment (a game, a checker, tools) answers between the
model's turns, recorded as trajectories whose loss mask trains only the tokens the policy sampled.

The parts, each replaceable: an `Environment` (the task's world: `reset`, then `step` per model turn),
a `Renderer` (how messages become exactly the tokens the model sees), and a `TurnGenerator` (the
rollout engine's primitive: continue token sequences by one model turn). The agent loop that drives
them is engine-independent (`roles.engines.agent.loop`).
"""

from .environment import Environment, Message, StepResult, TurnGenerator, TurnOutput

__all__ = ["Environment", "Message", "StepResult", "TurnGenerator", "TurnOutput"]
