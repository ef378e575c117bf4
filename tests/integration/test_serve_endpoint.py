"""The served endpoint, talked to by the official `openai` client over real HTTP: completions, chat,
streaming, sessions, rewards into experiences, OpenAI-style errors, the API key, back-pressure."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from aiohttp import web

from rolectl.roles.config import parse_config
from rolectl.roles.engines import make_rollout_engine
from rolectl.roles.serve.endpoint import VERSION_HEADER, ServeEndpoint
from rolectl.roles.serve.ledger import RewardLedger
from tests.support.tiny_llm import built_model, data_section, model_section
from tests.support.wait import wait_until

MODEL = "serve-test"


@pytest.fixture(scope="module", params=["hf", "vllm"])
def engine(request, tmp_path_factory):
    """Each test runs on both engines: `hf` serves one request at a time, `vllm` batches them."""
    model_dir = built_model(tmp_path_factory.mktemp(request.param))
    extra = {"vllm": {"kv_cache_memory_bytes": 64 << 20}} if request.param == "vllm" else {}
    cfg = parse_config({"job": MODEL, "model": model_section(model_dir, rollout_engine=request.param, **extra),
                        "data": data_section(), "explorers": {"count": 1}})
    return make_rollout_engine(cfg, "explorer-0")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def serving(engine):
    """Start an endpoint; yield (endpoint, AsyncOpenAI client, base url)."""
    started, endpoints = [], []

    async def start(*, api_key=None, max_queue=8, timeout_s=60.0):
        ledger = RewardLedger(prefix="explorer-0-serve-t", group_size=engine.group_size, timeout_s=timeout_s)
        endpoint = ServeEndpoint(engine, ledger, model_name=MODEL, api_key=api_key, max_queue=max_queue,
                                 clock=Clock())
        endpoints.append(endpoint)
        runner = web.AppRunner(endpoint.app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
        client = openai.AsyncOpenAI(base_url=url, api_key=api_key or "none", max_retries=0)
        started.append((runner, client))
        return endpoint, client, url

    yield start
    for runner, client in started:
        await client.close()
        await runner.cleanup()
    for endpoint in endpoints:
        await endpoint.aclose()


async def test_a_chat_completion_names_its_model_version_and_is_recorded(serving, engine):
    endpoint, client, _ = await serving()
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "reverse 3 1 4 ="}])
    reply = raw.parse()
    assert raw.headers[VERSION_HEADER] == str(engine.version)
    assert reply.system_fingerprint == f"rolectl-v{engine.version}"
    assert reply.model_extra["model_version"] == engine.version
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert 0 < reply.usage.completion_tokens <= engine.config.max_new_tokens
    assert reply.usage.prompt_tokens == 5
    assert endpoint.ledger.served == 1 and endpoint.ledger.waiting == 1


async def test_a_text_completion_and_the_model_list(serving):
    _, client, _ = await serving()
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    reply = await client.completions.create(model=MODEL, prompt="reverse 1 2 3 =", max_tokens=2)
    assert reply.id.startswith("cmpl-")
    assert reply.usage.completion_tokens <= 2
    assert reply.system_fingerprint.startswith("rolectl-v")


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
async def test_streaming_yields_the_tokens_then_the_finish_reason(serving, chat):
    endpoint, client, _ = await serving()
    if chat:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "reverse 3 1 4 ="}], stream=True, seed=3)
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        stream = await client.completions.create(model=MODEL, prompt="reverse 3 1 4 =", stream=True, seed=3)
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].text for c in chunks)
    assert len(chunks) >= 3  # at least the opening, one token, the finish
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.system_fingerprint == chunks[0].system_fingerprint for c in chunks)
    assert len({c.id for c in chunks}) == 1
    # the same seed without streaming samples the same text
    if chat:
        again = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "reverse 3 1 4 ="}], seed=3)
        assert again.choices[0].message.content == text
    else:
        again = await client.completions.create(model=MODEL, prompt="reverse 3 1 4 =", seed=3)
        assert again.choices[0].text == text
    assert endpoint.ledger.served == 2


async def _reward(url: str, body, *, key: str = "none") -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.post(f"{url}/rewards", content=body if isinstance(body, (str, bytes)) else None,
                               json=None if isinstance(body, (str, bytes)) else body,
                               headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})


async def _clean_seed(client, tokenizer, messages) -> int:
    """A seed whose reply reads back as the tokens sampled (a random-init model may sample a special
    token, which the reply's text leaves out): a client sending the reply back extends the session."""
    for seed in range(64):
        reply = await client.chat.completions.create(model=MODEL, messages=messages, seed=seed)
        text, choice = reply.choices[0].message.content, reply.choices[0]
        stop = 1 if choice.finish_reason == "stop" else 0
        if text and len(tokenizer(text)["input_ids"]) + stop == reply.usage.completion_tokens:
            return seed
    raise AssertionError("no seed in 64 gives a reply without special tokens")


async def test_a_rewarded_session_becomes_one_trajectory_of_its_turns(serving, engine):
    endpoint, client, url = await serving()
    tokenizer = engine.tokenizer
    history = [{"role": "user", "content": "reverse 3 1 4 ="}]
    seed = await _clean_seed(client, tokenizer, history)
    first = await client.chat.completions.create(model=MODEL, messages=history, seed=seed,
                                                 extra_body={"session_id": "s1"})
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "reverse 3 1 4 ="}]
    # the session id as a header works as well as the body field
    second = await client.chat.completions.create(model=MODEL, messages=history, extra_headers={"X-Session-Id": "s1"})
    # three single completions of the first prompt make the group of four with the session
    singles = [await client.chat.completions.create(model=MODEL, messages=history[:1]) for _ in range(3)]
    assert (await _reward(url, {"session": "s1", "reward": 0.75})).json()["turns"] == 2
    for i, single in enumerate(singles):
        assert (await _reward(url, {"id": single.id, "reward": float(i)})).status_code == 200
    experiences = endpoint.ledger.take_groups(0.0)  # one prompt: a group at once
    assert len(experiences) == engine.group_size == 4 and len({e.group for e in experiences}) == 1
    session = {e.id: e for e in experiences}[first.id]
    assert session.reward == 0.75 and session.turns == 2
    assert tokenizer.decode(session.prompt, skip_special_tokens=True) == "reverse 3 1 4 ="
    # the response: the first reply, the client's turn (never trained on), the second reply
    sampled = [t for t, m in zip(session.response, session.loss_mask) if m]
    added = [t for t, m in zip(session.response, session.loss_mask) if not m]
    assert tokenizer.decode(added, skip_special_tokens=True) == "reverse 3 1 4 ="
    assert tokenizer.decode(sampled, skip_special_tokens=True) == \
        f"{first.choices[0].message.content} {second.choices[0].message.content}".strip()
    assert len(sampled) == first.usage.completion_tokens - (first.choices[0].finish_reason == "stop") + \
        second.usage.completion_tokens  # the first reply's end-of-turn token was not sent back: dropped
    assert all(lp <= 0 for lp in session.logprobs) and session.model_version == engine.version
    assert endpoint.ledger.rewarded == 4 and endpoint.ledger.counts()["trajectory_splits_history"] == 0


async def test_a_rewritten_history_splits_the_session_and_turn_rewards_add_up(serving):
    endpoint, client, url = await serving()
    first = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "reverse 1 2 3 ="}],
                                                 extra_body={"session_id": "s2"})
    rewritten = [{"role": "user", "content": "reverse 4 5 6 ="}]  # not the conversation so far
    second = await client.chat.completions.create(model=MODEL, messages=rewritten, extra_body={"session_id": "s2"})
    turn = await _reward(url, {"id": first.id, "reward": 0.25, "done": False})
    assert turn.json() == {"object": "reward", "id": first.id, "session": None, "turns": 2, "reward": 0.25,
                           "done": False}
    assert endpoint.ledger.waiting == 1  # a per-turn reward leaves the session open
    assert (await _reward(url, {"session": "s2", "reward": 0.5})).json()["done"] is True
    for _ in range(2):  # two more make a group of four
        single = await client.completions.create(model=MODEL, prompt="reverse 7 8 9 =")
        await _reward(url, {"id": single.id, "reward": 0.0})
    by_id = {e.id: e for e in endpoint.ledger.take_groups(10.0)}
    assert len(by_id) == 4 and by_id[first.id].reward == by_id[second.id].reward == 0.75
    assert endpoint.ledger.counts()["trajectory_splits_history"] == 1
    async with httpx.AsyncClient() as http:
        clash = await http.post(f"{url}/chat/completions", headers={"X-Session-Id": "a"},
                                json={"model": MODEL, "messages": rewritten, "session_id": "b"})
    assert clash.status_code == 400 and "differ" in clash.json()["error"]["message"]


async def test_reward_errors_unknown_twice_expired_and_not_finite(serving):
    endpoint, client, url = await serving(timeout_s=5.0)
    reply = await client.completions.create(model=MODEL, prompt="reverse 1 2 3 =")
    assert (await _reward(url, {"id": "cmpl-nope", "reward": 1.0})).status_code == 404
    bad = await _reward(url, '{"id": "' + reply.id + '", "reward": NaN}')
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reward"
    assert (await _reward(url, {"id": reply.id, "session": "x", "reward": 1.0})).status_code == 400
    assert (await _reward(url, {"id": reply.id, "reward": 1.0})).status_code == 200
    again = await _reward(url, {"id": reply.id, "reward": 1.0})
    assert again.status_code == 404 and "already rewarded" in again.json()["error"]["message"]
    late = await client.completions.create(model=MODEL, prompt="reverse 1 2 3 =")
    endpoint.clock.now = 6.0
    assert endpoint.ledger.expire(endpoint.clock()) == 1
    expired = await _reward(url, {"id": late.id, "reward": 1.0})
    assert expired.status_code == 404 and "expired" in expired.json()["error"]["message"]
    assert endpoint.ledger.counts()["expired"] == 1.0


async def test_openai_style_errors_for_bad_requests(serving):
    _, client, url = await serving()
    with pytest.raises(openai.NotFoundError) as unknown:
        await client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert unknown.value.code == "model_not_found" and "serve-test" in unknown.value.message
    with pytest.raises(openai.BadRequestError) as long:
        await client.completions.create(model=MODEL, prompt=[1] * 100_000)
    assert long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as hot:
        await client.completions.create(model=MODEL, prompt="reverse 1 2 3 =", temperature=0.2)
    assert hot.value.param == "temperature"
    async with httpx.AsyncClient() as http:
        broken = await http.post(f"{url}/chat/completions", content=b"{not json",
                                 headers={"Content-Type": "application/json"})
        assert broken.status_code == 400 and broken.json()["error"]["code"] == "invalid_json"
        empty = await http.post(f"{url}/chat/completions", json={"model": MODEL, "messages": []})
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"


async def test_an_api_key_is_required_when_configured(serving):
    _, client, url = await serving(api_key="sekret")
    assert (await client.models.list()).data[0].id == MODEL
    wrong = openai.AsyncOpenAI(base_url=url, api_key="guess", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        await wrong.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    await wrong.close()
    async with httpx.AsyncClient() as http:
        assert (await http.get(f"{url}/models")).status_code == 401  # no key at all
        assert (await http.post(f"{url}/rewards", json={"id": "x", "reward": 1})).status_code == 401


async def test_a_burst_beyond_the_queue_gets_429_and_the_rest_are_served(serving):
    endpoint, client, _ = await serving(max_queue=2)
    await endpoint.engine_lock.acquire()  # hold the engine, as a long generation would
    calls = [asyncio.ensure_future(client.completions.create(model=MODEL, prompt="reverse 1 2 3 =")) for _ in range(5)]
    try:
        await wait_until(lambda: endpoint.inflight == 2 and endpoint.refused_busy == 3, timeout=30, poll=0.01,
                         what="two requests queued and three refused")
    finally:
        endpoint.engine_lock.release()
    results = await asyncio.gather(*calls, return_exceptions=True)
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    served = [r for r in results if not isinstance(r, Exception)]
    assert len(refused) == 3 and len(served) == 2
    assert refused[0].code == "queue_full"
    assert (await client.completions.create(model=MODEL, prompt="reverse 1 2 3 =")).choices  # still serving


async def test_weights_loaded_between_requests_change_the_version_it_reports(serving, engine):
    endpoint, client, _ = await serving()
    before = await client.completions.create(model=MODEL, prompt="reverse 1 2 3 =")
    async with endpoint.engine_lock:  # the serving explorer loads under this lock
        engine.load_weights(engine.weight_buffers(), engine.version + 1)
    after = await client.completions.create(model=MODEL, prompt="reverse 1 2 3 =")
    assert int(after.system_fingerprint.removeprefix("rolectl-v")) == int(
        before.system_fingerprint.removeprefix("rolectl-v")) + 1


async def test_a_client_gone_mid_stream_leaves_the_endpoint_serving(serving):
    endpoint, client, url = await serving()
    body = {"model": MODEL, "prompt": "reverse 1 2 3 =", "stream": True}
    await endpoint.engine_lock.acquire()  # its generation waits: the client leaves before the stream ends
    try:
        async with httpx.AsyncClient() as http:
            leaving = asyncio.ensure_future(http.post(f"{url}/completions", json=body))
            await wait_until(lambda: endpoint.inflight == 1, timeout=30, poll=0.01, what="the stream queued")
            leaving.cancel()
            with pytest.raises(asyncio.CancelledError):
                await leaving
    finally:
        endpoint.engine_lock.release()
    await wait_until(lambda: endpoint.inflight == 0 and endpoint.disconnected == 1, timeout=30, poll=0.01,
                     what="the abandoned stream ended")
    reply = await client.completions.create(model=MODEL, prompt="reverse 1 2 3 =")
    assert reply.choices and endpoint.ledger.served == 1  # only the delivered one is recorded


async def test_concurrent_clients_are_served_together_and_sample_as_alone(serving, engine):
    """On `vllm` requests in flight together step together (one batch); on `hf` one at a time. A
    request's seed decides its sample either way: batching changes no response."""
    endpoint, client, _ = await serving(max_queue=16)
    prompts = [f"reverse {i} {i + 1} {i + 2} =" for i in range(8)]
    alone = [(await client.completions.create(model=MODEL, prompt=p, seed=i)).choices[0].text
             for i, p in enumerate(prompts)]
    together = await asyncio.gather(*(client.completions.create(model=MODEL, prompt=p, seed=i)
                                      for i, p in enumerate(prompts)))
    assert [r.choices[0].text for r in together] == alone
    assert endpoint.ledger.served == 2 * len(prompts)
    if hasattr(engine, "serve_step"):
        assert endpoint.runner.largest_batch > 1  # the burst shared engine steps
        assert endpoint.runner.steps < 2 * len(prompts) * engine.config.max_new_tokens


async def test_a_weight_load_waits_for_the_requests_running_then_holds_new_ones(serving, engine):
    endpoint, client, _ = await serving()
    running = [asyncio.ensure_future(client.completions.create(model=MODEL, prompt="reverse 1 2 3 =", seed=i))
               for i in range(3)]
    # All three past the gate (running, or already answered): one still on its way to the endpoint
    # would be held by the load below and answered by the new version.
    await wait_until(lambda: endpoint.engine_lock.running + sum(r.done() for r in running) == 3,
                     timeout=30, poll=0.01, what="the three requests running or answered")
    before = engine.version
    async with endpoint.engine_lock:  # what the serving explorer does to load weights
        assert endpoint.engine_lock.running == 0  # every request that was running has finished
        late = asyncio.ensure_future(client.completions.create(model=MODEL, prompt="reverse 4 5 6 ="))
        await wait_until(lambda: endpoint.inflight == 1, timeout=30, poll=0.01, what="the late request queued")
        engine.load_weights(engine.weight_buffers(), before + 1)
    done = await asyncio.gather(*running)
    assert all(r.model_extra["model_version"] == before for r in done)
    assert (await late).model_extra["model_version"] == before + 1  # it waited for the load


@pytest.mark.parametrize("budget, expected", [(None, 128), (40, 40)])
def test_a_serving_job_s_trainer_takes_trajectories_of_the_session_budget(tmp_path, budget, expected):
    """Explorer and trainer agree: the served sessions' budget (by default the model's context) is
    what the trainer's validation takes."""
    from rolectl.roles.engines import make_train_engine
    from rolectl.roles.serve.generate import model_config, trajectory_budget

    model_dir = built_model(tmp_path)
    serve = {"enabled": True, **({"max_trajectory_tokens": budget} if budget else {})}
    cfg = parse_config({"job": MODEL, "model": model_section(model_dir, rollout_engine="hf"), "data": data_section(),
                        "serve": serve})
    trainer = make_train_engine(cfg)
    assert trainer.experience_limits.max_response_length == expected
    assert trajectory_budget(cfg.serve, model_config(trainer)) == expected
    single = parse_config({"job": MODEL, "model": model_section(model_dir), "data": data_section()})
    assert make_train_engine(single).experience_limits.max_response_length == 5  # not serving: as before


async def test_the_multi_turn_agent_variant_makes_sessions_of_two_turns(serving, engine):
    """examples/agent_digits.py --min-turns 2 --turn-rewards, against the endpoint: every session has
    two calls, each rewarded as a turn, and becomes a trajectory (or, where the client's text could not
    carry a special token the model sampled, two: a split, counted)."""
    import os
    import sys

    from tests.support.tiny_llm import ROOT

    endpoint, _, url = await serving()
    agent = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "examples" / "agent_digits.py"), "--model", MODEL, "--attempts", "4",
        "--episodes", "4", "--turns", "2", "--min-turns", "2", "--turn-rewards",
        env={**os.environ, "OPENAI_BASE_URL": url, "OPENAI_API_KEY": "none"},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    output, _ = await asyncio.wait_for(agent.communicate(), 300)
    assert agent.returncode == 0, output.decode()
    assert '"episodes": 4' in output.decode()
    counts = endpoint.ledger.counts()
    assert counts["served_requests"] == 8 and counts["rewarded"] == 4 and counts["awaiting_reward"] == 0
    experiences = endpoint.ledger.take_groups(10.0)
    splits = int(counts["trajectory_splits_history"])
    assert len(experiences) + endpoint.ledger.ungrouped == 4 + splits
    for e in experiences:
        if e.loss_mask is not None:  # the session's two calls as one trajectory
            assert e.turns == 2 or (e.turns == 1 and e.loss_mask[0] == 0)  # a first answer of only <eos>: dropped
            context = [t for t, m in zip(e.response, e.loss_mask) if not m]
            assert engine.tokenizer.decode(context, skip_special_tokens=True) == \
                engine.tokenizer.decode(e.prompt, skip_special_tokens=True)
