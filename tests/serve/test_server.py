"""The OpenAI-compatible server (`python -m serve.server`), tested as a real subprocess.

One server (SmolLM2-135M, autoregressive, 4 slots, 512-token cache, an API key) serves the
whole module, driven through the official `openai` client and raw httpx:
- greedy completions and chat completions, streamed and not, equal `ds.generate()` text;
- malformed JSON, an unknown model, invalid sampling values, an over-long prompt, n > 1, a
  wrong or missing API key: 4xx with an OpenAI error body, and the server keeps serving;
- a full queue answers 429; clients that disconnect have their requests (queued or running)
  cancelled and their slots freed;
- 32 concurrent streaming clients, 2 of which leave mid-stream: the other 30 get exactly their
  greedy text, no slot leaks, and /metrics agrees with what the clients received;
- SIGTERM lets a request in flight finish, then the process exits.
- soak (marked `slow` and `soak`; `-m "not soak"` skips it, ~3 min): two minutes at a steady
  rate with mixed sampling: after warm-up the server's RSS stays within a small margin and
  nothing compiles.
Runtime without the soak: ~2.5 min on a shared 2-core CPU (server start and reference
generation overlap).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.slow  # see conftest.py, "test tiers"

openai = pytest.importorskip("openai")

import dspark_jax as ds  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY = "test-key-123"
MODEL = "smollm2-135m"
SLOTS, MAX_QUEUE, MAX_LEN, LIMIT = 4, 28, 512, 64
NEW = 16

# (endpoint, prompt, stop): completions take a string, chat a user message.
CASES = [
    ("completions", "The capital of France is", None),
    ("completions", "def fibonacci(n):\n", None),
    ("completions", "My favourite colours are red,", ","),
    ("chat", "What is 2 + 2?", None),
    ("chat", "Name three animals that live in the sea.", None),
    ("chat", "Write a haiku about rain.", None),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    def __init__(self, log_path, *extra):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "serve.server", "--target", MODEL, "--drafter", "none", "--slots", str(SLOTS),
               "--max-len", str(MAX_LEN), "--max-tokens-limit", str(LIMIT), "--max-queue", str(MAX_QUEUE),
               "--port", str(self.port), "--api-key", KEY, "--no-access-log", *extra]
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def tail(self, n=40) -> str:
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])

    def wait_ready(self, timeout=600):
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        pytest.fail(f"the server did not start in {timeout} s:\n{self.tail()}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, v = line.rsplit(" ", 1)
                out[name] = float(v)
        return out

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            kb = int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))
        return kb / 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProc(tmp_path_factory.mktemp("server") / "server.log")
    yield srv
    srv.stop()


def _prompt(endpoint, text):
    return text if endpoint == "completions" else [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def refs(server, smollm2):
    """Greedy references from the library, computed while the server process warms up."""
    prompts = [_prompt(e, p) for e, p, _ in CASES]
    sps = [ds.SamplingParams(temperature=0.0, max_new_tokens=NEW, stop=(s,) if s else ()) for _, _, s in CASES]
    out = ds.generate(smollm2, prompts, sampling=sps)
    return [dict(text=t, n=len(ids)) for t, ids in zip(out.texts, out.token_ids)]


@pytest.fixture(scope="module")
def client(server):
    server.wait_ready()
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def _kw(endpoint, text, stop, **kw):
    kw = dict(model=MODEL, max_tokens=NEW, temperature=0, **kw)
    if stop:
        kw["stop"] = stop
    if endpoint == "completions":
        return dict(prompt=text, **kw)
    return dict(messages=[{"role": "user", "content": text}], **kw)


def _create(cl, endpoint, **kw):
    return (cl.completions if endpoint == "completions" else cl.chat.completions).create(**kw)


def _piece(chunk, endpoint):
    if not chunk.choices:
        return None
    c = chunk.choices[0]
    return c.text if endpoint == "completions" else c.delta.content


def test_greedy_text_equals_generate(refs, client):  # refs first: computed while the server starts
    for (endpoint, text, stop), ref in zip(CASES, refs):
        r = _create(client, endpoint, **_kw(endpoint, text, stop))
        c = r.choices[0]
        got = c.text if endpoint == "completions" else c.message.content
        assert got == ref["text"], (endpoint, text)
        assert r.usage.completion_tokens == ref["n"]
        assert c.finish_reason == ("length" if ref["n"] == NEW and not stop else "stop")
        assert r.object == ("text_completion" if endpoint == "completions" else "chat.completion")

        pieces, usage, finish = [], None, None
        for chunk in _create(client, endpoint, stream=True, stream_options={"include_usage": True},
                             **_kw(endpoint, text, stop)):
            if chunk.usage is not None:
                usage = chunk.usage
            p = _piece(chunk, endpoint)
            if p:
                pieces.append(p)
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        assert "".join(pieces) == ref["text"], (endpoint, text, pieces)
        assert usage.completion_tokens == ref["n"] and usage.prompt_tokens == r.usage.prompt_tokens
        assert finish == c.finish_reason


def _error(resp) -> dict:
    body = resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, client):
    h = {"Authorization": f"Bearer {KEY}"}
    url = server.url + "/v1/completions"
    r = httpx.post(url, content=b'{"model": "smollm2-135m", "prompt": ', headers=h)
    assert r.status_code == 400 and "not valid JSON" in _error(r)["message"]
    r = httpx.post(url, content=b"[1, 2]", headers=h)
    assert r.status_code == 400 and "JSON object" in _error(r)["message"]
    r = httpx.post(url, json={"prompt": 3}, headers=h)
    assert r.status_code == 400 and _error(r)["param"] == "prompt"

    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-5", prompt="hi")
    assert "gpt-5" in e.value.message and e.value.body["code"] == "model_not_found"
    for kw, param in [(dict(temperature=-1), "temperature"), (dict(top_p=2), "top_p"),
                      (dict(extra_body={"top_k": -3}), "top_k"), (dict(extra_body={"min_p": 1.5}), "min_p"),
                      (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=LIMIT + 1), "max_tokens"),
                      (dict(n=2), "n"), (dict(stop=[""]), "stop"), (dict(seed="x"), "seed")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="hi", **kw)
        assert e.value.body["param"] == param, (kw, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 600}])
    assert e.value.body["code"] == "context_length_exceeded" and "maximum context length" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # fits alone, not with the completion
        client.completions.create(model=MODEL, prompt="word " * 480, max_tokens=LIMIT)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])

    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "invalid_api_key"
    r = httpx.post(url, json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 401 and "Missing API key" in _error(r)["message"]
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # open, as /metrics
    r = httpx.get(server.url + "/v1/nothing", headers=h)
    assert r.status_code == 404 and _error(r)

    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens == 4
    m = server.metrics()
    assert m['dspark_http_requests_total{endpoint="/v1/completions",code="400"}'] >= 10
    if os.path.exists("/proc/self/maps"):  # the memory maps compiled programs hold, far from the limit
        assert 0 < m["dspark_memory_maps"] < 0.85 * m["dspark_memory_maps_limit"]
        assert m["dspark_compiled_program_drops_total"] == 0
    assert m['dspark_http_requests_total{endpoint="/v1/completions",code="401"}'] >= 2


async def _open_stream(http, i):
    """A streaming request that cannot finish soon (ignore_eos, the largest budget); returns
    once the server has accepted it (response headers)."""
    req = http.build_request("POST", "/v1/completions", json={
        "model": MODEL, "prompt": f"Count to {100 + i}:", "max_tokens": LIMIT, "ignore_eos": True,
        "temperature": 0, "stream": True})
    resp = await http.send(req, stream=True)
    return resp


def _wait_idle(server, timeout=60) -> dict:
    t0 = time.time()
    while True:
        m = server.metrics()
        if m["dspark_running_requests"] == 0 and m["dspark_queued_requests"] == 0:
            return m
        assert time.time() - t0 < timeout, f"slots not freed: {m['dspark_running_requests']} running, " \
                                           f"{m['dspark_queued_requests']} queued"
        time.sleep(0.5)


def test_full_queue_429_and_disconnects_free_queued_and_running(server, client):
    m0 = _wait_idle(server)

    async def run():
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"},
                                     limits=limits, timeout=120) as http:
            streams = await asyncio.gather(*[_open_stream(http, i) for i in range(SLOTS + MAX_QUEUE)])
            assert all(s.status_code == 200 for s in streams)
            over = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            for s in streams:
                await s.aclose()
            return over

    over = asyncio.run(run())
    assert over.status_code == 429 and _error(over)["code"] == "too_many_requests"
    m = _wait_idle(server)
    cancelled = 'dspark_requests_finished_total{reason="cancelled"}'
    assert m[cancelled] - m0[cancelled] == SLOTS + MAX_QUEUE
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length"


def test_32_concurrent_streams_two_disconnect(server, refs):
    n_clients, leave = 32, {5, 18}
    m0 = _wait_idle(server)

    async def one(cl, i):
        endpoint, text, stop = CASES[i % len(CASES)]
        kw = _kw(endpoint, text, stop, stream=True, stream_options={"include_usage": True})
        if i in leave:  # cannot finish before it leaves
            kw.update(max_tokens=LIMIT, extra_body={"ignore_eos": True})
        stream = await (cl.completions if endpoint == "completions" else cl.chat.completions).create(**kw)
        pieces, usage, first = [], None, True
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            p = _piece(chunk, endpoint)
            if p:
                pieces.append(p)
                if i in leave and first:
                    await stream.close()  # the client goes away mid-stream
                    return i, None, None
                first = False
        return i, "".join(pieces), usage

    async def run():
        cl = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        res = await asyncio.gather(*[one(cl, i) for i in range(n_clients)])
        await cl.close()
        return res

    results = asyncio.run(run())
    done = [(i, t, u) for i, t, u in results if i not in leave]
    for i, text, usage in done:
        ref = refs[i % len(CASES)]
        assert text == ref["text"], (i, CASES[i % len(CASES)])
        assert usage.completion_tokens == ref["n"]
    m = _wait_idle(server, timeout=30)  # no slot leaks

    def d(name):
        return m[name] - m0.get(name, 0.0)

    finished = d('dspark_requests_finished_total{reason="length"}') + d('dspark_requests_finished_total{reason="stop"}')
    assert finished == len(done) and d('dspark_requests_finished_total{reason="cancelled"}') == len(leave)
    assert d('dspark_http_requests_total{endpoint="/v1/completions",code="200"}') + \
        d('dspark_http_requests_total{endpoint="/v1/chat/completions",code="200"}') == n_clients
    prompt_tokens = {i % len(CASES): u.prompt_tokens for i, _, u in done}
    assert d("dspark_prompt_tokens_total") == sum(prompt_tokens[i % len(CASES)] for i in range(n_clients))
    received = sum(u.completion_tokens for _, _, u in done)
    assert received + len(leave) <= d("dspark_generation_tokens_total") <= received + len(leave) * LIMIT
    assert d("dspark_ttft_seconds_count") == n_clients and d("dspark_e2e_seconds_count") == len(done)
    assert d("dspark_decode_cycles_total") > 0 and m["dspark_tau"] == 1.0  # autoregressive


# Seconds of measured load in the soak (after 30 s of warm-up load). The suite runs 30 s; the
# issue's few-minute soak is `DSPARK_SOAK_S=300 python -m pytest -q -m soak tests/serve/test_server.py`.
SOAK_S = float(os.environ.get("DSPARK_SOAK_S", "30"))


@pytest.mark.slow
@pytest.mark.soak
def test_soak_memory_and_compiles_stay_flat(server, client):
    """Warm-up, then SOAK_S seconds of Poisson arrivals (0.5/s) with mixed sampling, prompt
    lengths across both attention windows, streaming or not, stop strings, disconnects."""
    _wait_idle(server)
    long_prompt = "The history of the printing press " * 40  # > 256 tokens: the second attention window
    rng = random.Random(0)

    def request(i, warm=False):
        kind = i % 6
        kw = dict(model=MODEL, max_tokens=rng.choice([4, 8, 16]))
        if kind == 0:
            kw.update(temperature=0)
        elif kind == 1:
            kw.update(temperature=0.8, top_p=0.9, seed=i)
        elif kind == 2:
            kw.update(temperature=1.0, extra_body={"top_k": rng.choice([1, 5, 40, 300]), "min_p": 0.05})
        elif kind == 3:
            kw.update(temperature=0.7, stop=["\n", "."])
        elif kind == 4:
            kw.update(temperature=0, stop="e")
        else:
            kw.update(temperature=1.2)
        prompt = long_prompt if rng.random() < 0.2 or (warm and i < 2) else f"Tell me about item {i}."
        stream = rng.random() < 0.5
        leave = stream and rng.random() < 0.1
        if stream:
            s = client.completions.create(prompt=prompt, stream=True, **kw)
            for _ in s:
                if leave:
                    s.close()
                    break
        else:
            client.completions.create(prompt=prompt, **kw)

    # Warm-up: long prompts alone (greedy-only and sampled batches), then the mixed load.
    request(0, warm=True)
    request(1, warm=True)
    _run_load(request, seconds=30, rate=0.5, rng=rng, start=2)
    _wait_idle(server)
    rss0, c0 = server.rss_mb(), server.metrics()["dspark_xla_compiles_total"]
    n = _run_load(request, seconds=SOAK_S, rate=0.5, rng=rng, start=1000)
    _wait_idle(server)
    rss1, m = server.rss_mb(), server.metrics()
    print(f"soak: {n} requests, RSS {rss0:.0f} → {rss1:.0f} MB, compiles {c0:.0f} → "
          f"{m['dspark_xla_compiles_total']:.0f}")
    assert n >= 0.2 * SOAK_S  # 40% of the 0.5/s the seeded gaps draw (15 at 30 s): the load really ran
    assert m["dspark_xla_compiles_total"] == c0, "compiled after warm-up"
    assert rss1 - rss0 < max(48.0, 0.05 * rss0), f"RSS grew from {rss0:.0f} to {rss1:.0f} MB over {n} requests"


def _run_load(request, *, seconds, rate, rng, start) -> int:
    from concurrent.futures import ThreadPoolExecutor

    futures, t_end, i = [], time.time() + seconds, start
    with ThreadPoolExecutor(32) as pool:
        while time.time() < t_end:
            futures.append(pool.submit(request, i))
            i += 1
            time.sleep(rng.expovariate(rate))
        for f in futures:
            f.result()
    return len(futures)


def test_sigterm_finishes_the_request_in_flight(server, client):
    """Last: SIGTERM while a request streams; it completes, then the process exits."""
    _wait_idle(server)
    stream = client.completions.create(model=MODEL, prompt="Count from one to fifty:", max_tokens=32,
                                       temperature=0, stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    it = iter(stream)
    first = next(c for c in it if c.choices and c.choices[0].text)
    server.proc.send_signal(signal.SIGTERM)
    rest = list(it)
    assert rest[-1].usage.completion_tokens == 32
    assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
    assert first.choices[0].text
    server.proc.wait(60)
    assert server.proc.returncode in (0, -signal.SIGTERM), server.tail()
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url + "/health", timeout=2)
    assert "Application shutdown complete" in server.tail()


def test_bench_against_a_stub_metrics_text():
    """serve.bench's /metrics parsing and percentile summary (no server needed)."""
    from serve.bench import parse_metrics, summarize

    text = "# HELP x y\ndspark_decode_cycles_total 10\ndspark_decode_cycle_tokens_total 25\n" \
           'dspark_http_requests_total{endpoint="/v1/completions",code="200"} 3\n'
    m = parse_metrics(text)
    assert m["dspark_decode_cycles_total"] == 10
    assert m['dspark_http_requests_total{endpoint="/v1/completions",code="200"}'] == 3
    s = summarize([1.0, 2.0, 3.0, 4.0])
    assert s["mean"] == 2.5 and s["p50"] == 2.5 and 3.9 < s["p99"] <= 4.0
    json.dumps(s)


def test_metrics_render_the_budgets_pooled_trust():
    """/metrics' text (no server needed): the async budget's pooled calibration as one gauge per
    kind of row, absent where there is none (autoregressive, `--no-pooled-calibration`)."""
    from serve.bench import parse_metrics
    from serve.metrics import Metrics

    base = {"slots": 4, "active_slots": 2, "max_queue": 8, "running": 1, "queued": 0}
    m = parse_metrics(Metrics().render({**base, "budget_trust": [0.75, 1.25]}))
    assert m['dspark_budget_trust{rows="drafter"}'] == 0.75 and m['dspark_budget_trust{rows="foreseen"}'] == 1.25
    assert m["dspark_active_slots"] == 2
    assert not any(k.startswith("dspark_budget_trust") for k in parse_metrics(Metrics().render(base)))
