"""One line for an event, a decision or a sync config: `Kind(field=value, ...)`, for messages and logs.

Only what differs from the defaults is shown, and an input's sender (`member`) is left out: the
caller names the sender in its own words (`trainer/t#0 sent VersionPublished(...)`).
"""

from __future__ import annotations

from enum import Enum

import msgspec

from .config import SyncConfig
from .events import Decision, Event, MemberRef

__all__ = ["describe", "describe_config"]


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
