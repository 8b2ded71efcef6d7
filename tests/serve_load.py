"""Bounded load test of `glm5 serve` on loopback with the official `openai` client (asyncio).

Config (JSON, argv[1]): base_url, model, pid (the server's, for its RSS), clients, requests, prompts (each
with messages and the library's greedy `text`). Every request streams a greedy reply to one of the prompts;
each reply must equal that prompt's solo reply. Runs a warm-up round, then the measured round; prints
throughput, time to first token and inter-token latency percentiles, and the server's RSS after each round
(it must not grow by more than 10%: nothing is kept per request).
"""

import asyncio
import json
import sys
import time

import openai

CONFIG = json.load(open(sys.argv[1]))


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def percentile(values, p):
    values = sorted(values)
    if not values:
        return float("nan")
    k = min(len(values) - 1, max(0, round(p / 100 * (len(values) - 1))))
    return values[k]


async def one(client, prompt, stats):
    started = time.perf_counter()
    first = None
    last = None
    gaps = []
    text = ""
    tokens = 0
    stream = await client.chat.completions.create(
        model=CONFIG["model"], messages=prompt["messages"], max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if not chunk.choices or not chunk.choices[0].delta.content:
            continue
        if first is None:
            first = now - started
        else:
            gaps.append(now - last)
        last = now
        text += chunk.choices[0].delta.content
    stats["ttft"].append(first if first is not None else time.perf_counter() - started)
    stats["itl"].extend(gaps)
    stats["tokens"] += tokens
    return text == prompt["text"]


async def round_(n_requests, n_clients):
    client = openai.AsyncOpenAI(base_url=CONFIG["base_url"], api_key="unused", max_retries=0, timeout=300)
    prompts = CONFIG["prompts"]
    queue = asyncio.Queue()
    for i in range(n_requests):
        queue.put_nowait(prompts[i % len(prompts)])
    stats = {"ttft": [], "itl": [], "tokens": 0, "ok": 0, "corrupted": 0, "lost": 0}

    async def worker():
        while True:
            try:
                prompt = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            try:
                if await one(client, prompt, stats):
                    stats["ok"] += 1
                else:
                    stats["corrupted"] += 1
            except Exception as e:  # a failed request is a lost one
                print("lost:", type(e).__name__, e)
                stats["lost"] += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(n_clients)))
    stats["seconds"] = time.perf_counter() - started
    await client.close()
    return stats


def main():
    pid, clients, requests = CONFIG["pid"], CONFIG["clients"], CONFIG["requests"]
    warm = asyncio.run(round_(clients, clients))
    rss_warm = rss_kib(pid)
    stats = asyncio.run(round_(requests, clients))
    rss_after = rss_kib(pid)
    ms = lambda s: f"{1000 * s:.1f} ms"
    print(f"{requests} requests, {clients} concurrent clients, 16 tokens each, {stats['seconds']:.2f} s")
    print(f"throughput: {stats['tokens'] / stats['seconds']:.1f} generated tok/s, "
          f"{requests / stats['seconds']:.1f} requests/s")
    print(f"TTFT p50 {ms(percentile(stats['ttft'], 50))}, p99 {ms(percentile(stats['ttft'], 99))}")
    print(f"inter-token p50 {ms(percentile(stats['itl'], 50))}, p99 {ms(percentile(stats['itl'], 99))}")
    print(f"server RSS: {rss_warm / 1024:.1f} MiB after warm-up, {rss_after / 1024:.1f} MiB after the run")
    lost = stats["lost"] + warm["lost"]
    corrupted = stats["corrupted"] + warm["corrupted"]
    print(f"ok {stats['ok'] + warm['ok']}, lost {lost}, corrupted {corrupted}")
    assert rss_after <= rss_warm * 1.10, "server memory grew over the run"
    assert lost == 0 and corrupted == 0


main()
