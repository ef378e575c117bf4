"""Console log lines read left to right: the event, then step and reward, then the rest, and who
said it (job, role, member) and when at the end — not keys sorted alphabetically."""

from __future__ import annotations

import io

import structlog

from rolectl.bus.logging import setup_logging


def test_console_lines_lead_with_event_step_and_reward():
    out = io.StringIO()
    setup_logging("info", json=False, stream=out)
    try:
        structlog.get_logger().bind(job="j", role="trainer", member="trainer").info(
            "train_step", loss=0.5, version=3, reward=0.25, step=3)
    finally:
        setup_logging("info")
    line = out.getvalue()
    order = [line.index(text) for text in ("train_step", "step=3", "reward=0.25", "version=3", "loss=0.5", "job=j",
                                           "member=trainer")]
    assert order == sorted(order), line


def test_an_exit_code_is_logged_as_its_number():
    from rolectl.roles.exit_codes import ExitCode

    for json in (False, True):
        out = io.StringIO()
        setup_logging("info", json=json, stream=out)
        try:
            structlog.get_logger().error("start_refused", exit_code=ExitCode.USAGE)
        finally:
            setup_logging("info")
        line = out.getvalue()
        assert ("exit_code=2" if not json else '"exit_code": 2') in line and "ExitCode" not in line, line
