"""Smoke test of `python -m benchmarks.prefix_bench --smoke`: two real `zaya serve` processes on the vLLM engine, prefix
caching on and off, clients sharing a long prompt prefix. With the cache on every measured request reports the
shared prompt's whole KV blocks as cached; off, none; every answer is exactly as long as asked (the benchmark
checks), and the report's ratios are those of its numbers."""

import json
import math

from benchmark_helpers import output_tail, run_benchmark

from server.engines.vllm import CPU_PREFIX_BLOCK_SIZE as BLOCK  # the engine's KV block on CPU, caching on


def test_quick_prefix_benchmark_serves_the_shared_prompt_from_the_cache(tmp_path):
    out = tmp_path / "prefix_bench.json"
    done = run_benchmark("prefix_bench", "--smoke", "--out", str(out), timeout=900)
    assert done.returncode == 0, output_tail(done)
    report = json.loads(out.read_text())
    assert report["mode"] == "smoke"
    load = report["load"]
    on, off = report["caching"]["on"], report["caching"]["off"]
    for result in (on, off):
        assert result["requests"] == load["clients"] * load["rounds"]
        assert result["ttft_p50_s"] > 0 and result["tokens_per_s"] > 0
    assert on["cached_tokens_per_request"] == load["prefix_tokens"] // BLOCK * BLOCK
    assert off["cached_tokens_per_request"] == 0
    assert math.isclose(report["ttft_p50_off_over_on"], off["ttft_p50_s"] / on["ttft_p50_s"])
    assert math.isclose(report["tokens_per_s_on_over_off"], on["tokens_per_s"] / off["tokens_per_s"])
    assert "TTFT off/on" in done.stdout
