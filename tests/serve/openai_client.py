"""Drives a running `te serve` with the official `openai` package.

Run by tests/serve.rs (which starts the server); fails with a non-zero exit
and a message naming the check. Greedy answers are compared with
`te generate --json` for the same prompts; `return_token_ids` (a vLLM-style
extension of te serve) gives the server's token ids to compare.

usage: openai_client.py BASE_URL API_KEY TE_BINARY MODEL
"""

import asyncio
import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

import openai

BASE, KEY, TE, MODEL = sys.argv[1:5]
URL = urllib.parse.urlparse(BASE)
client = openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, timeout=120, max_retries=0)
aclient = openai.AsyncOpenAI(base_url=BASE + "/v1", api_key=KEY, timeout=120, max_retries=0)

# `te generate --json` keeps special tokens in `text`; the server leaves
# them out (SmolLM2's are all of this form).
SPECIAL = re.compile(r"<\|[a-z_]+\|>")
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
checks = 0


def check(cond, what):
    global checks
    if not cond:
        raise AssertionError(what)
    checks += 1


def te_generate(prompts, max_new, *extra):
    args = [TE, "generate", "--model", MODEL, "--json", "--max-new-tokens", str(max_new), *extra]
    for p in prompts:
        args += ["--prompt", p]
    out = subprocess.run(args, capture_output=True, text=True)
    check(out.returncode == 0, f"te generate failed: {out.stderr}")
    refs = [json.loads(line) for line in out.stdout.splitlines()]
    for r in refs:
        r["plain"] = SPECIAL.sub("", r["text"])
    return refs


def same_as(ref, text, tokens, finish, usage, what):
    check(tokens == ref["tokens"], f"{what}: tokens {tokens} != te generate's {ref['tokens']}")
    check(text == ref["plain"], f"{what}: text {text!r} != te generate's {ref['plain']!r}")
    check(finish == FINISH[ref["finish_reason"]], f"{what}: finish_reason {finish} vs {ref['finish_reason']}")
    if usage is not None:
        check(usage.prompt_tokens == len(ref["prompt_tokens"]), f"{what}: usage.prompt_tokens {usage}")
        check(usage.completion_tokens == len(ref["tokens"]), f"{what}: usage.completion_tokens {usage}")
        check(usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, f"{what}: total {usage}")


def raw(method, path, body=None, headers=None, auth=True):
    """One HTTP request; returns (status, parsed JSON or text)."""
    conn = http.client.HTTPConnection(URL.hostname, URL.port, timeout=60)
    h = {"Content-Type": "application/json"}
    if auth:
        h["Authorization"] = "Bearer " + KEY
    h.update(headers or {})
    conn.request(method, path, body=body, headers=h)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    try:
        return r.status, json.loads(data)
    except ValueError:
        return r.status, data.decode("utf-8", "replace")


def metrics():
    status, text = raw("GET", "/metrics")
    check(status == 200, f"/metrics: {status}")
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def active():
    m = metrics()
    return m["te_sequences_running"] + m["te_sequences_waiting"]


def wait_until(cond, seconds, what):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {seconds} s waiting for: {what}")


COMPLETION_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a"]
CHAT_PROMPTS = ["What is the capital of France?", "Name three colors."]


def test_models_and_health():
    models = client.models.list()
    check([m.id for m in models.data] == [MODEL], f"models: {models}")
    check(client.models.retrieve(MODEL).id == MODEL, "models.retrieve")
    status, body = raw("GET", "/health", auth=False)
    check(status == 200 and body == {"status": "ok"}, f"/health: {status} {body}")


def test_completions():
    refs = te_generate(COMPLETION_PROMPTS, 12)
    for p, ref in zip(COMPLETION_PROMPTS, refs):
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0,
                                      extra_body={"return_token_ids": True})
        c = r.choices[0]
        check(r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-"), f"{r}")
        check(c.prompt_token_ids == ref["prompt_tokens"], f"prompt ids {c.prompt_token_ids}")
        same_as(ref, c.text, c.token_ids, c.finish_reason, r.usage, f"completion {p!r}")
        # Streamed: the same text, a finish chunk, the usage chunk last.
        stream = client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"return_token_ids": True})
        text, tokens, finish, usage, chunks = "", [], None, None, list(stream)
        for ch in chunks:
            for choice in ch.choices:
                text += choice.text
                tokens += getattr(choice, "token_ids", None) or []
                finish = choice.finish_reason or finish
            if ch.usage is not None:
                usage = ch.usage
        check(chunks[-1].choices == [] and chunks[-1].usage is not None, "usage chunk is last")
        check(all(ch.usage is None for ch in chunks[:-1]), "only the last chunk has usage")
        same_as(ref, text, tokens, finish, usage, f"streamed completion {p!r}")
    # Default max_tokens is 16; stop strings end with finish_reason stop.
    r = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPTS[2], temperature=0)
    check(r.usage.completion_tokens <= 16, f"default max_tokens: {r.usage}")
    (ref,) = te_generate([COMPLETION_PROMPTS[2]], 16, "--stop", ",")
    r = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPTS[2], max_tokens=16, temperature=0,
                                  stop=[","], extra_body={"return_token_ids": True})
    same_as(ref, r.choices[0].text, r.choices[0].token_ids, r.choices[0].finish_reason, r.usage, "stop ','")
    check(r.choices[0].finish_reason == "stop", "stop string gives finish_reason stop")
    r = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPTS[0], max_tokens=4, temperature=0, echo=True)
    check(r.choices[0].text.startswith(COMPLETION_PROMPTS[0]), f"echo: {r.choices[0].text!r}")
    # Seeded sampling repeats itself.
    a, b = (client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0.9, top_p=0.95,
                                      seed=42, extra_body={"top_k": 40, "min_p": 0.05,
                                                           "repetition_penalty": 1.1})
            for _ in range(2))
    check(a.choices[0].text == b.choices[0].text, "the same seed samples the same text")


def test_chat():
    refs = te_generate(CHAT_PROMPTS, 16, "--chat")
    for p, ref in zip(CHAT_PROMPTS, refs):
        messages = [{"role": "user", "content": p}]
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                           extra_body={"return_token_ids": True})
        c = r.choices[0]
        check(r.object == "chat.completion" and c.message.role == "assistant", f"{r}")
        check(c.prompt_token_ids == ref["prompt_tokens"], "chat template tokens equal te generate --chat")
        same_as(ref, c.message.content, c.token_ids, c.finish_reason, r.usage, f"chat {p!r}")
        r2 = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16,
                                            temperature=0)
        check(r2.choices[0].message.content == c.message.content, "max_completion_tokens")
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"return_token_ids": True})
        chunks = list(stream)
        check(chunks[0].object == "chat.completion.chunk", f"{chunks[0]}")
        check(chunks[0].choices[0].delta.role == "assistant", "the first chunk carries the role")
        text, tokens, finish, usage = "", [], None, None
        for ch in chunks:
            for choice in ch.choices:
                text += choice.delta.content or ""
                tokens += getattr(choice, "token_ids", None) or []
                finish = choice.finish_reason or finish
            usage = ch.usage or usage
        same_as(ref, text, tokens, finish, usage, f"streamed chat {p!r}")
    # Without max_tokens a chat answer may run to its end token.
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say OK."}],
                                       temperature=0)
    check(r.choices[0].finish_reason in ("stop", "length"), f"{r}")
    # A whole conversation, with a system message, through the template.
    convo = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    r = client.chat.completions.create(model=MODEL, messages=convo, max_tokens=4, temperature=0)
    check(r.usage.completion_tokens >= 1, f"{r}")


async def stream_completion(prompt, max_tokens, leave_after=None, **extra):
    """Streams one completion; with `leave_after`, closes it after that
    many chunks. Returns (text, token ids, finish_reason)."""
    stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                              stream=True, extra_body={"return_token_ids": True, **extra})
    text, tokens, finish, n = "", [], None, 0
    async for ch in stream:
        for choice in ch.choices:
            text += choice.text
            tokens += getattr(choice, "token_ids", None) or []
            finish = choice.finish_reason or finish
        n += 1
        if leave_after is not None and n >= leave_after:
            await stream.close()
            break
    return text, tokens, finish


def leaver_prompt(i):
    return f"Count from {i} upwards:"


def test_disconnects():
    """8 clients stream long answers, the running batch holds them; they
    disconnect and their sequences leave within a few steps."""
    before = metrics()['te_requests_finished_total{reason="abort"}']
    check(active() == 0, "idle before the disconnect test")

    async def run():
        started = asyncio.Event()
        leave = asyncio.Event()

        async def leaver(i):
            stream = await aclient.completions.create(model=MODEL, prompt=leaver_prompt(i), max_tokens=4000,
                                                      temperature=0, stream=True, extra_body={"ignore_eos": True})
            n = 0
            async for _ in stream:
                n += 1
                if n == 2:
                    started.set()
                    await leave.wait()
                    await stream.close()
                    return n

        tasks = [asyncio.create_task(leaver(i)) for i in range(8)]
        await started.wait()
        await asyncio.to_thread(wait_until, lambda: active() == 8, 30, "8 running sequences")
        leave.set()
        await asyncio.gather(*tasks)

    asyncio.run(run())
    wait_until(lambda: active() == 0, 10, "the disconnected sequences to leave")
    after = metrics()['te_requests_finished_total{reason="abort"}']
    check(after - before == 8, f"8 aborts counted ({before} -> {after})")

    # A client waiting for a whole (non-streamed) answer that goes away.
    sock = socket.create_connection((URL.hostname, URL.port), timeout=60)
    body = json.dumps({"model": MODEL, "prompt": "Count:", "max_tokens": 4000, "ignore_eos": True}).encode()
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    wait_until(lambda: metrics()["te_sequences_running"] == 1, 30, "the whole-answer request to run")
    sock.close()
    wait_until(lambda: active() == 0, 10, "the whole-answer request to leave")
    check(metrics()['te_requests_finished_total{reason="abort"}'] == after + 1, "its abort counted")


def test_concurrency():
    """32 streaming clients at once, each answer equal to its greedy answer
    alone (te generate --max-batch-size 1); 8 more leave midway."""
    prompts = [f"Fact {i}: the number {i * 7} is" for i in range(32)]
    refs = te_generate(prompts, 12, "--max-batch-size", "1")
    before = metrics()['te_requests_finished_total{reason="abort"}']

    async def run():
        good = [stream_completion(p, 12) for p in prompts]
        leavers = [stream_completion(leaver_prompt(i), 4000, leave_after=3, ignore_eos=True) for i in range(8)]
        return await asyncio.wait_for(asyncio.gather(*good, *leavers), 300)

    results = asyncio.run(run())
    for i, (ref, (text, tokens, finish)) in enumerate(zip(refs, results[:32])):
        same_as(ref, text, tokens, finish, None, f"concurrent client {i}")
    for text, tokens, finish in results[32:]:
        check(finish is None and len(tokens) >= 2, "a leaver left before finishing")
    wait_until(lambda: active() == 0, 10, "every sequence to leave after the run")
    after = metrics()['te_requests_finished_total{reason="abort"}']
    check(after - before == 8, f"8 aborts counted ({before} -> {after})")


def error_of(status, body, want_status, param=None, code=None, what=""):
    check(status == want_status, f"{what}: status {status} != {want_status}: {body}")
    check(isinstance(body, dict) and set(body) == {"error"}, f"{what}: body {body}")
    err = body["error"]
    check(set(err) == {"message", "type", "param", "code"}, f"{what}: error fields {err}")
    check(isinstance(err["message"], str) and err["message"], f"{what}: message")
    if param is not None:
        check(err["param"] == param, f"{what}: param {err['param']} != {param}")
    if code is not None:
        check(err["code"] == code, f"{what}: code {err['code']} != {code}")


def send_big_body(size):
    """POSTs `size` bytes; the server may answer before reading them all."""
    sock = socket.create_connection((URL.hostname, URL.port), timeout=60)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n").encode()

    def writer():
        try:
            sock.sendall(head)
            chunk = b" " * 65536
            for _ in range(size // len(chunk)):
                sock.sendall(chunk)
        except OSError:
            pass  # the server answered and closed

    t = threading.Thread(target=writer)
    t.start()
    response = sock.makefile("rb").read1(65536)
    t.join()
    sock.close()
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
    return status, json.loads(body[:length])


def test_bad_requests():
    """Every bad request gets its status and an OpenAI error while a good
    client is answered correctly at the same time."""
    good_prompt = "Write a short poem about the sea."
    (ref,) = te_generate([good_prompt], 48, "--chat")
    good_results = []

    def good_client():
        for _ in range(3):
            stream = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": good_prompt}], max_tokens=48,
                temperature=0, stream=True, extra_body={"return_token_ids": True})
            text, tokens, finish = "", [], None
            for ch in stream:
                for c in ch.choices:
                    text += c.delta.content or ""
                    tokens += getattr(c, "token_ids", None) or []
                    finish = c.finish_reason or finish
            good_results.append((text, tokens, finish))

    t = threading.Thread(target=good_client)
    t.start()
    chat = "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    ok = lambda **kw: json.dumps({"model": MODEL, "messages": msgs, **kw})
    for _ in range(3):
        error_of(*raw("POST", chat, b'{"model": "x", "messages": [}'), 400, None, "invalid_json", "malformed JSON")
        error_of(*raw("POST", chat, b'[1, 2, 3]'), 400, None, "invalid_json", "not an object")
        error_of(*raw("POST", chat, ok(temperature="hot")), 400, "temperature", "invalid_type", "temperature type")
        error_of(*raw("POST", chat, json.dumps({"model": MODEL, "messages": "hi"})), 400, "messages", "invalid_type",
                 "messages type")
        error_of(*raw("POST", chat, ok(max_tokens=-5)), 400, "max_tokens", None, "negative max_tokens")
        error_of(*raw("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "a", "max_tokens": -1})),
                 400, "max_tokens", None, "negative max_tokens (completions)")
        error_of(*raw("POST", chat, ok(temperature=5)), 400, "temperature", None, "temperature 5")
        error_of(*raw("POST", chat, ok(n=2)), 400, "n", None, "n = 2")
        error_of(*raw("POST", chat, ok(stop=["a", "b", "c", "d", "e"])), 400, "stop", None, "5 stop strings")
        error_of(*raw("POST", chat, json.dumps({"model": "gpt-4", "messages": msgs})), 400, "model",
                 "model_not_found", "unknown model")
        long_prompt = json.dumps({"model": MODEL, "prompt": "hello " * 9000, "max_tokens": 4})
        error_of(*raw("POST", "/v1/completions", long_prompt), 400, "prompt", "context_length_exceeded",
                 "prompt longer than the context")
        error_of(*raw("POST", chat, ok(max_tokens=100000)), 400, "messages", "context_length_exceeded",
                 "max_tokens beyond the context")
        error_of(*raw("POST", chat, b'{"model": "\xff\xfe", "messages": []}'), 400, None, "invalid_encoding",
                 "invalid UTF-8")
        error_of(*send_big_body(10 * 1024 * 1024), 413, None, "request_too_large", "10 MB body")
        error_of(*raw("POST", chat, ok(), auth=False), 401, None, "invalid_api_key", "missing API key")
        error_of(*raw("POST", chat, ok(), headers={"Authorization": "Bearer wrong"}), 401, None,
                 "invalid_api_key", "wrong API key")
        error_of(*raw("GET", "/v1/models", auth=False), 401, None, "invalid_api_key", "models without a key")
        error_of(*raw("GET", "/metrics", auth=False), 401, None, "invalid_api_key", "metrics without a key")
        error_of(*raw("GET", "/v1/nothing"), 404, None, None, "unknown URL")
    # The openai package sees the same errors as exceptions.
    try:
        client.chat.completions.create(model=MODEL, messages=msgs, temperature=5)
        check(False, "temperature 5 must fail")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and e.body["param"] == "temperature", f"{e.body}")
    try:
        openai.OpenAI(base_url=BASE + "/v1", api_key="wrong", max_retries=0).models.list()
        check(False, "a wrong key must fail")
    except openai.AuthenticationError as e:
        check(e.status_code == 401, f"{e}")
    t.join()
    check(len(good_results) == 3, "the good client finished")
    for text, tokens, finish in good_results:
        same_as(ref, text, tokens, finish, None, "good client during bad requests")
    status, _ = raw("GET", "/health", auth=False)
    check(status == 200, "still healthy")
    m = metrics()
    check(m['te_http_requests_total{endpoint="/v1/chat/completions",status="400"}'] >= 27, "400s counted")
    check(m['te_http_requests_total{endpoint="/v1/chat/completions",status="401"}'] >= 6, "401s counted")
    check(m['te_http_requests_total{endpoint="/v1/chat/completions",status="413"}'] >= 3, "413s counted")


def test_metrics():
    m = metrics()
    for name in ["te_prompt_tokens_total", "te_generation_tokens_total", "te_sequences_running",
                 "te_sequences_waiting", "te_kv_cache_pages_in_use", "te_kv_cache_pages_total",
                 "te_time_to_first_token_seconds_count", "te_inter_token_latency_seconds_count",
                 'te_requests_finished_total{reason="stop"}', 'te_requests_finished_total{reason="length"}']:
        check(name in m, f"/metrics has {name}")
    check(m["te_generation_tokens_total"] > 0 and m["te_prompt_tokens_total"] > 0, "token counters")
    check(m["te_time_to_first_token_seconds_count"] > 0, "TTFT observed")
    check(m["te_inter_token_latency_seconds_count"] > m["te_time_to_first_token_seconds_count"], "ITL observed")
    check(m['te_time_to_first_token_seconds_bucket{le="+Inf"}'] == m["te_time_to_first_token_seconds_count"],
          "+Inf bucket holds every observation")
    check(m['te_http_requests_total{endpoint="/v1/completions",status="200"}'] > 0, "200s counted")
    check(m["te_kv_cache_pages_total"] > 0, "KV pool size")


for test in [test_models_and_health, test_completions, test_chat, test_disconnects, test_concurrency,
             test_bad_requests, test_metrics]:
    start = time.time()
    test()
    print(f"ok {test.__name__} ({time.time() - start:.1f} s)", flush=True)
print(f"all openai client checks passed ({checks} checks)")
