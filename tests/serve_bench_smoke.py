"""Shared by the smoke tests of `python -m benchmarks.serve_bench --smoke` (the vLLM suite's two run parts of the
benchmark, so that CI's two pytest workers run them side by side): the run itself and the checks every load must
pass."""

import json
import math
import os
from pathlib import Path

from benchmark_helpers import output_tail, run_benchmark

CLIENTS = (1, 4)  # --smoke
MAX_TOKENS = 16  # --smoke: every request is exactly this long
SHORT_CLIENTS = 4


def run_quick_serve_bench(out: Path, *args: str, env: dict[str, str] | None = None) -> tuple[dict, str]:
    done = run_benchmark(
        "serve_bench",
        *("--smoke", "--out", str(out), *args),
        timeout=900,  # ~3 min here for the larger part
        # The vLLM engines on their own core(s); `env` on top.
        env={**os.environ, "ZAYA_VLLM_CPU_RESERVED_CORES": "1", **(env or {})},
    )
    assert done.returncode == 0, output_tail(done)
    report = json.loads(out.read_text())
    assert report["mode"] == "smoke"
    cores = sorted(os.sched_getaffinity(0))  # one core kept for the front end, the engines compute on the rest
    placement = {"front_end": cores[:1], "compute": cores[1:]} if len(cores) > 1 else None
    assert report["vllm_cpu_placement"] == placement
    return report, done.stdout


def loads_by_key(report: dict) -> dict[tuple, dict]:
    """Every load, checked: exactly `MAX_TOKENS` tokens a request (a `generate()` load: a sequence), TTFTs, and CPU
    counted per process (the API's server, its clients and vLLM's engine core, a child of whichever process holds the
    engine's front end; a `generate()` load's own process). Counters tick every 10 ms, so a smoke load's server and
    clients may read 0; vLLM's engine core spins through every load."""
    loads = {(load["system"], load["path"], load["threads"], load["concurrency"]): load for load in report["loads"]}
    for key, load in loads.items():
        system, path = key[0], key[1]
        assert load["completion_tokens"] > 0 and math.isfinite(load["tokens_per_s"]) and load["tokens_per_s"] > 0, key
        if path != "generate":
            assert 0 < load["ttft_p50_s"] <= load["ttft_p99_s"], key
        # A request-cost load's answers are 2 tokens long.
        tokens = 2 if path.startswith("requests-") else MAX_TOKENS
        assert load["requests"] >= key[3] and load["completion_tokens"] == tokens * load["requests"], key
        roles = {"api": {"server", "client", "core"}, "engine": {"server", "core"}, "generate": {"server"}}
        roles = roles["api" if path.startswith("requests-") else path]
        assert set(load["cpu_us_per_token"]) == roles, key
        assert all(value >= 0 for value in load["cpu_us_per_token"].values()), key
        if system != "local" and path != "generate":
            assert load["cpu_us_per_token"]["core"] > 0, key
    return loads


def engine_and_api_loads(*systems: str) -> set[tuple]:
    return {(system, path, 0, clients) for system in systems for path in ("engine", "api") for clients in CLIENTS}
