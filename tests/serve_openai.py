"""Drives `glm5 serve` with the official `openai` Python package (and raw sockets for what a client library
will not send). Started by tests/serve.rs with a JSON config holding the server URLs and the expected values,
which the Rust side computed with the glm5 library alone."""

import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import openai

CONFIG = json.load(open(sys.argv[1]))
MODEL = CONFIG["model"]
CHECKS = []


def check(name):
    def wrap(fn):
        CHECKS.append((name, fn))
        return fn

    return wrap


def client(url_key="base_url", **kwargs):
    kwargs.setdefault("api_key", "unused")
    kwargs.setdefault("max_retries", 0)
    kwargs.setdefault("timeout", 120)
    return openai.OpenAI(base_url=CONFIG[url_key], **kwargs)


def eq(actual, expected, what):
    if actual != expected:
        raise AssertionError(f"{what}: got {actual!r}, expected {expected!r}")


def raw(url_key, method, path, body=b"", headers=None):
    """(status, parsed JSON or text) of a plain HTTP request."""
    url = CONFIG[url_key].rsplit("/v1", 1)[0] + path
    request = urllib.request.Request(url, data=body if method == "POST" else None, method=method)
    for k, v in (headers or {"content-type": "application/json"}).items():
        request.add_header(k, v)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, data = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, data = e.code, e.read()
    try:
        return status, json.loads(data)
    except ValueError:
        return status, data.decode()


def error_shape(body, status):
    error = body["error"]
    for key in ("message", "type", "param", "code"):
        assert key in error, f"error without {key}: {body}"
    assert error["message"], body
    return error


@check("chat, not streamed: the library's greedy text and token counts")
def _():
    e = CONFIG["chat"]
    r = client().chat.completions.create(
        model=MODEL, messages=e["messages"], max_tokens=12, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    eq(r.object, "chat.completion", "object")
    eq(r.choices[0].message.content, e["text"], "content")
    eq(r.choices[0].message.role, "assistant", "role")
    eq(r.choices[0].finish_reason, e["finish_reason"], "finish_reason")
    eq(r.usage.prompt_tokens, e["prompt_tokens"], "prompt_tokens")
    eq(r.usage.completion_tokens, e["completion_tokens"], "completion_tokens")
    eq(r.usage.total_tokens, e["prompt_tokens"] + e["completion_tokens"], "total_tokens")


@check("chat, streamed: deltas add up to the same text; usage chunk last; [DONE]")
def _():
    e = CONFIG["chat"]
    stream = client().chat.completions.create(
        model=MODEL, messages=e["messages"], max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    eq(text, e["text"], "streamed content")
    eq(chunks[0].choices[0].delta.role, "assistant", "first delta role")
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    eq(finishes, [e["finish_reason"]], "finish reasons")
    eq(chunks[-1].choices, [], "usage chunk choices")
    eq(chunks[-1].usage.completion_tokens, e["completion_tokens"], "streamed completion_tokens")
    eq(chunks[-1].usage.prompt_tokens, e["prompt_tokens"], "streamed prompt_tokens")
    assert all(c.usage is None for c in chunks[:-1]), "usage only on the last chunk"


@check("reasoning: with thinking on (the default), the reply is reasoning_content")
def _():
    e = CONFIG["thinking"]
    r = client().chat.completions.create(model=MODEL, messages=e["messages"], max_tokens=10, temperature=0)
    message = r.choices[0].message
    eq(getattr(message, "reasoning_content", None), e["text"], "reasoning_content")
    eq(message.content, "", "content")
    stream = client().chat.completions.create(
        model=MODEL, messages=e["messages"], max_tokens=10, temperature=0, stream=True)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in stream if c.choices)
    eq(reasoning, e["text"], "streamed reasoning_content")


@check("completions, both ways, with logprobs against the library's softmax")
def _():
    e = CONFIG["completion"]
    r = client().completions.create(model=MODEL, prompt=e["prompt"], max_tokens=16, temperature=0, logprobs=5)
    eq(r.choices[0].text, e["text"], "text")
    eq(r.usage.prompt_tokens, e["prompt_tokens"], "prompt_tokens")
    eq(r.usage.completion_tokens, e["completion_tokens"], "completion_tokens")
    eq(r.choices[0].finish_reason, e["finish_reason"], "finish_reason")
    lp = r.choices[0].logprobs
    eq(len(lp.tokens), e["completion_tokens"], "one logprob entry per token")
    first = lp.top_logprobs[0]
    expected = dict((t, l) for t, l in e["top5"])
    eq(sorted(first), sorted(expected), "top-5 tokens of the first step")
    for token, logprob in expected.items():
        assert abs(first[token] - logprob) < 1e-4, (token, first[token], logprob)
    eq(lp.tokens[0], e["top5"][0][0], "greedy picks the most likely token")
    assert abs(lp.token_logprobs[0] - e["top5"][0][1]) < 1e-4
    stream = client().completions.create(model=MODEL, prompt=e["prompt"], max_tokens=16, temperature=0, stream=True)
    eq("".join(c.choices[0].text for c in stream if c.choices), e["text"], "streamed text")
    # Token ids as the prompt: the same continuation.
    r = client().completions.create(model=MODEL, prompt=[[1, 2, 3]], max_tokens=3, temperature=0)
    eq(r.usage.prompt_tokens, 3, "token-id prompt length")


@check("chat logprobs: top_logprobs entries, greedy token first")
def _():
    e = CONFIG["chat"]
    r = client().chat.completions.create(
        model=MODEL, messages=e["messages"], max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    content = r.choices[0].logprobs.content
    eq(len(content), min(5, e["completion_tokens"]), "entries")
    for entry in content:
        eq(len(entry.top_logprobs), 3, "top_logprobs length")
        eq(entry.top_logprobs[0].token, entry.token, "greedy = most likely")
        assert entry.logprob <= 0


@check("stop strings cut the text where the library cuts it")
def _():
    e = CONFIG["stop"]
    for stream in (False, True):
        r = client().completions.create(
            model=MODEL, prompt=CONFIG["completion"]["prompt"], max_tokens=16, temperature=0,
            stop=[e["stop"]], stream=stream)
        text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
        eq(text, e["text"], f"text before the stop string (stream={stream})")


@check("n=3 with a seed: three choices, reproducible")
def _():
    kwargs = dict(model=MODEL, prompt="Hello", max_tokens=8, temperature=1.0, n=3, seed=7)
    a = client().completions.create(**kwargs)
    b = client().completions.create(**kwargs)
    eq(sorted(c.index for c in a.choices), [0, 1, 2], "indices")
    eq([c.text for c in a.choices], [c.text for c in b.choices], "same seed, same text")
    greedy = client().completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0, n=2)
    eq(greedy.choices[0].text, greedy.choices[1].text, "greedy choices agree")


@check("8 concurrent streams each produce exactly their solo tokens")
def _():
    def run(e):
        stream = client().chat.completions.create(
            model=MODEL, messages=e["messages"], max_tokens=20, temperature=0, stream=True,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with ThreadPoolExecutor(len(CONFIG["concurrent"])) as pool:
        texts = list(pool.map(run, CONFIG["concurrent"]))
    for text, e in zip(texts, CONFIG["concurrent"]):
        eq(text, e["text"], "concurrent stream")


@check("tools go through the chat template, calls and results round-trip")
def _():
    r = client().chat.completions.create(
        model=MODEL, messages=CONFIG["tool_messages"], tools=CONFIG["tools"], max_tokens=4, temperature=0)
    eq(r.usage.prompt_tokens, CONFIG["tool_messages_prompt_tokens"], "prompt tokens with tools")
    r = client().chat.completions.create(
        model=MODEL, messages=CONFIG["tool_round"], tools=CONFIG["tools"], max_tokens=4, temperature=0)
    eq(r.usage.prompt_tokens, CONFIG["tool_round_prompt_tokens"], "prompt tokens of a tool round")


@check("a reply with thinking and a tool call becomes reasoning_content and tool_calls (JSON and streamed)")
def _():
    s = CONFIG["scripted"]
    c = client("scripted_url")
    r = c.chat.completions.create(model=MODEL, messages=CONFIG["tool_messages"], tools=CONFIG["tools"],
                                  temperature=0, max_tokens=200)
    m = r.choices[0].message
    eq(m.reasoning_content, s["reasoning"], "reasoning_content")
    eq(m.content, s["content"], "content")
    eq(r.choices[0].finish_reason, "tool_calls", "finish_reason")
    eq([(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls],
       [tuple(x) for x in s["calls"]], "tool_calls")
    assert all(t.id and t.type == "function" for t in m.tool_calls)

    stream = c.chat.completions.create(model=MODEL, messages=CONFIG["tool_messages"], tools=CONFIG["tools"],
                                       temperature=0, max_tokens=200, stream=True)
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for t in delta.tool_calls or []:
            call = calls.setdefault(t.index, {"name": "", "arguments": "", "id": None})
            call["id"] = call["id"] or t.id
            call["name"] += t.function.name or ""
            call["arguments"] += t.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    eq(reasoning, s["reasoning"], "streamed reasoning")
    eq(content, s["content"], "streamed content")
    eq([(v["name"], json.loads(v["arguments"])) for _, v in sorted(calls.items())],
       [tuple(x) for x in s["calls"]], "streamed tool_calls")
    eq(finish, "tool_calls", "streamed finish_reason")
    # tool_choice "none": the call stays text.
    r = c.chat.completions.create(model=MODEL, messages=CONFIG["tool_messages"], tools=CONFIG["tools"],
                                  tool_choice="none", temperature=0, max_tokens=200)
    assert "<tool_call>get_weather" in r.choices[0].message.content, r.choices[0].message.content


@check("the next chat turn reuses the KV rows of the previous one (prefix caching)")
def _():
    messages = [{"role": "user", "content": "Remember the word market."}]
    kwargs = dict(model=MODEL, max_tokens=4, temperature=0,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    first = client().chat.completions.create(messages=messages, **kwargs)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Which word?"}]
    second = client().chat.completions.create(messages=messages, **kwargs)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens, (cached, second.usage)


@check("models, health, metrics")
def _():
    models = client().models.list()
    eq([m.id for m in models.data], [MODEL], "model list")
    eq(raw("base_url", "GET", "/health")[0], 200, "health")
    status, text = raw("base_url", "GET", "/metrics")
    eq(status, 200, "metrics")
    for name in ("glm5_requests_total", "glm5_queue_length", "glm5_step_seconds_bucket",
                 "glm5_kv_blocks_in_use", "glm5_generation_tokens_total"):
        assert name in text, name


@check("bad requests get OpenAI errors with the right status")
def _():
    c = client()
    status, body = raw("base_url", "POST", "/v1/chat/completions", b'{"model": "glm5-tiny", "messages": [')
    eq(status, 400, "invalid JSON")
    eq(error_shape(body, status)["type"], "invalid_request_error", "type")
    try:
        c.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}])
        raise AssertionError("unknown model accepted")
    except openai.NotFoundError as e:
        eq(e.body["code"], "model_not_found", "code")
    for kwargs in ({"max_tokens": -1}, {"temperature": -1}, {"top_p": 7}, {"n": 0},
                   {"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]}):
        args = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        args.update(kwargs)
        try:
            c.chat.completions.create(**args)
            raise AssertionError(f"{kwargs} accepted")
        except openai.BadRequestError as e:
            assert e.body["message"], e.body
    try:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CONFIG["long_prompt"]}])
        raise AssertionError("prompt longer than the context accepted")
    except openai.BadRequestError as e:
        eq(e.body["code"], "context_length_exceeded", "code")
        assert str(CONFIG["max_model_len"]) in e.body["message"], e.body
    status, body = raw("base_url", "GET", "/v1/nothing-here")
    eq(status, 404, "unknown route")
    error_shape(body, status)


@check("API key: 401 without it, 200 with it")
def _():
    try:
        client("limited_url", api_key="wrong").models.list()
        raise AssertionError("wrong key accepted")
    except openai.AuthenticationError as e:
        eq(e.status_code, 401, "status")
    status, body = raw("limited_url", "GET", "/v1/models", headers={})
    eq(status, 401, "missing key")
    error_shape(body, status)
    eq([m.id for m in client("limited_url", api_key=CONFIG["api_key"]).models.list().data], [MODEL], "with key")


@check("oversized body: 413")
def _():
    body = json.dumps({"model": MODEL, "prompt": "x" * 10000}).encode()
    status, answer = raw("limited_url", "POST", "/v1/completions", body,
                         {"content-type": "application/json", "authorization": "Bearer " + CONFIG["api_key"]})
    eq(status, 413, "status")
    error_shape(answer, status)


@check("full server: 429 for what does not fit the queue, the rest served")
def _():
    c = client("limited_url", api_key=CONFIG["api_key"])

    def run(_):
        try:
            r = c.completions.create(model=MODEL, prompt="Hello", max_tokens=300, temperature=0,
                                     extra_body={"ignore_eos": True})
            return r.usage.completion_tokens
        except openai.RateLimitError as e:
            eq(e.body["code"], "queue_full", "code")
            return 429

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, range(4)))
    assert 429 in results, results
    assert 300 in results, results


@check("slow-loris client is dropped; the server keeps serving")
def _():
    url = urlparse(CONFIG["limited_url"])
    sock = socket.create_connection((url.hostname, url.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    sock.settimeout(10)
    started = time.time()
    try:
        data = sock.recv(1024)
    except (ConnectionResetError, socket.timeout) as e:
        data = b"" if isinstance(e, ConnectionResetError) else None
    assert data is not None, "the server kept a client that never finished its headers"
    assert data == b"" or data.startswith(b"HTTP/1.1 408"), data
    assert time.time() - started < 8
    sock.close()
    c = client("limited_url", api_key=CONFIG["api_key"])
    eq(c.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0).usage.completion_tokens,
       2, "served after the slow client")


@check("a client that disconnects mid-stream is stopped; other streams are untouched")
def _():
    e = CONFIG["concurrent"][0]
    result = {}

    def other():
        stream = client().chat.completions.create(
            model=MODEL, messages=e["messages"], max_tokens=20, temperature=0, stream=True,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        result["text"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    thread = threading.Thread(target=other)
    thread.start()
    url = urlparse(CONFIG["base_url"])
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 900, "stream": True,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection((url.hostname, url.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    received = b""
    while received.count(b"data: ") < 3:
        received += sock.recv(4096)
    sock.close()
    thread.join()
    eq(result["text"], e["text"], "the other stream")
    # And a client that leaves before its (non-streamed) answer is ready.
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 900, "ignore_eos": True}).encode()
    sock = socket.create_connection((url.hostname, url.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    time.sleep(0.3)
    sock.close()
    deadline = time.time() + 10
    while time.time() < deadline:
        _, metrics = raw("base_url", "GET", "/metrics")
        cancelled = [l for l in metrics.splitlines() if l.startswith("glm5_sequences_cancelled_total")]
        running = [l for l in metrics.splitlines() if l.startswith("glm5_running_sequences")]
        if cancelled and int(cancelled[0].split()[-1]) >= 2 and running[0].endswith(" 0"):
            return
        time.sleep(0.1)
    raise AssertionError("the disconnected sequences were not stopped:\n" + metrics)


failures = 0
for name, fn in CHECKS:
    started = time.time()
    try:
        fn()
        print(f"ok   {name} ({time.time() - started:.2f}s)")
    except Exception as e:  # report every failing check, not just the first
        failures += 1
        print(f"FAIL {name}: {type(e).__name__}: {e}")
print(f"{len(CHECKS) - failures} of {len(CHECKS)} checks passed")
sys.exit(1 if failures else 0)
