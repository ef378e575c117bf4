"""The OpenAI-compatible HTTP endpoint of a serving explorer (aiohttp, as the dashboard).

Generation runs on the explorer's rollout engine through a runner (`generate.make_runner`): batched
on `vllm` (concurrent requests step together), one at a time on `hf`. The explorer loads new weights
inside the runner's gate (`engine_lock`), so a sync lands between requests, never in one. Every
response names the version that produced it (`system_fingerprint` `rolectl-v<N>`, the field
`model_version`, the header `X-Rolectl-Model-Version`). At most `serve.max_queue` requests wait or
run at once; one more gets 429 at once instead of piling up.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from openai.types import Completion, CompletionChoice, CompletionUsage, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta

from .api import ApiError, ChatRequest, CompletionRequest, RewardRequest, error_response, parse
from .generate import Generated, make_runner, model_config, prompt_limit
from .ledger import BadReward, RewardLedger, Turn, UnknownCompletion

__all__ = ["ServeEndpoint", "VERSION_HEADER", "SESSION_HEADER"]

VERSION_HEADER = "X-Rolectl-Model-Version"
SESSION_HEADER = "X-Session-Id"  # the session id for clients that cannot add a body field


class ServeEndpoint:
    """Routes, auth and back-pressure around one rollout engine and one reward ledger."""

    def __init__(self, engine: Any, ledger: RewardLedger, *, model_name: str, api_key: str | None,
                 max_queue: int, clock: Callable[[], float] = time.monotonic,
                 on_reward: Callable[[], None] = lambda: None, max_batch: int = 256) -> None:
        self.engine = engine
        self.runner = make_runner(engine, max_batch=max_batch)
        self.engine_lock = self.runner.gate  # `async with` it: no request runs inside
        self.tokenizer = engine.tokenizer
        self.ledger = ledger
        self.model_name = model_name
        self.api_key = api_key
        self.max_queue = max_queue
        self.clock = clock
        self.on_reward = on_reward
        self.closing: str | None = None  # why new requests are refused (the job finished)
        self.inflight = 0
        self.refused_busy = 0
        self.disconnected = 0  # clients gone before their stream ended
        self.created = int(time.time())
        self.app = web.Application(middlewares=[self._errors])
        self.app.add_routes([
            web.get("/v1/models", self.models),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/completions", self.completions),
            web.post("/v1/rewards", self.rewards),
        ])

    # -- plumbing ----------------------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
        try:
            self._check_key(request)
            return await handler(request)
        except ApiError as exc:
            # 429: retry shortly; 503: the job is over, and `x-should-retry` tells OpenAI's clients
            # not to retry it (they retry every 5xx otherwise)
            headers = {"Retry-After": "1"} if exc.status == 429 else {"x-should-retry": "false"} \
                if exc.status == 503 else None
            return error_response(exc, headers)
        except web.HTTPException as exc:  # unknown path or method
            return error_response(ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}",
                                           code="not_found" if exc.status == 404 else None))

    async def aclose(self) -> None:
        """Stop the runner's background work (the batcher's driver); the app is the caller's."""
        close = getattr(self.runner, "aclose", None)
        if close is not None:
            await close()

    def _check_key(self, request: web.Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("Authorization", "")
        token = given[7:] if given.startswith("Bearer ") else ""
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send it as `Authorization: Bearer <key>` (the "
                                "value of the variable the job's serve.api_key_env names)",
                           code="invalid_api_key")

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(404, f"the model {name!r} does not exist here; this endpoint serves "
                                f"{self.model_name!r} (GET /v1/models)", param="model", code="model_not_found")

    def _check_open(self) -> None:
        if self.closing is not None:
            raise ApiError(503, f"this endpoint no longer serves: {self.closing}", type="server_error",
                           code="job_finished")

    def _max_tokens(self, asked: int | None) -> int:
        # responses longer than the trainer takes (model.max_new_tokens) could not be trained on
        cap = int(self.engine.config.max_new_tokens)
        return min(asked, cap) if asked else cap

    def _check_sampling(self, req: ChatRequest | CompletionRequest) -> None:
        policy = float(self.engine.config.temperature)
        if req.temperature is not None and abs(req.temperature - policy) > 1e-6:
            raise ApiError(400, f"temperature {req.temperature:g}: this endpoint samples at the policy's "
                                f"temperature {policy:g} (model.temperature), so that its logprobs can be "
                                "trained on; leave temperature out", param="temperature")
        if req.top_p is not None and req.top_p != 1:
            raise ApiError(400, f"top_p {req.top_p:g}: this endpoint samples the whole distribution "
                                "(top_p 1) so that its logprobs can be trained on; leave top_p out", param="top_p")

    def _check_prompt(self, ids: list[int]) -> None:
        limit = prompt_limit(self.engine)
        if len(ids) > limit:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this model takes at most {limit} (its "
                                f"context minus model.max_new_tokens): shorten the conversation",
                           param="messages", code="context_length_exceeded")
        if not ids:
            raise ApiError(400, "the prompt is empty", param="messages")

    def _chat_prompt(self, req: ChatRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        # a tokenizer without a chat template (the examples' word-level one): the turns' text in order
        text = " ".join(m["content"] for m in messages if m["content"])
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def _completion_prompt(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, list):
            vocab = int(model_config(self.engine).vocab_size)
            bad = [t for t in req.prompt if t >= vocab]
            if bad:
                raise ApiError(400, f"prompt token {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt")
            return list(req.prompt)
        return list(self.tokenizer(req.prompt, add_special_tokens=True)["input_ids"])

    def _text(self, tokens: tuple[int, ...] | list[int]) -> str:
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=True))

    async def _run(self, prompt: list[int], max_tokens: int, seed: int | None,
                   on_token: Callable[[int], None] | None) -> Generated:
        """Queue for the engine (bounded), then generate in a worker thread."""
        self._check_open()
        if self.inflight >= self.max_queue:
            self.refused_busy += 1
            raise ApiError(429, f"{self.inflight} requests are already waiting or running (serve.max_queue = "
                                f"{self.max_queue}); retry shortly", type="rate_limit_error", code="queue_full")
        self.inflight += 1
        try:
            # a seed per request: the client's, else one from a fresh id (sampling stays random)
            actual = seed if seed is not None else zlib.crc32(uuid.uuid4().bytes)
            return await self.runner.run(prompt, max_tokens=max_tokens, seed=actual, on_token=on_token)
        finally:
            self.inflight -= 1

    def _record(self, completion_id: str, prompt: list[int], out: Generated, session: str | None) -> None:
        self.ledger.record(Turn(completion_id=completion_id, prompt=tuple(prompt), response=out.tokens,
                                logprobs=out.logprobs, version=out.version, stopped=out.finish_reason == "stop"),
                           session=session, now_s=self.clock())

    @staticmethod
    def _session(request: web.Request, req: ChatRequest | CompletionRequest) -> str | None:
        """The call's session id: the body's `session_id` or the `X-Session-Id` header (not two)."""
        header = request.headers.get(SESSION_HEADER)
        if header is not None and not 1 <= len(header) <= 200:
            raise ApiError(400, f"the {SESSION_HEADER} header must be 1 to 200 characters", param=SESSION_HEADER)
        if header is not None and req.session_id is not None and header != req.session_id:
            raise ApiError(400, f"session_id {req.session_id!r} and the {SESSION_HEADER} header {header!r} differ: "
                                "send one of them", param="session_id")
        return req.session_id if req.session_id is not None else header

    @staticmethod
    def _headers(version: int) -> dict[str, str]:
        return {VERSION_HEADER: str(version)}

    # -- routes ------------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        model = Model(id=self.model_name, created=self.created, object="model", owned_by="rolectl")
        return web.json_response({"object": "list", "data": [model.model_dump(mode="json")]},
                                 headers=self._headers(self.engine.version))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = await parse(request, ChatRequest)
        self._check_model(req.model)
        self._check_sampling(req)
        session = self._session(request, req)
        prompt = self._chat_prompt(req)
        self._check_prompt(prompt)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return await self._stream(request, req, cid, prompt, chat=True, session=session)
        out = await self._run(prompt, self._max_tokens(req.max_new), req.seed, None)
        self._record(cid, prompt, out, session)
        body = ChatCompletion(
            id=cid, object="chat.completion", created=int(time.time()), model=self.model_name,
            system_fingerprint=f"rolectl-v{out.version}",
            choices=[ChatChoice(index=0, finish_reason=out.finish_reason,  # type: ignore[arg-type]
                                message=ChatCompletionMessage(role="assistant", content=self._text(out.tokens)))],
            usage=_usage(prompt, out), model_version=out.version, session_id=session)
        return web.json_response(body.model_dump(mode="json", exclude_none=True), headers=self._headers(out.version))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = await parse(request, CompletionRequest)
        self._check_model(req.model)
        self._check_sampling(req)
        session = self._session(request, req)
        prompt = self._completion_prompt(req)
        self._check_prompt(prompt)
        cid = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            return await self._stream(request, req, cid, prompt, chat=False, session=session)
        out = await self._run(prompt, self._max_tokens(req.max_new), req.seed, None)
        self._record(cid, prompt, out, session)
        body = Completion(
            id=cid, object="text_completion", created=int(time.time()), model=self.model_name,
            system_fingerprint=f"rolectl-v{out.version}",
            choices=[CompletionChoice(index=0, text=self._text(out.tokens),
                                      finish_reason=out.finish_reason)],  # type: ignore[arg-type]
            usage=_usage(prompt, out), model_version=out.version, session_id=session)
        return web.json_response(body.model_dump(mode="json", exclude_none=True), headers=self._headers(out.version))

    async def _stream(self, request: web.Request, req: ChatRequest | CompletionRequest, cid: str,
                      prompt: list[int], *, chat: bool, session: str | None) -> web.StreamResponse:
        """Server-sent events: one chunk per new token, then the finish reason, then `[DONE]`."""
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue[int] = asyncio.Queue()
        job = asyncio.ensure_future(self._run(prompt, self._max_tokens(req.max_new), req.seed,
                                              lambda t: loop.call_soon_threadsafe(tokens.put_nowait, t)))
        created = int(time.time())
        getter = asyncio.ensure_future(tokens.get())
        done, _ = await asyncio.wait({job, getter}, return_when=asyncio.FIRST_COMPLETED)
        if job in done and job.exception() is not None:  # refused (429, 503): an error, not a stream
            getter.cancel()
            raise job.exception()  # type: ignore[misc]
        version = self.engine.version  # generation started inside the gate: this is its version
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               **self._headers(version)})

        def chunk(text: str | None, finish: str | None, first: bool = False) -> bytes:
            if chat:
                delta = ChoiceDelta(role="assistant" if first else None, content=text)
                body: Any = ChatCompletionChunk(
                    id=cid, object="chat.completion.chunk", created=created, model=self.model_name,
                    system_fingerprint=f"rolectl-v{version}", model_version=version,
                    choices=[ChunkChoice(index=0, delta=delta, finish_reason=finish)])  # type: ignore[arg-type]
            else:
                body = Completion(id=cid, object="text_completion", created=created, model=self.model_name,
                                  system_fingerprint=f"rolectl-v{version}", model_version=version,
                                  # a stream's text chunks have no finish reason yet (null), which
                                  # the model's type does not allow: built without validation
                                  choices=[CompletionChoice.model_construct(index=0, text=text or "", logprobs=None,
                                                                            finish_reason=finish)])
            return f"data: {json.dumps(body.model_dump(mode='json', exclude_none=True))}\n\n".encode()

        seen: list[int] = []
        sent = ""
        try:
            await response.prepare(request)
            if chat:
                await response.write(chunk("", None, first=True))
            while True:
                if getter in done:
                    seen.append(getter.result())
                    text = self._text(seen)
                    if text[len(sent):] and not text.endswith("\ufffd"):
                        await response.write(chunk(text[len(sent):], None))
                        sent = text
                    getter = asyncio.ensure_future(tokens.get())
                if job.done() and tokens.empty():
                    getter.cancel()
                    break
                done, _ = await asyncio.wait({job, getter}, return_when=asyncio.FIRST_COMPLETED)
            out = job.result()
            rest = self._text(out.tokens)[len(sent):]  # what a cut multi-byte character held back
            if rest:
                await response.write(chunk(rest, None))
            self._record(cid, prompt, out, session)
            await response.write(chunk(None if chat else "", out.finish_reason))
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError) as exc:
            # the client went away mid-stream: the generation finishes on its own (inside the gate
            # until then); the completion was not delivered, so it is not recorded
            getter.cancel()
            self.disconnected += 1
            if isinstance(exc, asyncio.CancelledError):
                raise
        return response

    async def rewards(self, request: web.Request) -> web.Response:
        req = await parse(request, RewardRequest)
        if (req.id is None) == (req.session is None):
            raise ApiError(400, "a reward names exactly one of `id` (a completion) and `session`", param="id")
        try:
            turns = self.ledger.reward(req.reward, completion_id=req.id, session=req.session, now_s=self.clock(),
                                       done=req.done)
        except BadReward as exc:
            raise ApiError(400, str(exc), param="reward") from None
        except UnknownCompletion as exc:
            raise ApiError(404, str(exc), param="id" if req.id else "session", code="not_found") from None
        if req.done:
            self.on_reward()
        return web.json_response({"object": "reward", "id": req.id, "session": req.session, "turns": turns,
                                  "reward": req.reward, "done": req.done})


def _usage(prompt: list[int], out: Generated) -> CompletionUsage:
    return CompletionUsage(prompt_tokens=len(prompt), completion_tokens=len(out.tokens),
                           total_tokens=len(prompt) + len(out.tokens))
