"""How served completions reach a rollout engine: one at a time on `hf` (a model's `generate`), batched
on `vllm` (continuous batching: vLLM's scheduler steps every running request together); both behind one
gate that lets the explorer load new weights between requests, never during one."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from rolectl.roles.engines.hf_model import context_length

__all__ = ["Generated", "Gate", "OneAtATime", "ContinuousBatcher", "make_runner", "generate", "model_config",
           "prompt_limit", "trajectory_budget"]


@dataclass(frozen=True, slots=True)
class Generated:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop" (end of sequence) or "length" (max_tokens reached)
    version: int


class Gate:
    """Requests pass together; `async with gate:` holds new ones back and waits for those running to
    end, so whatever runs inside (a weight load) happens between requests."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._holder = asyncio.Lock()
        self._running = 0
        self._held = False

    @property
    def running(self) -> int:
        return self._running

    @asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._held)
            self._running += 1
        try:
            yield
        finally:
            async with self._cond:
                self._running -= 1
                self._cond.notify_all()

    async def acquire(self) -> None:
        await self.__aenter__()

    def release(self) -> None:
        """`acquire`'s end, from synchronous code on the loop (as asyncio.Lock's)."""
        self._held = False
        self._holder.release()
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    async def __aenter__(self) -> None:
        await self._holder.acquire()
        try:
            async with self._cond:
                self._held = True
                await self._cond.wait_for(lambda: self._running == 0)
        except BaseException:
            await self._release()
            raise

    async def __aexit__(self, *exc: object) -> None:
        await self._release()

    async def _release(self) -> None:
        async with self._cond:
            self._held = False
            self._cond.notify_all()
        self._holder.release()


OnToken = Callable[[int], None]


class OneAtATime:
    """The `hf` engine: each request is one `generate` call, one after another."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.gate = Gate()
        self._lock = asyncio.Lock()

    async def run(self, prompt: Sequence[int], *, max_tokens: int, seed: int, on_token: OnToken | None) -> Generated:
        async with self.gate.request(), self._lock:
            return await asyncio.to_thread(generate, self.engine, prompt, max_tokens=max_tokens, seed=seed,
                                           on_token=on_token)


@dataclass(slots=True)
class _Running:
    request: Any  # vllm_engine.ServeRequest
    on_token: OnToken | None
    future: asyncio.Future
    version: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class ContinuousBatcher:
    """The `vllm` engine: requests join the running batch as they arrive (up to `max_batch` at once);
    one driver task steps the engine while any run and hands each its new tokens."""

    def __init__(self, engine: Any, *, max_batch: int = 256) -> None:
        self.engine = engine
        self.gate = Gate()
        self.max_batch = max_batch
        self._waiting: list[_Running] = []
        self._running: dict[str, _Running] = {}
        self._abort: list[str] = []
        self._wake = asyncio.Event()
        self._driver: asyncio.Task | None = None
        self.steps = 0
        self.largest_batch = 0

    async def run(self, prompt: Sequence[int], *, max_tokens: int, seed: int, on_token: OnToken | None) -> Generated:
        from rolectl.roles.engines.vllm_engine import ServeRequest

        async with self.gate.request():
            # unique across endpoints: several may share one engine (and its running requests)
            request = ServeRequest(id=f"serve-{uuid.uuid4().hex}", prompt=tuple(prompt), max_tokens=max_tokens,
                                   seed=seed)
            item = _Running(request, on_token, asyncio.get_running_loop().create_future(), self.engine.version)
            self._waiting.append(item)
            self._wake.set()
            if self._driver is None or self._driver.done():
                self._driver = asyncio.create_task(self._drive(), name="serve-batcher")
            try:
                return await asyncio.shield(item.future)
            except asyncio.CancelledError:  # the caller is gone: stop generating for it
                if item in self._waiting:
                    self._waiting.remove(item)
                elif self._running.pop(request.id, None) is not None:
                    self._abort.append(request.id)
                    self._wake.set()
                raise

    async def _drive(self) -> None:
        while True:
            if not (self._waiting or self._running or self._abort):
                self._wake.clear()
                await self._wake.wait()
                continue
            room = max(self.max_batch - len(self._running), 0)
            admit, self._waiting = self._waiting[:room], self._waiting[room:]
            abort, self._abort = self._abort, []
            for item in admit:
                self._running[item.request.id] = item
            self.largest_batch = max(self.largest_batch, len(self._running))
            try:
                deltas = await asyncio.to_thread(self.engine.serve_step, [i.request for i in admit], abort)
            except Exception as exc:  # the engine failed: every running request fails with it
                for item in self._running.values():
                    if not item.future.done():
                        item.future.set_exception(exc)
                self._running.clear()
                continue
            self.steps += 1
            for delta in deltas:
                item = self._running.get(delta.id)
                if item is None:
                    continue  # aborted meanwhile
                item.tokens.extend(delta.tokens)
                item.logprobs.extend(delta.logprobs)
                if item.on_token is not None:
                    for token in delta.tokens:
                        item.on_token(token)
                if delta.finish_reason is not None:
                    del self._running[delta.id]
                    if not item.future.done():
                        item.future.set_result(Generated(tokens=tuple(item.tokens), logprobs=tuple(item.logprobs),
                                                         finish_reason=delta.finish_reason, version=item.version))

    async def aclose(self) -> None:
        if self._driver is not None:
            self._driver.cancel()
            try:
                await self._driver
            except asyncio.CancelledError:
                pass


def make_runner(engine: Any, *, max_batch: int = 256) -> OneAtATime | ContinuousBatcher:
    """Batched where the engine can step requests together (`serve_step`), else one at a time."""
    if hasattr(engine, "serve_step"):
        return ContinuousBatcher(engine, max_batch=max_batch)
    return OneAtATime(engine)


class _TokenStreamer:
    """transformers' streamer protocol: `put` gets the prompt once, then each step's new token."""

    def __init__(self, on_token: OnToken) -> None:
        self.on_token = on_token
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.on_token(int(token))

    def end(self) -> None:
        pass


def model_config(engine: Any) -> Any:
    """The engine's Hugging Face model config (vLLM's engine keeps it beside the model it runs)."""
    return engine.hf_config if hasattr(engine, "hf_config") else engine.model.config


def trajectory_budget(serve: Any, hf_config: Any) -> int:
    """A served session's trajectory budget (tokens after its first prompt): `serve.max_trajectory_tokens`,
    else the model's context length. The trainer of a serving job takes responses this long."""
    return int(serve.max_trajectory_tokens or context_length(hf_config))


def prompt_limit(engine: Any) -> int:
    """The longest prompt the model takes with room left for a full response."""
    return context_length(model_config(engine)) - int(engine.config.max_new_tokens)


@torch.no_grad()
def generate(engine: Any, prompt: Sequence[int], *, max_tokens: int, seed: int,
             on_token: OnToken | None = None) -> Generated:
    """Sample one response to `prompt` with an `hf` engine's current weights (caller holds its gate)."""
    device = engine.config.device
    input_ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    devices = [torch.device(device)] if device.startswith("cuda") else []
    streamer = _TokenStreamer(on_token) if on_token is not None else None
    version = engine.version
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        out = engine.model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
            temperature=engine.config.temperature, top_k=0, top_p=1.0, max_new_tokens=max_tokens,
            pad_token_id=engine.pad_id, eos_token_id=engine.eos_id, output_scores=True,
            return_dict_in_generate=True, streamer=streamer)
    new = out.sequences[0, input_ids.shape[1]:]
    # the processed scores are what was sampled from (temperature applied), as in the explore loop
    logprobs = torch.stack([torch.log_softmax(s[0].float(), dim=-1) for s in out.scores])
    picked = logprobs.gather(-1, new[:len(out.scores)].unsqueeze(-1)).squeeze(-1).tolist()
    ids = new.tolist()
    stopped = engine.eos_id in ids
    n = ids.index(engine.eos_id) + 1 if stopped else len(ids)
    return Generated(tokens=tuple(ids[:n]), logprobs=tuple(picked[:n]),
                     finish_reason="stop" if stopped else "length", version=version)
