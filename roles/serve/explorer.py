"""A serving explorer: the explorer role given a loop that serves an OpenAI-compatible endpoint
instead of exploring its task set.

Everything else is the explorer's: joining the job, the first pull, following newer versions in the
background (`fully_async`), the saved step, the trainer's grace. The serve loop, every `_TICK_S` or
when a reward arrives: load the newest fetched weights between two requests, expire completions
whose reward did not come, publish every full group of rewarded experiences as one batch (validated
as the trainer will), and report the traffic counts with the step. It stops serving once the
trainer has finished.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from pathlib import Path

from aiohttp import web

from rolectl.bus.errors import describe
from rolectl.bus.experiences import ExperienceBatch, validate_batch
from rolectl.roles.config import EnvSettings, env_settings
from rolectl.roles.explorer import Explorer
from rolectl.roles.resume import StartMode
from rolectl.roles.session import JobIncomplete, write_json_atomic
from rolectl.sync_protocol import ConfigError, SyncStyle
from rolectl.sync_protocol.experience import ExperienceLimits

from .endpoint import ServeEndpoint
from .generate import model_config, trajectory_budget
from .ledger import RewardLedger

__all__ = ["ServeLoop", "serving_explorer", "serve_problems"]

_TICK_S = 1.0
_AGENT_STOP_S = 10.0


def serve_problems(cfg) -> list[tuple[str, str]]:
    """What keeps this job from serving, as (dotted path, reason)."""
    problems = []
    sync = cfg.synchronizer
    if sync.sync_style is not SyncStyle.FULLY_ASYNC or sync.sync_method.is_rendezvous:
        problems.append(("synchronizer.sync_style",
                         f"serve mode needs sync_style fully_async with a pull method (memory or checkpoint), "
                         f"got {sync.sync_style.value} with {sync.sync_method.value}: a served request must never "
                         "wait for a sync"))
    engine = cfg.model.rollout_engine or cfg.model.engine
    if engine not in ("hf", "vllm"):
        problems.append(("model.rollout_engine",
                         f"serve mode serves from the `hf` or `vllm` rollout engine, got {engine!r}"))
    env = cfg.serve.api_key_env
    if env is not None and not os.environ.get(env):
        problems.append(("serve.api_key_env", f"the variable {env} is not set (or empty) where the explorer runs: "
                                              "set it to the API key clients must send"))
    return problems


def serving_explorer(cfg, member_id: str, *, start_mode: StartMode = StartMode.AUTO) -> Explorer:
    """An explorer that serves requests instead of exploring its task set (`ServeLoop`); a job
    that cannot serve is refused before any engine is built."""
    problems = serve_problems(cfg)
    if problems:
        raise ConfigError(problems, where=cfg.source or "config")
    return Explorer(cfg, member_id, start_mode=start_mode, loop=ServeLoop)


class ServeLoop:
    """The serving explorer's loop: the endpoint up (and the agent beside it), then rewarded
    groups published as steps until the trainer has finished."""

    def __init__(self, explorer: Explorer):
        self.explorer = explorer
        engine, member_id = explorer.engine, explorer.member_id
        self.serve = explorer.cfg.serve
        self.index = int(member_id.rsplit("-", 1)[-1]) if member_id.rsplit("-", 1)[-1].isdigit() else 0
        budget = trajectory_budget(self.serve, model_config(engine))
        self.ledger = RewardLedger(prefix=f"{member_id}-serve-{uuid.uuid4().hex[:8]}",
                                   group_size=engine.group_size, timeout_s=self.serve.reward_timeout_s,
                                   max_response_tokens=budget,
                                   discount=self.serve.discount if self.serve.reward == "discounted" else 1.0)
        self.url_file = explorer.cfg.job_dir / member_id / "serve_url"
        self._wake = asyncio.Event()
        self._last_batch_size = 0
        self._reported: dict[str, float] = {}
        self.limits = ExperienceLimits(vocab_size=int(model_config(engine).vocab_size), prompt_length=None,
                                       max_response_length=budget, group_size=engine.group_size)

    async def run(self) -> None:
        x = self.explorer
        api_key = os.environ.get(self.serve.api_key_env) if self.serve.api_key_env else None
        self.endpoint = ServeEndpoint(x.engine, self.ledger, model_name=self.serve.model_name or x.cfg.job,
                                      api_key=api_key, max_queue=self.serve.max_queue, on_reward=self._wake.set)
        runner = web.AppRunner(self.endpoint.app, access_log=None)
        await runner.setup()
        agent: asyncio.subprocess.Process | None = None
        try:
            port = self.serve.port + self.index if self.serve.port else 0
            site = web.TCPSite(runner, self.serve.host, port)
            await site.start()
            bound = runner.addresses[0][1]
            # a wildcard bind is reached at the address the launcher advertises for this machine
            wildcard = self.serve.host in ("0.0.0.0", "", "::")
            host = (env_settings().advertise_host or "127.0.0.1") if wildcard else self.serve.host
            url = f"http://{host}:{bound}/v1"
            self.url_file.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.url_file, {"url": url, "model": self.endpoint.model_name})
            x.log.info("serving", url=url, model=self.endpoint.model_name, version=x.engine.version,
                       api_key=bool(api_key))
            if self.serve.agent and self.index == 0:
                agent = await self._start_agent(url, api_key)
            await self._serve(agent)
        finally:
            if self.endpoint.closing is None:
                self.endpoint.closing = "the explorer is stopping"
            if agent is not None:
                await self._stop_agent(agent)
            await runner.cleanup()
            await self.endpoint.aclose()
            self.url_file.unlink(missing_ok=True)

    async def _serve(self, agent: asyncio.subprocess.Process | None) -> None:
        x = self.explorer
        while True:
            async with self.endpoint.engine_lock:  # between two requests, never during one
                await x.apply_background_weights()
            self.ledger.expire(time.monotonic())
            await self._publish_rewarded()
            await self._report_counts()
            if x.stops_with_trainer():
                x.log.info("trainer_finished_stop_serving", **self.ledger.counts())
                self.endpoint.closing = "the job's trainer has finished"
                x.finished = True
                return
            x.raise_if_trainer_gone()
            if agent is not None and agent.returncode not in (None, 0):
                raise JobIncomplete(f"the agent {' '.join(self.serve.agent or ())!r} exited with code "
                                    f"{agent.returncode} (its output is in this log)")
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), _TICK_S)
            except asyncio.TimeoutError:
                pass

    async def _publish_rewarded(self) -> None:
        x = self.explorer
        experiences = self.ledger.take_groups(time.monotonic())
        if not experiences:
            return
        batch = ExperienceBatch.of(x.member_id, x.explore_step + 1, tuple(experiences))
        validate_batch(batch, self.limits)  # what the trainer will check: refuse here, not there
        await x.publish_batch(batch)
        self._last_batch_size = len(experiences)
        reward = sum(e.reward for e in experiences) / len(experiences)
        await self._report_counts(force=True, reward=reward)
        x.save_state()
        x.log.info("served_batch", step=x.explore_step, experiences=len(experiences), reward=round(reward, 4),
                   **self.ledger.counts())

    async def _report_counts(self, *, force: bool = False, reward: float | None = None) -> None:
        """A StepFinished carries the traffic counts (the job's one fold reads them from there)."""
        x = self.explorer
        counts = {**self.ledger.counts(), "refused_busy": float(self.endpoint.refused_busy)}
        if not force and (counts == self._reported or x.explore_step == 0):
            return
        self._reported = counts
        metrics = {**counts, "experiences": float(self._last_batch_size),
                   "total_steps": float(x.cfg.explorers.total_steps)}
        if reward is not None:
            metrics["reward_mean"] = reward
        await x.report_step(metrics)

    async def _start_agent(self, url: str, api_key: str | None) -> asyncio.subprocess.Process:
        # `python` in the command is this interpreter's (the job's virtual environment)
        path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
        env = {**os.environ, "PATH": path, "OPENAI_BASE_URL": url, "OPENAI_API_KEY": api_key or "none",
               EnvSettings.variable("serve_model"): self.endpoint.model_name}
        command = list(self.serve.agent or ())
        # its own session: a terminal's Ctrl-C reaches the explorer, which ends the agent (_stop_agent)
        proc = await asyncio.create_subprocess_exec(*command, env=env, cwd=str(Path.cwd()), start_new_session=True,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        self.explorer.log.info("agent_started", command=command, pid=proc.pid)
        self._agent_log = asyncio.create_task(self._follow_agent(proc), name="agent-log")
        return proc

    async def _follow_agent(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        log = self.explorer.log
        async for line in proc.stdout:
            log.info("agent", line=line.decode(errors="replace").rstrip())
        code = await proc.wait()
        log.info("agent_exited", code=code)
        self._wake.set()

    async def _stop_agent(self, proc: asyncio.subprocess.Process) -> None:
        """The agent sees 503 and ends; one that does not is terminated."""
        try:
            await asyncio.wait_for(proc.wait(), _AGENT_STOP_S)
        except asyncio.TimeoutError:
            self.explorer.log.warning("agent_terminated", pid=proc.pid)
            proc.terminate()
            await proc.wait()
        except Exception as exc:
            self.explorer.log.warning("agent_stop_failed", error=describe(exc))
        await asyncio.wait_for(self._agent_log, _AGENT_STOP_S)
