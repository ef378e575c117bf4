"""`rolectl start` on a terminal shows a progress bar of steps done / total (a real process on a
pseudo-terminal, a real nats-server); in a pipe it writes log lines only."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_start_on_a_terminal_shows_steps_against_the_total(nats_url, job_name, tmp_path):
    data = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    data.update(job=job_name, run_dir=str(tmp_path / "runs"))
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(data))
    total = data["trainer"]["total_steps"]
    main, child = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "rolectl.roles.cli", "start", "trainer", "--config", str(config),
                             "--nats", nats_url], stdin=child, stdout=child, stderr=child, cwd=ROOT,
                            env=dict(os.environ, COLUMNS="160", TERM="xterm"))
    os.close(child)
    seen = b""
    try:
        deadline = time.monotonic() + 120  # a bound on "hung"
        # no explorer: the trainer waits at step 0, its bar drawn below the log lines
        while time.monotonic() < deadline and not (re.search(rb"trainer trainer.*0/%d" % total, seen)
                                                    and b"trainer_ready" in seen):
            ready, _, _ = select.select([main], [], [], 1.0)
            if ready:
                try:
                    seen += os.read(main, 65536)
                except OSError:
                    break
    finally:
        proc.kill()  # by PID: the process this test started
        proc.wait()
        os.close(main)
    text = seen.decode(errors="replace")
    assert re.search(rf"trainer trainer.*0/{total}", text), text[-3000:]
    assert "trainer_ready" in text, text[-3000:]  # log lines still shown, above the bar
