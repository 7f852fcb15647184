"""Smoke test of `python -m benchmarks.serve_bench --smoke` in the main environment: our API (`zaya serve`) on the local
engine against upstream `generate()` (grouped_mm experts) on the same weights, every answer exactly `max_tokens` long;
the vLLM rows say they were not run where vLLM is not installed. The vLLM suite runs the vLLM parts."""

import importlib.util
import math

import pytest
from serve_bench_smoke import CLIENTS, MAX_TOKENS, engine_and_api_loads, loads_by_key, run_quick_serve_bench

from benchmarks import serve_bench

NO_VLLM = "not run (no vLLM environment)"


@pytest.mark.slow
def test_smoke_run_compares_the_local_api_with_upstream_generate(tmp_path):
    report, stdout = run_quick_serve_bench(tmp_path / "serve_bench.json", "--systems", "local")
    loads = loads_by_key(report)  # every request exactly MAX_TOKENS long
    [threads] = {load["threads"] for load in report["loads"] if load["path"] == "generate"}
    expected = engine_and_api_loads("local")
    expected |= {(system, "generate", threads, c) for system in ("generate-upstream", "generate-ours") for c in CLIENTS}
    assert set(loads) == expected
    assert report["upstream_generate"]["experts_implementation"] == "grouped_mm"
    assert report["upstream_generate"]["compiled"] == report["upstream_generate"]["can_compile_fullgraph"]

    vllm = importlib.util.find_spec("vllm") is not None
    rows = report["api_vs_upstream_generate"]
    assert report["not_run"] == ({} if vllm else dict.fromkeys(("vllm", "vllm-lora", "qwen3-moe", "requests"), NO_VLLM))
    for system in ("vllm", "vllm-lora"):
        assert (rows[system] != NO_VLLM) == vllm
    for clients in CLIENTS:
        row = rows["local"][str(clients)]
        api, upstream = loads[("local", "api", 0, clients)], loads[("generate-upstream", "generate", threads, clients)]
        assert row["api_tokens_per_s"] == api["tokens_per_s"]
        assert row["upstream_generate_tokens_per_s"] == upstream["tokens_per_s"]
        assert math.isclose(row["ratio"], api["tokens_per_s"] / upstream["tokens_per_s"])
    assert f"exactly {MAX_TOKENS} tokens each" in stdout
    assert ("vllm                   " + NO_VLLM in stdout) != vllm


def test_a_request_of_another_length_fails_the_benchmark():
    check = serve_bench.check_token_counts
    check("local api", [16, 16], 16, 2)
    with pytest.raises(RuntimeError, match=r"token counts \[15, 16\], expected exactly 16 each"):
        check("local api", [16, 15], 16, 2)
    with pytest.raises(RuntimeError, match="1 of 2 requests answered"):
        check("local api", [16], 16, 2)


@pytest.mark.slow
def test_guidellm_can_send_the_api_loads(tmp_path):
    """`--client guidellm`: each API load is one `guidellm run` (synchronous at one client, concurrent at more),
    every answer exactly `max_tokens` long, its CPU counted as the client's."""
    skip = ["engine", "generate", "requests", "qwen3-moe"]
    arguments = ("--systems", "local", "--client", "guidellm", "--skip", *skip)
    report, _ = run_quick_serve_bench(tmp_path / "serve_bench.json", *arguments)
    assert report["client"] == "guidellm"
    loads = loads_by_key(report)  # every request exactly MAX_TOKENS long
    assert set(loads) == {("local", "api", 0, clients) for clients in CLIENTS}
    assert all(load["cpu_s"]["client"] > 0 for load in loads.values())  # guidellm's own process
