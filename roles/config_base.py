"""The base of every config model: `Section`, the named constraints, and pydantic's errors in a
YAML user's words (a dotted path, what the field accepts, what it got).

It sits below the engines (their sections build on it) and above the bus, which knows nothing of job
config; it imports pydantic alone, so a synchronizer loads the job config without torch or NATS.
"""

from __future__ import annotations

import re
import types
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, Strict, Tag, TypeAdapter, ValidationError, ValidationInfo
from pydantic.fields import FieldInfo
from pydantic_core import InitErrorDetails, PydanticCustomError

__all__ = [
    "Section",
    "PositiveInt",
    "NonNegativeInt",
    "Seconds",
    "StrictBool",
    "PathStr",
    "PositiveNumber",
    "NonNegativeNumber",
    "Name",
    "invalid",
    "problems_of",
    "validate_section",
    "yaml_kind",
    "expected",
    "section_models",
]

# Constraints, named once: strict (a YAML `true` or `"3"` is not a count) and finite.
PositiveInt = Annotated[int, Strict(), Field(gt=0)]
NonNegativeInt = Annotated[int, Strict(), Field(ge=0)]
Seconds = Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)]
StrictBool = Annotated[bool, Strict()]
PathStr = Annotated[str, Strict()]
PositiveNumber = Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)]
NonNegativeNumber = Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False)]
Name = Annotated[str, Strict(), Field(min_length=1)]


class Section(BaseModel):
    """A config section: frozen, unknown keys refused, fields described by their docstrings."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    def replace(self, **changes: Any) -> Section:
        """A copy with `changes`, validated like the file was."""
        return type(self).model_validate({**dict(self), **changes})


class OpenSection(Section):
    """A section read as written: every key is kept, none is checked here (an engine of another
    package checks its own sections)."""

    model_config = ConfigDict(extra="allow")


# -- what a validation checks, by its context --------------------------------------------------------

CHECK_ENGINES = {"engines": "check"}
"""Validation context of a job loaded with its engines: what its sections name outside themselves (a
file, an installed library, a registry entry) is checked too, once, by the validators that ask
`checking`. Without a context (a copy with changes) only the sections themselves are checked."""
CHECK_ROLLOUT = {"engines": "check", "trainer": "skip"}
"""Validation context of an explorer's load: its engines checked as with `CHECK_ENGINES`, but not what
only a trainer reads (verl's policy losses and correction: importing verl costs an explorer about ten
seconds of CPU at every start, for names it never uses; `up`, `validate` and the trainer check them)."""
SKIP_ENGINES = {"engines": "skip"}
"""Validation context of a job loaded without its engines (a synchronizer, the dashboard): the
engine's sections are read as written (`OpenSection`), left to the roles that run an engine."""


def checking(info: ValidationInfo) -> bool:
    """Whether this validation checks what the sections name outside themselves (`CHECK_ENGINES`)."""
    return bool(info.context) and info.context.get("engines") == "check"


def checking_trainer(info: ValidationInfo) -> bool:
    """Whether this validation also checks what only a trainer reads (`CHECK_ENGINES`, not `CHECK_ROLLOUT`)."""
    return checking(info) and info.context.get("trainer") != "skip"


def skipping(info: ValidationInfo) -> bool:
    """Whether this validation reads the engine's sections as written (`SKIP_ENGINES`)."""
    return bool(info.context) and info.context.get("engines") == "skip"


# -- pydantic's errors in a YAML user's words --------------------------------------------------------

_PROBLEM = "config_problem"
_PATH_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def invalid(problems: Iterable[tuple[str, str]]) -> ValidationError:
    """`problems` (a dotted path relative to the validator, what to write instead) as pydantic's error:
    raised in a validator, each keeps its own path under the field or section that raised it."""
    return ValidationError.from_exception_data("config", [
        InitErrorDetails(type=PydanticCustomError(_PROBLEM, "{why}", {"why": why}), input=None,
                         loc=tuple(int(index) if index else name for name, index in _PATH_PART.findall(path)))
        for path, why in problems])


_MAPPING_ERRORS = ("model_type", "model_attributes_type", "dict_type", "mapping_type")
_BOUNDS = ((annotated_types.Gt, "gt", ">"), (annotated_types.Ge, "ge", ">="),
           (annotated_types.Lt, "lt", "<"), (annotated_types.Le, "le", "at most"))
_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def yaml_kind(value: Any) -> str:
    """What a YAML value is, in YAML's words (not Python's: a user never wrote a "NoneType")."""
    if value is None:
        return "nothing (an empty value)"
    if isinstance(value, bool):
        return f"a boolean ({value!r})"
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"
    if isinstance(value, str):
        return f"a string ({value!r})"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _got(value: Any) -> str:
    return yaml_kind(value) if isinstance(value, (list, tuple, dict)) or value is None else repr(value)


def _unwrap(annotation: Any) -> tuple[Any, list[Any]]:
    """The bare type and its constraints (from `Annotated[...]` and nested `Field(...)`)."""
    metadata: list[Any] = []
    while get_origin(annotation) is Annotated:
        annotation, *extra = get_args(annotation)
        for item in extra:
            metadata.extend(item.metadata if isinstance(item, FieldInfo) else [item])
    return annotation, metadata


def _options(annotation: Any) -> tuple[Any, ...]:
    """The options of a union, nested unions flattened (each option as annotated: a `Tag` stays)."""
    if get_origin(annotation) not in (Union, types.UnionType):
        return (annotation,)
    found: list[Any] = []
    for option in get_args(annotation):
        bare, _ = _unwrap(option)
        found.extend(_options(bare) if get_origin(bare) in (Union, types.UnionType) else [option])
    return tuple(found)


def expected(annotation: Any, metadata: list[Any] | tuple[Any, ...] = ()) -> str:
    """What a field accepts, in words: `an integer > 0`, `null or a string`, `one of ['file', 'memory']`."""
    annotation, inner = _unwrap(annotation)
    metadata = [*metadata, *inner]
    words = []
    for option in _options(annotation):
        option, option_meta = _unwrap(option)
        if option is type(None):
            words.append("null")
        elif get_origin(option) is Literal:
            words.append(f"one of {list(get_args(option))}")
        elif get_origin(option) in (tuple, list):
            item = get_args(option)[0] if get_args(option) else Any
            words.append(f"a list of {expected(item).removeprefix('an ').removeprefix('a ')}s")
        elif isinstance(option, type) and issubclass(option, BaseModel):
            words.append("a mapping (indented `key: value` lines)")
        elif get_origin(option) is dict or option is dict:
            words.append("a mapping (indented `key: value` lines)")
        else:
            kind = _KINDS.get(option, getattr(option, "__name__", str(option)))
            bounds = [f"{sign} {getattr(m, attr)}" for m in (*metadata, *option_meta)
                      for cls, attr, sign in _BOUNDS if isinstance(m, cls)]
            words.append(" ".join([kind, " and ".join(bounds)]).strip())
    return " or ".join(sorted(dict.fromkeys(words), key=lambda w: w != "null"))


def section_models(annotation: Any) -> list[tuple[str | None, type[BaseModel]]]:
    """The section models a field holds, each with the tag that selects it in a union (None: untagged)."""
    annotation, _ = _unwrap(annotation)
    found = []
    for option in _options(annotation):
        option, metadata = _unwrap(option)
        if isinstance(option, type) and issubclass(option, BaseModel):
            found.append((next((m.tag for m in metadata if isinstance(m, Tag)), None), option))
    return found


def _field_named(model: type[BaseModel], key: str) -> FieldInfo | None:
    """The field `key` names: by its name, or by its alias (an environment variable's name)."""
    return model.model_fields.get(key) or next((f for f in model.model_fields.values() if f.alias == key), None)


def _known(model: type[BaseModel]) -> list[str]:
    return sorted(name for name, info in model.model_fields.items() if not info.exclude)


def problems_of(exc: ValidationError, model: Any, *, prefix: str = "",
                top_level: str = "field") -> list[tuple[str, str]]:
    """Every error of `exc` (raised validating `model`: a section model or a union of them) as
    (dotted path, what to write instead)."""
    problems = []
    start = [(None, model)] if isinstance(model, type) and issubclass(model, BaseModel) else section_models(model)
    for error in exc.errors(include_url=False):
        members = start
        holder: type[BaseModel] | None = start[0][1] if len(start) == 1 else None
        info: FieldInfo | None = None
        parts = [prefix] if prefix else []
        item_of = False
        for item in error["loc"]:
            if isinstance(item, int):
                parts[-1:] = [f"{parts[-1]}[{item}]"] if parts else [f"[{item}]"]
                item_of = True
                continue
            tagged = next((member for tag, member in members if tag is not None and tag == item), None)
            if tagged is not None:  # the union's tag: not part of the user's path
                members = [(None, tagged)]
                continue
            holder = members[0][1] if members else None
            info = _field_named(holder, str(item)) if holder is not None else None
            members = section_models(info.annotation) if info is not None else []
            parts.append(str(item))
            item_of = False
        path = ".".join(parts) or "(top level)"
        problems.append((path, _why(error, holder, info, item_of, top_level if len(parts) == 1 else "field")))
    return problems


def validate_section(model: Any, values: Any, *, where: str,
                     context: dict[str, Any] | None = None) -> tuple[Any, list[tuple[str, str]]]:
    """`values` validated as `model` (a section model, or a union of them by its annotation), and
    every problem by its path under `where`; the section is None when there are problems."""
    if not isinstance(values, Mapping):
        return None, [(where, f"must be a mapping (indented `key: value` lines), got {yaml_kind(values)}")]
    try:
        if isinstance(model, type) and issubclass(model, BaseModel):
            return model.model_validate(values, context=context), []
        return _adapter(model).validate_python(values, context=context), []
    except ValidationError as exc:
        return None, problems_of(exc, model, prefix=where)


_ADAPTERS: dict[int, TypeAdapter[Any]] = {}


def _adapter(annotation: Any) -> TypeAdapter[Any]:
    """One adapter per annotation (building one compiles a validator)."""
    found = _ADAPTERS.get(id(annotation))
    if found is None:
        found = _ADAPTERS[id(annotation)] = TypeAdapter(annotation)
    return found


def _why(error: Any, holder: type[BaseModel] | None, info: FieldInfo | None, item_of: bool, noun: str) -> str:
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    if kind == _PROBLEM:
        return str(ctx["why"])
    if kind == "extra_forbidden":
        return f"unknown {noun}; known: {_known(holder)}" if holder is not None else "unknown field"
    if kind == "missing":
        hint = _first_line(info.description) if info is not None and info.description else ""
        return f"required: {hint[:1].lower()}{hint[1:]}" if hint else "required"
    if kind in _MAPPING_ERRORS and not item_of:
        return f"must be a mapping (indented `key: value` lines), got {yaml_kind(value)}"
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error", error["msg"])).removeprefix("Value error, ")
    if kind == "union_tag_invalid":
        return f"unknown engine {ctx.get('tag')!r}; known: {ctx.get('expected_tags')}"
    if kind in ("too_short", "string_too_short"):
        return f"must not be empty, got {_got(value)}"
    if info is not None:
        annotation, metadata = info.annotation, info.metadata
        if item_of:
            bare, _ = _unwrap(annotation)
            annotation, metadata = (get_args(bare) or (Any,))[0], []
        return f"must be {expected(annotation, metadata)}, got {_got(value)}"
    return f"{error['msg'][:1].lower()}{error['msg'][1:]}, got {_got(value)}"


def _first_line(text: str) -> str:
    return text.strip().split("\n")[0].rstrip(".")
