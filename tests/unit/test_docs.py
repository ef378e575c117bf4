"""The documented sync semantics stay in step with the transition table the reducer runs on."""

from __future__ import annotations

from pathlib import Path

from rolectl.sync_protocol.reducer import (
    PACE_CAUSES,
    PACE_TRANSITIONS,
    ROUND_TRANSITIONS,
    TRIGGER_CAUSES,
    PaceTrigger,
    Trigger,
    pace_markdown,
    transitions_markdown,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "sync-semantics.md"


def test_doc_embeds_the_generated_transition_table():
    text = DOC.read_text()
    assert "\n## Rounds: every transition\n" in text
    assert transitions_markdown() in text


def test_doc_embeds_the_generated_pace_table():
    text = DOC.read_text()
    assert "\n## Staleness, bounded both ways\n" in text
    assert pace_markdown() in text


def test_every_pace_trigger_is_used_and_explained():
    assert {trigger for (_, trigger) in PACE_TRANSITIONS} == set(PaceTrigger) == set(PACE_CAUSES)


def test_every_trigger_is_used_and_explained():
    used = {trigger for (_, _, trigger) in ROUND_TRANSITIONS}
    assert used == set(Trigger) == set(TRIGGER_CAUSES)
