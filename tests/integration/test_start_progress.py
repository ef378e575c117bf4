"""`rolectl start` on a terminal shows a progress bar of steps done / total (a real process on a
pseudo-terminal, a real nats-server); in a pipe it writes log lines only."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

import yaml

from tests.support.wait import wait_until_sync

ROOT = Path(__file__).resolve().parents[2]


def test_start_on_a_terminal_shows_steps_against_the_total(nats_url, job_name, tmp_path):
    data = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    data.update(job=job_name, run_dir=str(tmp_path / "runs"))
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(data))
    total = data["trainer"]["total_steps"]
    main, child = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "rolectl", "start", "trainer", "--config", str(config),
                             "--nats", nats_url], stdin=child, stdout=child, stderr=child, cwd=ROOT,
                            env=dict(os.environ, COLUMNS="160", TERM="xterm"))
    os.close(child)
    seen = bytearray()

    def bar_drawn() -> bool:
        ready, _, _ = select.select([main], [], [], 1.0)  # a read that waits for output, up to a second
        if ready:
            try:
                seen.extend(os.read(main, 65536))
            except OSError:  # the process is gone: nothing more to read, the asserts below say what it wrote
                return True
        return bool(re.search(rb"trainer trainer.*0/%d" % total, seen)) and b"trainer_ready" in seen

    try:
        # no explorer: the trainer waits at step 0, its bar drawn below the log lines
        wait_until_sync(bar_drawn, timeout=120, poll=0, what="the trainer's progress bar and its log lines",
                        details=lambda: seen.decode(errors="replace")[-3000:])
    finally:
        proc.kill()  # by PID: the process this test started
        proc.wait()
        os.close(main)
    text = seen.decode(errors="replace")
    assert re.search(rf"trainer trainer.*0/{total}", text), text[-3000:]
    assert "trainer_ready" in text, text[-3000:]  # log lines still shown, above the bar
