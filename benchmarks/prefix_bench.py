"""Prefix caching through our API: requests sharing a long system prompt, with the vLLM engine's prefix cache on
and off.

Run (needs `make install-vllm`):
    .venv-vllm/bin/python -m benchmarks.prefix_bench [--smoke] [--out benchmarks/results/prefix_bench.json]

The load the issue names: `--clients` (8) streaming clients at once, each sending one completion whose prompt is a
shared `--prefix-tokens` (1,000) system prompt followed by its own `--question-tokens` (32) question, greedy,
`--max-tokens` (64) new tokens with `ignore_eos`, for `--rounds` (4) rounds with new questions each round. One
`zaya serve` process (`ZAYA_ENGINE=vllm`, LoRA off: compiled, eager under `--smoke`; serve_bench's model shape) per
setting, run one after the other:
`ZAYA_VLLM_ENABLE_PREFIX_CACHING=true` (the default) and `false`. Before the measured rounds each server answers one
request with the shared prompt, as a deployment has answered earlier analysts: with the cache on, its KV blocks and
CCA states are then cached. Reported per setting: time to first token (p50 / p99 over every request), output
tokens/s (completion tokens over the rounds' wall time), and the prompt tokens served from the cache
(`usage.prompt_tokens_details.cached_tokens`). Every answer must be exactly `--max-tokens` long.

Targets (issue 36): time to first token with caching on >= 4x better than off; output tokens/s not lower.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

from benchmarks import environment
from benchmarks.load_test.stack import MODEL_NAME, Stack
from benchmarks.serve_bench import FULL, SMOKE, build_checkpoints

DEFAULT_OUT = environment.default_out("prefix_bench")
START_TIMEOUT_S = 600
TARGET_TTFT_RATIO = 4.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, short prompts, 2 clients (CI)")
    parser.add_argument("--clients", type=int, help="concurrent clients (default 8; smoke 2)")
    parser.add_argument("--prefix-tokens", type=int, help="shared system prompt tokens (default 1000; smoke 300)")
    parser.add_argument("--question-tokens", type=int, help="each request's own tokens (default 32; smoke 8)")
    parser.add_argument("--max-tokens", type=int, help="new tokens per request (default 64; smoke 8)")
    parser.add_argument("--rounds", type=int, help="rounds of requests, new questions each (default 4; smoke 2)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON report path")
    args = parser.parse_args(argv)
    defaults = (2, 300, 8, 8, 2) if args.smoke else (8, 1000, 32, 64, 4)
    names = ("clients", "prefix_tokens", "question_tokens", "max_tokens", "rounds")
    for name, default in zip(names, defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def build_model(directory: Path, smoke: bool, positions: int) -> Path:
    """serve_bench's ZAYA (random weights, routing spread over experts and skip), long enough for the prompts."""
    zaya_dir, _ = build_checkpoints(directory, SMOKE if smoke else FULL, max_positions=positions)
    return zaya_dir


def token_ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(count)]


@contextlib.asynccontextmanager
async def caching_server(model_dir: Path, workdir: Path, caching: bool, eager: bool) -> AsyncIterator[Stack]:
    """`zaya serve` on the vLLM engine (LoRA off: compiled) with prefix caching on or off, on a stack of its own
    (SQLite in a temp dir, the model registered, a key per role), once `/health` says it is ready."""
    env = {
        "ZAYA_ENGINE": "vllm",
        "ZAYA_VLLM_ENABLE_LORA": "false",
        "ZAYA_VLLM_ENABLE_PREFIX_CACHING": str(caching).lower(),
        "ZAYA_RATE_LIMIT_REQUESTS_PER_MINUTE": str(10**6),
    } | ({"ZAYA_VLLM_ENFORCE_EAGER": "true"} if eager else {})
    with Stack(workdir / f"caching-{'on' if caching else 'off'}", env=env, torch_threads=None) as stack:
        stack.prepare(model_dir)
        stack.start_server(wait=False)
        await asyncio.to_thread(stack.wait_until_healthy, START_TIMEOUT_S)
        yield stack


async def complete(client, stack: Stack, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: time to first token, completion and cached prompt tokens (the usage chunk)."""
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    started, first, usage = time.perf_counter(), None, None
    url = f"{stack.url}/v1/completions"
    async with client.stream("POST", url, json=body, headers=stack.headers("analyst")) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: ") :])
            if first is None and event["choices"]:
                first = time.perf_counter() - started
            usage = event.get("usage") or usage
    if usage is None or usage["completion_tokens"] != max_tokens:
        raise RuntimeError(f"an answer was not exactly {max_tokens} tokens long: {usage}")
    return {"ttft_s": first, "tokens": usage["completion_tokens"], "cached": cached_tokens(usage)}


def cached_tokens(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


async def measure(stack: Stack, args: argparse.Namespace, prefix: list[int], seed: int) -> dict:
    import httpx

    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=600) as client:
        await complete(client, stack, prefix + token_ids(rng, args.question_tokens), args.max_tokens)  # warm-up
        answers, seconds = [], 0.0
        for _ in range(args.rounds):
            prompts = [prefix + token_ids(rng, args.question_tokens) for _ in range(args.clients)]
            started = time.perf_counter()
            answers += await asyncio.gather(*(complete(client, stack, p, args.max_tokens) for p in prompts))
            seconds += time.perf_counter() - started
    ttft = sorted(answer["ttft_s"] for answer in answers)
    return {
        "requests": len(answers),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
        "tokens_per_s": sum(answer["tokens"] for answer in answers) / seconds,
        "cached_tokens_per_request": statistics.mean(answer["cached"] for answer in answers),
        "seconds": seconds,
    }


async def run(args: argparse.Namespace, workdir: Path) -> dict:
    positions = 1 << (args.prefix_tokens + args.question_tokens + args.max_tokens).bit_length()
    model_dir = build_model(workdir / "model", args.smoke, positions)
    prefix = token_ids(random.Random(0), args.prefix_tokens)
    results = {}
    for caching in (True, False):
        async with caching_server(model_dir, workdir, caching, eager=args.smoke) as stack:
            results["on" if caching else "off"] = await measure(stack, args, prefix, seed=1)
    on, off = results["on"], results["off"]
    ttft_ratio = off["ttft_p50_s"] / on["ttft_p50_s"]
    throughput_ratio = on["tokens_per_s"] / off["tokens_per_s"]
    return {
        "caching": results,
        "ttft_p50_off_over_on": ttft_ratio,
        "tokens_per_s_on_over_off": throughput_ratio,
        "targets": {
            "ttft_ratio_min": TARGET_TTFT_RATIO,
            "ttft_met": ttft_ratio >= TARGET_TTFT_RATIO,
            "throughput_not_lower": throughput_ratio >= 1.0,
        },
    }


def table(report: dict, args: argparse.Namespace) -> str:
    lines = [
        f"{args.clients} clients x {args.rounds} rounds; prompt = {args.prefix_tokens} shared + "
        f"{args.question_tokens} own tokens; {args.max_tokens} new tokens",
        f"{'prefix cache':<13} {'TTFT p50 s':>11} {'TTFT p99 s':>11} {'tokens/s':>9} {'cached tok/req':>15}",
    ]
    for name, result in report["caching"].items():
        lines.append(
            f"{name:<13} {result['ttft_p50_s']:>11.3f} {result['ttft_p99_s']:>11.3f} {result['tokens_per_s']:>9.1f} "
            f"{result['cached_tokens_per_request']:>15.0f}"
        )
    lines.append(
        f"TTFT off/on {report['ttft_p50_off_over_on']:.2f}x (target >= {TARGET_TTFT_RATIO:g}x); "
        f"tokens/s on/off {report['tokens_per_s_on_over_off']:.2f}x (target >= 1)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    environment.set_vllm_defaults()
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="prefix-bench-") as workdir:
        measured = asyncio.run(run(args, Path(workdir)))
    report = {
        "mode": "smoke" if args.smoke else "full",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": environment.machine_summary(),
        "load": {name: getattr(args, name) for name in ("clients", "prefix_tokens", "question_tokens", "max_tokens")}
        | {"rounds": args.rounds},
        **measured,
    }
    environment.write_report(args.out, report)
    print(table(report, args))
    print(f"report: {args.out}")
    return 0


if __name__ == "__main__":  # vLLM spawns processes: everything runs under this guard
    sys.exit(main())
