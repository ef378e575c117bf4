"""The rules across a job's sections (`JobConfig`'s last validator): each a function of the whole
job, returning its problems as (dotted path, what to write instead). Apart from `roles.config` so
that file stays the sections themselves; this module reads a job's attributes and imports no model."""

from __future__ import annotations

import math
from typing import Any

from rolectl.sync_protocol import StalenessPolicy, SyncStyle

from .engines.sections import READS_DATA
from .engines.stage_sections import STAGES

__all__ = ["PARTIAL_ROLLOUT_ENGINES", "STREAMING_ENGINES", "cross_section_problems"]


def cross_section_problems(cfg: Any, *, check_engines: bool, check_trainer: bool = True) -> list[tuple[str, str]]:
    """Every rule's problems; with `check_engines`, also what the engines need and the eval file (and
    without `check_trainer`, not what only a trainer reads: an explorer's load)."""
    problems = [*_over_rollout_problems(cfg), *_partial_rollout_problems(cfg), *_wire_dtype_problems(cfg),
                *_world_size_problems(cfg), *_stage_problems(cfg), *_staleness_policy_problems(cfg),
                *_dynamic_sampling_problems(cfg), *_streaming_problems(cfg)]
    if check_engines:
        problems += [*_engine_problems(cfg, check_trainer), *_eval_problems(cfg), *_correction_problems(cfg)]
    return problems


def _engine_problems(cfg: Any, check_trainer: bool) -> list[tuple[str, str]]:
    # Each engine says what it needs beyond its typed sections (libraries, the sections it reads).
    import dataclasses

    from rolectl.roles.engines import EngineSections, engine_config_problems

    return engine_config_problems(dataclasses.replace(EngineSections.of(cfg), check_trainer=check_trainer))


def _over_rollout_problems(cfg: Any) -> list[tuple[str, str]]:
    # A train step that needs more tasks than a round of cut steps brings would stall every round
    # (explorers wait for a version the trainer cannot train) until the sync timeout.
    ratio = cfg.explorers.over_rollout_ratio
    if not ratio:
        return []
    per_step = math.ceil(cfg.buffer.batch_size * (1 - ratio))
    per_round = cfg.explorers.count * per_step
    needed = cfg.trainer.train_batch_tasks or cfg.buffer.batch_size
    if needed <= per_round:
        return []
    return [("explorers.over_rollout_ratio",
             f"{ratio:g} keeps {per_step} of each step's {cfg.buffer.batch_size} tasks, {per_round} per round of "
             f"{cfg.explorers.count} explorers, fewer than the {needed} a train step takes; set "
             f"trainer.train_batch_tasks: {per_round} (or lower the ratio)")]


PARTIAL_ROLLOUT_ENGINES = ("tiny", "hf", "vllm")
"""The rollout engines that pause between two tokens (`RolloutEngine.rollout(..., pause_point=)`)."""


def _rollout_engine(cfg: Any) -> str:
    """The explorers' engine: `model.rollout_engine`, else the trainer's own (fsdp's explorers run hf)."""
    named = getattr(cfg.model, "rollout_engine", None)
    return named or ("hf" if cfg.model.engine == "fsdp" else cfg.model.engine)


def _partial_rollout_problems(cfg: Any) -> list[tuple[str, str]]:
    # Versions arrive while generations are in flight only where explorers never wait for them:
    # every other style syncs between two steps, when nothing is in flight to pause.
    if not cfg.explorers.partial_rollout:
        return []
    sync, problems = cfg.synchronizer, []
    if sync.sync_style is not SyncStyle.FULLY_ASYNC or sync.sync_method.is_rendezvous:
        problems.append(("explorers.partial_rollout",
                         f"needs synchronizer.sync_style: fully_async with a pull sync_method (memory, checkpoint), "
                         f"got {sync.sync_style.value} with {sync.sync_method.value}: other styles sync between "
                         "steps, when no generation is in flight; set both, or remove partial_rollout"))
    engine = _rollout_engine(cfg)
    if engine not in PARTIAL_ROLLOUT_ENGINES:
        problems.append(("explorers.partial_rollout",
                         f"the {engine!r} rollout engine cannot pause a generation for new weights (engines that "
                         f"can: {', '.join(PARTIAL_ROLLOUT_ENGINES)}); remove partial_rollout"))
    if cfg.agent is not None:
        problems.append(("explorers.partial_rollout",
                         "applies to single-turn rollouts; an agent's episodes take the version each turn "
                         "starts with (remove partial_rollout, or the agent: section)"))
    if cfg.explorers.over_rollout_ratio:
        problems.append(("explorers.partial_rollout",
                         "does not combine with explorers.over_rollout_ratio (its engines run tasks on threads of "
                         "their own, and a pause loads every engine of the explorer): set one of them"))
    return problems


STREAMING_ENGINES = ("tiny", "vllm")
"""The rollout engines that keep generations in flight across calls (`admit` / `collect`)."""


def _streaming_problems(cfg: Any) -> list[tuple[str, str]]:
    # A generation carried into the next step meets the weights loaded in between: that is a partial
    # rollout (each token its version), so streaming stands on partial_rollout's rules.
    if not cfg.explorers.streaming:
        return []
    problems = []
    if not cfg.explorers.partial_rollout:
        problems.append(("explorers.streaming", "needs explorers.partial_rollout: true (a generation carried into "
                                                "the next step goes on with the weights loaded in between)"))
    engine = _rollout_engine(cfg)
    if engine not in STREAMING_ENGINES:
        problems.append(("explorers.streaming", f"the {engine!r} rollout engine cannot carry generations across "
                                                f"steps (engines that can: {', '.join(STREAMING_ENGINES)}); remove "
                                                "streaming"))
    if _written_algorithm(cfg).get("dynamic_sampling") is True:
        problems.append(("explorers.streaming", "does not combine with algorithm.dynamic_sampling (a step publishes "
                                                "the groups that finish first, filtered or not): set one of them"))
    return problems


def _staleness_policy_problems(cfg: Any) -> list[tuple[str, str]]:
    sync = cfg.synchronizer
    if sync.staleness_policy is not StalenessPolicy.CORRECT or sync.max_staleness is not None:
        return []
    return [("synchronizer.staleness_policy", "correct applies to experiences past synchronizer.max_staleness, "
                                              "which is null (nothing is ever stale): set max_staleness, or "
                                              "remove staleness_policy")]


def _dynamic_sampling_problems(cfg: Any) -> list[tuple[str, str]]:
    # The filter and the extra generation batches are the task set's loop's; a served request is one
    # trajectory, rewarded when the application says so, with no group to compare it with.
    if _written_algorithm(cfg).get("dynamic_sampling") is not True or not cfg.serve.enabled:
        return []
    return [("algorithm.dynamic_sampling", "filters the groups explorers roll out from their task set; serving "
                                           "explorers (serve.enabled) have none: remove one of them")]


def _written_algorithm(cfg: Any) -> dict[str, Any]:
    """The job's `algorithm:` as written, whether the section is typed (hf, fsdp) or not (tiny)."""
    return cfg.algorithm.model_dump() if cfg.algorithm is not None else {}


def _correction_problems(cfg: Any) -> list[tuple[str, str]]:
    # A stale experience kept is trained against what sampled it only with the correction on; the
    # trainer's engine reads `algorithm:` (typed for hf and fsdp), so this is checked with the engines.
    if cfg.synchronizer.staleness_policy is not StalenessPolicy.CORRECT:
        return []
    if getattr(cfg.algorithm, "rollout_correction", None) is not None:
        return []
    return [("synchronizer.staleness_policy",
             "correct trains stale experiences with the off-policy correction, which is off: add "
             "algorithm.rollout_correction (e.g. {rollout_is: token}; an hf or fsdp trainer), or set "
             "staleness_policy: drop")]


def _wire_dtype_problems(cfg: Any) -> list[tuple[str, str]]:
    method = cfg.synchronizer.sync_method
    if cfg.transport.wire_dtype is None or not method.is_rendezvous:
        return []
    return [("transport.wire_dtype", f"applies to the pull methods (memory, checkpoint), not to {method.value}: "
                                     "remove it, or set model.dtype for what the explorers load")]


def _world_size_problems(cfg: Any) -> list[tuple[str, str]]:
    if cfg.trainer.world_size == 1 or cfg.model.engine == "fsdp":
        return []
    return [("trainer.world_size", f"{cfg.trainer.world_size} ranks need a sharded engine: set "
                                   "`model.engine: fsdp`, or world_size: 1")]


def _stage_problems(cfg: Any) -> list[tuple[str, str]]:
    """A stage's section is there when (and only when) the job is that stage, on an engine that
    trains stages; what only RL reads is not set on a stage, and the other way round."""
    problems = []
    stage, engine = cfg.stage, cfg.model.engine
    for name in STAGES[1:]:  # each trainer-only stage's section: `sft:`, `dpo:`
        if stage == name and getattr(cfg, name) is None:
            problems.append((name, f"required by `stage: {name}`: `{name}: {{path: FILE, epochs, batch_size, ...}}` "
                                   "(docs/stages.md)"))
        if stage != name and getattr(cfg, name) is not None:
            problems.append((name, f"read only by `stage: {name}` (this job is `stage: {stage}`): set stage: "
                                   f"{name}, or remove the section"))
    if stage != "rl" and engine not in READS_DATA:
        problems.append(("stage", f"{stage} runs on the hf or fsdp engine (model.engine), not {engine}"))
    if stage != "rl" and cfg.trainer.expert_data is not None:
        problems.append(("trainer.expert_data", f"mixes demonstrations into RL train steps; a `stage: {stage}` "
                                                "job trains on its own section's file: remove it"))
    if cfg.trainer.expert_data is not None and engine not in READS_DATA:
        problems.append(("trainer.expert_data", f"needs the hf or fsdp trainer, not {engine}"))
    if stage == "rl" and getattr(cfg.model, "init_from", None):
        problems.append(("model.init_from", "starts a trainer-only stage from a checkpoint; an RL job starts "
                                            "from a stage's Hugging Face export: name it as model.path"))
    return problems


def _eval_problems(cfg: Any) -> list[tuple[str, str]]:
    # The eval set is read like the task set, by the engines (it needs `datasets`).
    if not cfg.eval.has_source:
        return []
    from rolectl.roles.engines.evaluation import eval_config_problems

    return eval_config_problems(cfg)
