#!/usr/bin/env python3
"""HF transformers on the slice `glm5-bench e2e` measures: GLM-5's first N layers at real sizes, random bf16
weights, one GPU. Prints a few human lines, then one JSON line {"context", "decode_ms", "prefill_ms"}.

Decode: a prompt of --context tokens, then --steps tokens one at a time through the KV cache, the argmax read
back each step (median ms/token after 3 warm-up steps). Prefill: one forward of --prefill tokens (the second
of two).

Usage: python3 bench/hf_e2e.py --layers 6 --context 4096 --steps 16 --prefill 4096
"""
import argparse
import json
import os
import statistics
import time

import torch
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))


def slice_config(layers):
    with open(os.path.join(HERE, "..", "tests", "assets", "glm5_config.json")) as f:
        raw = json.load(f)
    full = raw["num_hidden_layers"]
    for key, value in list(raw.items()):
        if isinstance(value, list) and len(value) == full:
            raw[key] = value[:layers]
    raw["num_hidden_layers"] = layers
    return GlmMoeDsaConfig(**raw)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prefill", type=int, default=4096)
    args = parser.parse_args()

    config = slice_config(args.layers)
    torch.manual_seed(2026)
    torch.set_default_dtype(torch.bfloat16)
    start = time.time()
    with torch.device("cuda"):
        model = GlmMoeDsaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    model.eval()
    torch.cuda.synchronize()
    print(f"HF transformers slice: {args.layers} layers, bf16, attention {config._attn_implementation}, "
          f"loaded in {time.time() - start:.1f} s")

    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (1, args.context + args.steps + 4), generator=g).cuda()

    with torch.no_grad():
        prefill_ms = None
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.time()
            out = model(ids[:, : args.prefill], use_cache=False)
            out.logits[:, -1].argmax(-1).item()
            prefill_ms = (time.time() - t0) * 1e3
        print(f"HF prefill {args.prefill}: {prefill_ms:.1f} ms")

        out = model(ids[:, : args.context], use_cache=True)
        past = out.past_key_values
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for step in range(args.steps + 3):
            torch.cuda.synchronize()
            t0 = time.time()
            out = model(token, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            token.item()
            if step >= 3:
                times.append((time.time() - t0) * 1e3)
        decode_ms = statistics.median(times)
        print(f"HF decode at context {args.context}: {decode_ms:.2f} ms/token")
    print(json.dumps({"context": args.context, "decode_ms": decode_ms, "prefill_ms": prefill_ms}))


if __name__ == "__main__":
    main()
