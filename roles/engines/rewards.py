"""Reward functions scored on decoded text: built-ins by name, or the user's own as `module:function`.

A reward function is `fn(response: str, answer: str) -> float`, or, to see more of its task,
`fn(response, answer, *, prompt, row)`: `prompt` is the prompt's text (before any chat template),
`row` the task's data row as a plain dict of every column (a tolerance, unit tests, a rubric).
A function declares what it takes (either keyword, both, or `**kwargs` for both); the form is read
once, when the reward is resolved, and a signature rolectl cannot call is refused then (with the
job's config). A job names one or several in `data.rewards` (each with a weight); the rollout
engine scores every response with each of them (`score_all`), reports each one's mean as a metric
(`reward/<name>`), and trains on the weighted sum.

Built-ins:

- `exact_match`: 1 when the response (whitespace-normalised, up to the first blank line) equals the
  answer, else 0.
- `positional_match`: the fraction of whitespace-separated answer items the response has at the same
  position, divided by the longer of the two lengths (partial credit; extra items cost credit).
- `math`: a math-answer verifier: the response's final answer (the last `\\boxed{...}`, else the text
  after the last "answer is"/"####", else the last number) equals the answer as a number or fraction
  (`0.5` = `1/2` = `\\frac{1}{2}`), or as text (case and whitespace ignored) when either is not a number.
- `format`: 1 when the response is one line of whitespace-separated tokens with no stray characters
  (letters, digits, `.,-/`), else 0: checks the shape, not the content.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from .base import Task
from .user_code import resolve_object

__all__ = [
    "RewardFn",
    "REWARD_FORMS",
    "ROW_KEYWORDS",
    "WeightedReward",
    "BUILTIN_REWARDS",
    "exact_match",
    "positional_match",
    "math_answer",
    "format_reward",
    "resolve_reward",
    "reward_keywords",
    "reward_spec_problems",
    "parse_reward_specs",
    "score_all",
]

RewardFn = Callable[..., float]
"""`fn(response, answer)`, or with the keywords of `ROW_KEYWORDS` it declares (`REWARD_FORMS`)."""
ROW_KEYWORDS = ("prompt", "row")
REWARD_FORMS = ("fn(response, answer) or fn(response, answer, *, prompt, row) (either keyword alone, or "
                "**kwargs for both; prompt: the prompt text, row: the data row as a dict of every column)")


def _normalise(text: str) -> str:
    return " ".join(text.split())


def _first_block(text: str) -> str:
    """The response up to its first blank line: models often ramble after the answer."""
    return re.split(r"\n\s*\n", text.strip(), maxsplit=1)[0]


def exact_match(response: str, answer: str) -> float:
    return 1.0 if _normalise(_first_block(response)) == _normalise(answer) else 0.0


def positional_match(response: str, answer: str) -> float:
    got, want = _first_block(response).split(), answer.split()
    if not want:
        return 1.0 if not got else 0.0
    return sum(g == w for g, w in zip(got, want)) / max(len(got), len(want))


_BOXED = re.compile(r"\\boxed\s*\{")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:\s*/\s*-?\d+)?")
_FRAC = re.compile(r"\\d?frac\s*\{\s*(-?[\d.]+)\s*\}\s*\{\s*(-?[\d.]+)\s*\}")


def _last_boxed(text: str) -> str | None:
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    start, depth = starts[-1], 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None  # unbalanced: no answer


def _final_answer(text: str) -> str | None:
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    for marker in ("####", "answer is"):
        at = text.lower().rfind(marker)
        if at >= 0:
            return text[at + len(marker):].strip().rstrip(".").strip()
    numbers = _NUMBER.findall(text.replace(",", ""))
    return numbers[-1] if numbers else None


def _as_number(text: str) -> Fraction | None:
    text = _FRAC.sub(r"\1/\2", text.strip().strip("$").replace(",", "").replace(" ", ""))
    text = text.removeprefix("\\left").rstrip("%")
    try:
        if "/" in text:
            top, bottom = text.split("/", 1)
            return Fraction(top) / Fraction(bottom)
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def math_answer(response: str, answer: str) -> float:
    final = _final_answer(response)
    if final is None:
        return 0.0
    # The reference may itself be a worked solution (GSM8K's "... #### 42"): take its final answer.
    reference = _final_answer(answer) if ("####" in answer or "\\boxed" in answer) else answer
    if reference is None:
        return 0.0
    got, want = _as_number(final), _as_number(reference)
    if got is not None and want is not None:
        return 1.0 if got == want else 0.0
    return 1.0 if "".join(final.split()).lower() == "".join(reference.split()).lower() else 0.0


_ONE_LINE_OF_ITEMS = re.compile(r"[A-Za-z0-9.,\-/]+( [A-Za-z0-9.,\-/]+)*")


def format_reward(response: str, answer: str) -> float:
    return 1.0 if _ONE_LINE_OF_ITEMS.fullmatch(response.strip()) else 0.0


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "positional_match": positional_match,
    "math": math_answer,
    "format": format_reward,
}


def resolve_reward(name: str) -> RewardFn:
    """A built-in by name, or the user's own as `module:function` / `path/to/file.py:function`
    (`roles.engines.user_code`), checked to take one of the accepted forms (`REWARD_FORMS`).

    Raises ValueError saying what is missing and what to do.
    """
    fn = resolve_object(name, what="reward", builtins=BUILTIN_REWARDS)
    if not callable(fn):
        raise ValueError(f"reward {name!r}: {type(fn).__name__} {fn!r} is not a function")
    reward_keywords(fn, name)
    return fn


def reward_keywords(fn: Callable[..., Any], name: str) -> frozenset[str]:
    """Which of `ROW_KEYWORDS` `fn` takes, read from its signature; ValueError naming the accepted
    forms when it cannot be called as a reward. A callable whose signature Python cannot read (a
    C function) is called the two-argument way."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return frozenset()
    kinds = inspect.Parameter
    positional = [p for p in parameters if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    problems = []
    if len(positional) < 2 and not any(p.kind is kinds.VAR_POSITIONAL for p in parameters):
        problems.append(f"it takes {len(positional)} positional argument(s), not response and answer")
    keywords = set()
    for p in positional[2:] + [p for p in parameters if p.kind is kinds.KEYWORD_ONLY]:
        if p.name in ROW_KEYWORDS and p.kind is not kinds.POSITIONAL_ONLY:
            keywords.add(p.name)
        elif p.default is p.empty:
            problems.append(f"rolectl passes no {p.name!r}")
    if any(p.kind is kinds.VAR_KEYWORD for p in parameters):
        keywords.update(ROW_KEYWORDS)
    if problems:
        raise ValueError(f"reward {name!r}: cannot be called as {_qualname(fn)}{inspect.signature(fn)}: "
                         f"{'; '.join(problems)}; write it as {REWARD_FORMS}")
    return frozenset(keywords)


def _qualname(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


@dataclass(frozen=True, slots=True)
class WeightedReward:
    name: str
    weight: float
    fn: RewardFn
    keywords: frozenset[str] = frozenset()
    """What `fn` takes beyond (response, answer): a subset of `ROW_KEYWORDS` (`reward_keywords`)."""


def reward_spec_problems(specs: Any, where: str = "data.rewards") -> list[tuple[str, str]]:
    """Problems with a rewards spec: a name, a list of names, or a list of {name, weight}."""
    problems: list[tuple[str, str]] = []
    for i, (name, weight) in enumerate(_spec_items(specs, where, problems)):
        try:
            resolve_reward(name)
        except ValueError as exc:
            problems.append((f"{where}[{i}]", str(exc)))
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            problems.append((f"{where}[{i}].weight", f"must be a finite number, got {weight!r}"))
    return problems


def parse_reward_specs(specs: Any) -> tuple[WeightedReward, ...]:
    problems = reward_spec_problems(specs)
    if problems:
        raise ValueError("; ".join(f"{path}: {why}" for path, why in problems))
    rewards = []
    for name, weight in _spec_items(specs, "", []):
        fn = resolve_reward(name)
        rewards.append(WeightedReward(name, float(weight), fn, reward_keywords(fn, name)))
    return tuple(rewards)


def _spec_items(specs: Any, where: str, problems: list) -> list[tuple[Any, Any]]:
    if isinstance(specs, str):
        return [(specs, 1.0)]
    if not isinstance(specs, Sequence) or not specs:
        problems.append((where, f"must be a reward name or a non-empty list of them, got {specs!r}"))
        return []
    items = []
    for i, spec in enumerate(specs):
        if isinstance(spec, str):
            items.append((spec, 1.0))
        elif isinstance(spec, Mapping) and isinstance(spec.get("name"), str) and set(spec) <= {"name", "weight"}:
            items.append((spec["name"], spec.get("weight", 1.0)))
        else:
            problems.append((f"{where}[{i}]", f"must be a name or {{name, weight}}, got {spec!r}"))
    return items


def score_all(rewards: Sequence[WeightedReward], response: str, task: Task | str) -> tuple[float, dict[str, float]]:
    """The weighted total and each reward's own score for one response to `task`.

    Every caller scores through here (the rollout engines, the eval, the agent loop's last turn).
    A bare answer string is the old form: rewards that take `prompt` or `row` get "" and {}.
    """
    answer, prompt, row = (task, "", None) if isinstance(task, str) else (task.answer, task.prompt_text, task.row)
    scores = {}
    for reward in rewards:
        extra: dict[str, Any] = {}
        if "prompt" in reward.keywords:
            extra["prompt"] = prompt
        if "row" in reward.keywords:
            extra["row"] = dict(row or {})  # a copy each: one reward cannot change what the next sees
        scores[reward.name] = float(reward.fn(response, answer, **extra))
    return sum(r.weight * scores[r.name] for r in rewards), scores
