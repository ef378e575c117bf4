"""Print a replay for a terminal: the timeline's rounds and members, and a check's verdict
(`rolectl replay` without `--json`; the full record is in `--json`).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from rich.console import Console

from rolectl.roles.observe.check import Mismatch
from rolectl.roles.observe.views import progress_text, version_text
from rolectl.sync_protocol import Decision, Recorded

__all__ = ["print_check", "print_timeline", "stdout_console", "quiet_closed_stdout"]

_WHOLE_LINES = 4096
"""The width `stdout_console` gives a file or a pipe: no line of a timeline or a table is cut."""


def quiet_closed_stdout() -> None:
    """The reader of stdout went away (`rolectl replay | head`): what is left goes nowhere, quietly
    (the Python docs' BrokenPipeError recipe: the interpreter's last flush would raise again)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


class _Stdout(Console):
    """rich's console, but a reader that went away is the command's to handle (rich would exit 1)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


def stdout_console() -> Console:
    """Where `replay` and `status` print: the terminal's width, or whole lines in a file or a pipe
    (rich would cut them at 80 columns). A closed pipe raises BrokenPipeError."""
    console = _Stdout()
    return console if console.is_terminal else _Stdout(width=_WHOLE_LINES)


_OUTCOME_STYLE = {"completed": "green", "no_new_version": "cyan", "timed_out": "red", "failed": "red",
                  "trainer_stopped": "yellow", "abandoned": "yellow", "open": "white"}


def _line(out, text: str, style: str | None = None) -> None:
    """One line, cut to the terminal's width (whole in a file or a pipe): a row never folds into a
    column of words, and the full record is in `--json`."""
    out.print(text, style=style, markup=False, highlight=False, no_wrap=True, overflow="ellipsis")


def _round_line(r: dict[str, Any], show_method: bool) -> tuple[str, str]:
    got = {x["version"] for x in r["releases"] if x["reason"] == "new_version"}
    if r["rendezvous"]:
        got.add(r["rendezvous"]["version"])
    versions = f"v{r['version']}" + (f"→v{max(got)}" if got else "")
    waited = f"{r['duration_ms'] / 1000:.3f}s" if r["duration_ms"] is not None else "…"
    outcome = r["outcome"] or "open"
    moved = f"{r['nbytes'] / 1e6:.2f}MB" if r["nbytes"] else ""
    method = f" {r['method']:<10}" if show_method else ""
    return (f"{r['id']:>5} {(r['opened_at'] or '')[11:23]:<12} {_short(r['opened_by']):<12.12}{method} "
            f"{versions:<11} {waited:>8} {outcome:<15} {moved}").rstrip(), _OUTCOME_STYLE.get(outcome, "white")


def print_timeline(t: dict[str, Any]) -> None:
    out = stdout_console()
    cfg = t["config"] or {}
    _line(out, f"replay {t['source']}: {t['records']} records, seq {t['first_seq']}..{t['last_seq']}", "bold")
    _line(out, f"  from {t['first_time']} to {t['last_time']}")
    if cfg:
        _line(out, f"config: {cfg.get('sync_method')} / {cfg.get('sync_style')}, interval {cfg.get('sync_interval')}"
                   f", offset {cfg.get('sync_offset')}, timeout {cfg.get('sync_timeout')} s")
    if t["until"] is not None:
        _line(out, f"state as of --until {t['until']}", "bold yellow")
    if t["decisions_source"] == "recomputed":
        _line(out, "no decision is recorded: rounds below are the reducer's own decisions", "yellow")

    rounds = t["rounds"]
    if rounds:
        outcomes: dict[str, int] = {}
        for r in rounds:
            outcomes[r["outcome"] or "open"] = outcomes.get(r["outcome"] or "open", 0) + 1
        _line(out, f"sync rounds: {len(rounds)} (" + ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items()))
              + ")", "bold")
        show_method = len({r["method"] for r in rounds}) > 1
        method = f" {'method':<10}" if show_method else ""
        _line(out, f"{'round':>5} {'opened (UTC)':<12} {'opened by':<12}{method} {'version':<11} {'waited':>8} "
                   f"{'outcome':<15} moved", "dim")
        for r in rounds:
            text, style = _round_line(r, show_method)
            _line(out, text, style)
    else:
        _line(out, "no sync round in this recording")

    latest = t["latest"]
    _line(out, f"members at the end: latest version v{latest['version']} "
               f"(held by {', '.join(map(_short, latest['held_by'])) or 'nobody'})", "bold")
    _line(out, f"  {'role':<12} {'id':<14} {'status':<12} {'step':>6} {'version':>7}  last seen (UTC, before end)",
          "dim")
    for m in t["members"]:
        synchronizer = m["role"] == "synchronizer"  # no steps nor weights: what was decided instead
        step, decided = ("—", f"  ({progress_text(m)})") if synchronizer else (m["step"], "")
        _line(out, f"  {m['role']:<12} {m['id']:<14.14} {m['status']:<12} {step:>6} {version_text(m):>7}  "
                   f"{_seen(m)}{decided}")
    evals = t.get("eval") or []
    if evals:
        names = list(evals[0]["rewards"])
        _line(out, f"evals: {len(evals)} on the eval set ({evals[0]['tasks']} tasks)", "bold")
        _line(out, f"  {'version':>7} {'step':>6}  " + "  ".join(f"{n:>16.16}" for n in names), "dim")
        for e in evals:
            _line(out, f"  {e['version']:>7} {e['step']:>6}  "
                       + "  ".join(f"{e['rewards'].get(n, float('nan')):>16.4f}" for n in names))
    _line(out, "(--json: every release, whom each round waited for, transfer rates)", "dim")
    if t["illegal_inputs"]:
        _line(out, f"{len(t['illegal_inputs'])} input(s) refused by the reducer (skipped):", "yellow")
        for x in t["illegal_inputs"][:20]:
            out.print(f"  seq {x['seq']}: {x['reason']}", highlight=False, markup=False, soft_wrap=True)


def _short(key: str) -> str:
    """`explorer/explorer-0` -> `explorer-0` (ids are unique within a role, and say it anyway)."""
    return key.split("/", 1)[1] if "/" in key else key


def _seen(member: dict[str, Any]) -> str:
    if member["last_seen"] is None:
        return "never"
    before = member["last_seen_ago_ms"] or 0
    return f"{member['last_seen'][11:23]} {before / 1000:.1f}s"


def print_check(records: list[Recorded], mismatches: list[Mismatch]) -> None:
    out = stdout_console()
    decisions = sum(isinstance(r.event, Decision) for r in records)
    errors = [m for m in mismatches if not m.warning]
    for m in mismatches:
        if m.warning:
            out.print(f"warning: {m.describe()}", style="yellow", highlight=False, markup=False, soft_wrap=True)
    if not errors:
        tallies = sum(getattr(r.event, "staleness", None) is not None for r in records)
        verdicts = f", and the staleness verdicts of {tallies} trainer steps" if tallies else ""
        out.print(f"check OK: all {decisions} recorded decisions equal the recomputed ones{verdicts}",
                  style="bold green")
        return
    first = errors[0]
    out.print(f"check FAILED: {len(errors)} mismatch(es); first at recorded seq {first.seq}", soft_wrap=True,
              style="bold red", highlight=False)
    for m in errors[:50]:
        out.print(f"  {m.describe()}", highlight=False, markup=False, soft_wrap=True)
    if len(errors) > 50:
        out.print(f"  ... and {len(errors) - 50} more")
