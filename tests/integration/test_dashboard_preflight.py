"""`rolectl dashboard` says at start what it cannot reach and what to pass, against a real
nats-server (the default monitoring guess, port 8222, is wrong for `up`'s free-port servers)."""

from __future__ import annotations

from rolectl.bus.server import free_port
from rolectl.roles.observe.dashboard import _preflight


async def test_a_reachable_server_and_monitoring_url_raise_nothing(nats_server, job_name):
    assert await _preflight(job_name, nats_server.url, nats_server.monitor_url, monitor_given=True) == []


async def test_a_wrong_monitoring_guess_names_the_flag_and_where_to_find_the_url(nats_server, job_name):
    wrong = f"http://127.0.0.1:{free_port()}"
    [problem] = await _preflight(job_name, nats_server.url, wrong, monitor_given=False)
    assert wrong in problem and "default guess" in problem
    assert "--monitor-url" in problem and "`rolectl up` prints it" in problem


async def test_nats_unreachable_says_so_and_what_to_do(job_name):
    nats = f"nats://127.0.0.1:{free_port()}"
    problems = await _preflight(job_name, nats, f"http://127.0.0.1:{free_port()}", monitor_given=True)
    assert len(problems) == 2
    assert nats in problems[0] and "rolectl server" in problems[0] and "keeps trying" in problems[0]
    assert "default guess" not in problems[1]
