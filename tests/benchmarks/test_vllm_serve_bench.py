"""Smoke test of `python -m benchmarks.serve_bench --smoke`, part 1: our vLLM plugin compiled (LoRA off), through a real
uvicorn API and directly, in alternating rounds with vLLM's Qwen3-MoE (directly and through `vllm serve`), and the
request-cost load; the JSON report holds every load, its CPU per process and the issue's ratios. Part 2
(`test_vllm_serve_bench_other_engines.py`) runs the other engines."""

import math

from serve_bench_smoke import CLIENTS, SHORT_CLIENTS, engine_and_api_loads, loads_by_key, run_quick_serve_bench


def test_quick_serving_benchmark_of_compiled_vllm_against_qwen3_moe(tmp_path):
    report, stdout = run_quick_serve_bench(tmp_path / "serve_bench.json", "--systems", "vllm", "--skip", "generate")
    loads = loads_by_key(report)
    expected = engine_and_api_loads("vllm")
    expected |= {("qwen3-moe", path, 0, clients) for path in ("engine", "api") for clients in CLIENTS}
    expected |= {("vllm", "requests-sqlite", 0, SHORT_CLIENTS)}
    assert set(loads) == expected

    [short] = [load for load in report["loads"] if load["path"] == "requests-sqlite"]
    assert short["requests"] == SHORT_CLIENTS * 4  # --smoke: 4 requests per client
    assert short["completion_tokens"] == 2 * short["requests"]  # 2-token answers
    ratios = report["ratios"]
    assert ratios["api_server_cpu_ms_per_request"] == {"sqlite": short["cpu_ms_per_request"]["server"]}
    assert short["cpu_ms_per_request"]["server"] > 0
    assert set(ratios["vllm_api_server_cpu_added_us_per_token"]) == {str(c) for c in CLIENTS}
    engine = {key[3]: load["tokens_per_s"] for key, load in loads.items() if key[:2] == ("vllm", "engine")}
    api = {key[3]: load["tokens_per_s"] for key, load in loads.items() if key[:2] == ("vllm", "api")}
    qwen = {key[3]: load["tokens_per_s"] for key, load in loads.items() if key[:2] == ("qwen3-moe", "engine")}
    qwen_api = {key[3]: load["tokens_per_s"] for key, load in loads.items() if key[:2] == ("qwen3-moe", "api")}
    for clients in CLIENTS:
        assert math.isclose(ratios["vllm_zaya_vs_qwen3_moe"][str(clients)], engine[clients] / qwen[clients])
        assert math.isclose(ratios["vllm_api_overhead"][str(clients)], 1 - api[clients] / engine[clients])
        # vLLM's own OpenAI server on Qwen3-MoE, the reference for our API's overhead.
        assert math.isclose(ratios["qwen3-moe_api_overhead"][str(clients)], 1 - qwen_api[clients] / qwen[clients])
    assert set(ratios["qwen3-moe_api_server_cpu_added_us_per_token"]) == {str(c) for c in CLIENTS}
    assert math.isclose(ratios["vllm_api_scaling_4_vs_1"], api[4] / api[1])
    scaling = ratios["engine_scaling_4_vs_1"]
    assert math.isclose(scaling["vllm"], engine[4] / engine[1])
    assert math.isclose(scaling["qwen3-moe"], qwen[4] / qwen[1])
    assert scaling["vllm-lora"] is None and scaling["local"] is None  # not measured in this part
    assert ratios["targets"] == {"scaling_min": None, "api_overhead_max": 0.05, "zaya_over_qwen3_moe_min": 1 / 1.5}
    assert "server µs/tok" in stdout and "qwen3-moe" in stdout and "server ms/req" in stdout
