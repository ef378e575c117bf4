"""Events, decisions and a sync config as text: `describe` gives `Kind(field=value, ...)` for messages
and logs; `in_words` a short sentence for people (the observer's event log, timelines).

`describe` shows only what differs from the defaults and leaves an input's sender (`member`) out:
the caller names the sender in its own words (`trainer/t#0 sent VersionPublished(...)`).
`in_words` is a `Phrasebook`: one phrase per event type, in a table; a test that wants its own
notation for the same events makes a phrasebook of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any

import msgspec

from .config import SyncConfig
from .events import (
    Decision,
    EvalFinished,
    Event,
    JobConfigured,
    MemberExpired,
    MemberJoined,
    MemberRef,
    MemberReleased,
    NoNewVersion,
    RendezvousReady,
    RoundClosed,
    RoundOpened,
    RoundTimedOut,
    StatusChanged,
    StepFinished,
    StepsRolledBack,
    SyncFailed,
    VersionPublished,
    WeightsBroadcast,
    WeightsLoaded,
)

__all__ = ["describe", "describe_config", "in_words", "Phrasebook"]


def describe(event: Event | Decision) -> str:
    """`Kind(field=value, ...)` without the sender and without fields left at their default."""
    shown = []
    for f in msgspec.structs.fields(event):
        value = getattr(event, f.name)
        if f.name == "member" and isinstance(event, Event):
            continue
        if f.default is not msgspec.NODEFAULT and value == f.default:
            continue
        if f.default_factory is not msgspec.NODEFAULT and value == f.default_factory():
            continue
        shown.append(f"{f.name}={_show(value)}")
    return f"{type(event).__name__}({', '.join(shown)})"


def describe_config(config: SyncConfig) -> str:
    """`SyncConfig(name=value, ...)` with the fields that differ from the defaults."""
    defaults = SyncConfig().to_mapping()
    shown = [f"{name}={_show(getattr(config, name))}"
             for name, value in config.to_mapping().items() if value != defaults.get(name)]
    return f"SyncConfig({', '.join(shown)})"


def _show(value: object) -> str:
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, MemberRef):
        return str(value)
    if isinstance(value, SyncConfig):
        return describe_config(value)
    return repr(value)


class Phrasebook:
    """Text for events and decisions by their type: `phrases[type(event)](event)`, or the type's
    name for a type the book has no phrase for."""

    def __init__(self, phrases: Mapping[type, Callable[[Any], str]]):
        self.phrases = dict(phrases)

    def __call__(self, event: Event | Decision) -> str:
        phrase = self.phrases.get(type(event))
        return phrase(event) if phrase is not None else type(event).__name__


def _size(nbytes: int) -> str:
    """Bytes for people: `1.5 GB`, `12.0 MB`, `3.2 kB`, `512 B`."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _step_finished(e: StepFinished) -> str:
    reward = e.metrics.get("reward_mean")
    extra = f", reward {reward:.3f}" if reward is not None else ""
    return f"step {e.step} done with v{e.version}{extra}"


def _eval_finished(e: EvalFinished) -> str:
    rewards = ", ".join(f"{name} {mean:.3f}" for name, mean in e.rewards.items())
    return f"eval of v{e.version} at step {e.step}: {rewards} ({e.tasks} tasks, {e.seconds:.2f} s)"


def _weights_loaded(e: WeightsLoaded) -> str:
    where = f" (round {e.round})" if e.round is not None else " (background)"
    return f"loaded v{e.version}{where} {_size(e.nbytes)} in {e.seconds:.3f} s"


in_words = Phrasebook({
    # inputs
    MemberJoined: lambda e: f"joined on {e.host} (pid {e.pid}) at step {e.step}, version {e.version}",
    JobConfigured: lambda e: (f"config {e.config.sync_method.value}/{e.config.sync_style.value} "
                              f"interval {e.config.sync_interval}"),
    StatusChanged: lambda e: (f"{e.status.value} at step {e.step}, version {e.version}"
                              + (" (interrupted)" if e.interrupted else "")),
    VersionPublished: lambda e: (f"published v{e.version} (step {e.step}, {_size(e.nbytes)} "
                                 f"via {e.method.value})"),
    NoNewVersion: lambda e: f"no version newer than v{e.version}",
    WeightsLoaded: _weights_loaded,
    WeightsBroadcast: lambda e: (f"broadcast v{e.version} round {e.round} {_size(e.nbytes)} "
                                 f"in {e.seconds:.3f} s"),
    SyncFailed: lambda e: f"sync failed (v{e.version}, round {e.round}): {e.reason}",
    StepFinished: _step_finished,
    StepsRolledBack: lambda e: (f"rolled back to step {e.to_step}: steps {e.to_step + 1}..{e.from_step} "
                                f"are trained again"),
    EvalFinished: _eval_finished,
    MemberExpired: lambda e: f"{e.expired} expired (silent {e.silent_for:.1f} s)",
    RoundTimedOut: lambda e: f"round {e.round} timed out",
    # decisions
    RoundOpened: lambda d: (f"round {d.round} opened by {d.opened_by.key} ({d.method.value}, "
                            f"holds v{d.version})"),
    RendezvousReady: lambda d: (f"round {d.round} rendezvous: v{d.version}, epoch {d.epoch}, "
                                f"world {d.world_size} at {d.master_addr}:{d.master_port}"),
    MemberReleased: lambda d: f"round {d.round}: release {d.released.key} ({d.reason.value}, v{d.version})",
    RoundClosed: lambda d: f"round {d.round} closed: {d.outcome.value}",
})
"""A short sentence for an event or a decision (the observer's log, timelines)."""
