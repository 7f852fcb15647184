"""Smoke test of `python -m benchmarks.serve_bench --smoke`, part 2: our vLLM plugin with LoRA slots on (eager) and the
local engine, each through a real API server and directly, and `generate()` of ours and upstream beside the local
engine. Part 1 (`test_vllm_serve_bench.py`) runs the compiled vLLM engine, Qwen3-MoE and the request-cost load."""

import math

from serve_bench_smoke import CLIENTS, engine_and_api_loads, loads_by_key, run_quick_serve_bench

ROW_KEYS = ("api_tokens_per_s", "upstream_generate_tokens_per_s", "ratio")


def test_quick_serving_benchmark_of_the_other_engines_and_generate(tmp_path):
    report, stdout = run_quick_serve_bench(
        tmp_path / "serve_bench.json", "--systems", "vllm-lora", "local", "--skip", "qwen3-moe", "requests"
    )
    loads = loads_by_key(report)
    expected = engine_and_api_loads("vllm-lora", "local")
    [threads] = {load["threads"] for load in report["loads"] if load["path"] == "generate"}
    assert threads >= 1  # torch's default in the generate() processes, as in the API server's
    expected |= {
        (system, "generate", threads, clients)
        for system in ("generate-ours", "generate-upstream")
        for clients in CLIENTS
    }
    assert set(loads) == expected
    assert report["not_run"] == {}
    for system in ("vllm-lora", "local"):
        for clients in CLIENTS:
            row = report["api_vs_upstream_generate"][system][str(clients)]
            assert math.isclose(row["ratio"], row["api_tokens_per_s"] / row["upstream_generate_tokens_per_s"])
    # The compiled vLLM engine is part 1's: no API load here, so no ratio, beside this run's upstream numbers.
    upstream = {c: loads["generate-upstream", "generate", threads, c]["tokens_per_s"] for c in CLIENTS}
    assert report["api_vs_upstream_generate"]["vllm"] == {
        str(c): dict(zip(ROW_KEYS, (None, upstream[c], None), strict=True)) for c in CLIENTS
    }

    ratios = report["ratios"]
    assert set(ratios["vllm-lora_api_server_cpu_added_us_per_token"]) == {str(c) for c in CLIENTS}
    # The local engine computes in the server process: an added-CPU figure would be its compute's noise.
    assert "local_api_server_cpu_added_us_per_token" not in ratios
    for system in ("vllm-lora", "local"):
        assert set(ratios[f"{system}_api_overhead"]) == {str(c) for c in CLIENTS}
    assert "vllm-lora" in stdout and "generate-upstream" in stdout
