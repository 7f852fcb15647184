"""Side-by-side speed of our ZAYA1 (`zaya_model`) against upstream `transformers`' `zaya`, on CPU.

Run: `python -m benchmarks.model_bench [--quick] [--out benchmarks/results/model_bench.json]`

One process holds both models with the same random weights (ours is built, saved with `save_pretrained`, and
upstream loads that checkpoint) and times them interleaved (A B, then B A, ...) so that load from other processes
hits both alike; the ratios ours/upstream are the result, the absolute numbers depend on the machine.

Metrics (see benchmarks/README.md): train step, prefill and greedy decode (batch 1 and 8) tokens/s, peak memory per
phase (each in a fresh subprocess), KV+state bytes per token against same-width GQA and MHA transformers, and the
train step's achieved GFLOP/s against a plain matmul in fp32 and under bf16 autocast.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import transformers

from benchmarks import environment
from benchmarks.environment import fmt, fmt_ratio, timed_stage
from zaya_model import ZayaForCausalLM
from zaya_model.training.runtime import prepare_training_process

if TYPE_CHECKING:
    from zaya_model.cpu.decode import CompiledDecoder

DEFAULT_OUT = environment.default_out("model_bench")
LOGITS_TOLERANCE = 1e-4
BF16_PROBE_SIZE = 512
PHASES = ("train_step", "prefill", "decode_b1", "decode_b8")
TARGETS = {"train_step": 2.0, "prefill": 1.5, "decode_b1": 5.0}  # issue 2: minimum ours/upstream speed ratios
# What ours runs compiled in each phase (the `ours_eager` rows run the same model without).
COMPILED_PATHS = {
    "train_step": "compiled layers",
    "prefill": "compiled layers",
    "decode_b1": "compiled layers + compiled decode steps",
    "decode_b8": "compiled layers + compiled decode steps",
}
PAD, BOS, EOS = 0, 2, 1
# Either implementation: ours, or upstream's (`--ours transformers` puts upstream's in ours' place too).
ZayaLM = ZayaForCausalLM | transformers.ZayaForCausalLM


@dataclass(frozen=True)
class BenchSizes:
    """Everything that `--quick` shrinks."""

    model: dict
    seq_len: int
    train_batch: int
    prefill_batch: int
    decode_batches: tuple[int, int]
    prompt_len: int
    new_tokens: int
    warmup: int
    repeats: int
    matmul_size: int
    bf16_repeats: int
    bf16_timeout_s: int
    worker_timeout_s: int


# ZAYA1's ratios at width 512: router width = hidden / 8 (256 / 2048), expert width = hidden, 4:1 GQA, 16 experts.
# The vocabulary is sized so the whole model has ~112M parameters (the size the stack notes measured upstream at).
FULL = BenchSizes(
    model=dict(
        vocab_size=9856,
        hidden_size=512,
        num_hidden_layers=8,
        num_experts=16,
        moe_intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        router_hidden_size=64,
    ),
    seq_len=512,
    train_batch=4,
    prefill_batch=4,
    decode_batches=(1, 8),
    prompt_len=64,
    new_tokens=64,
    warmup=1,
    repeats=5,
    matmul_size=2048,
    bf16_repeats=3,
    bf16_timeout_s=600,
    worker_timeout_s=600,
)

QUICK = BenchSizes(
    model=dict(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_experts=4,
        moe_intermediate_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
        router_hidden_size=8,
    ),
    seq_len=32,
    train_batch=2,
    prefill_batch=2,
    decode_batches=(1, 8),
    prompt_len=8,
    new_tokens=8,
    warmup=1,
    repeats=2,
    matmul_size=256,
    bf16_repeats=1,
    bf16_timeout_s=180,  # compiling ours under autocast takes ~50 s with an empty inductor cache
    worker_timeout_s=60,
)


def model_config_kwargs(model: dict, seq_len: int) -> dict:
    """The config of a benchmark model of shape `model` (`BenchSizes.model`) that reads rows of `seq_len` tokens."""
    return dict(
        model,
        max_position_embeddings=max(4096, seq_len),
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        tie_word_embeddings=True,
        use_cache=True,
    )


# --------------------------------------------------------------------------------------------------------------------
# Loading the two implementations
# --------------------------------------------------------------------------------------------------------------------


def ours_classes(source: str):
    """Our (config, model) classes; `source="transformers"` stands in upstream's (to check the harness itself)."""
    if source == "zaya_model":
        from zaya_model import ZayaConfig, ZayaForCausalLM

        return source, ZayaConfig, ZayaForCausalLM
    return source, transformers.ZayaConfig, transformers.ZayaForCausalLM


def load_model(impl: str, model_dir: str, ours_source: str) -> ZayaLM:
    if impl == "upstream":
        model = transformers.ZayaForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa", experts_implementation="grouped_mm"
        )
    else:
        _, _, model_cls = ours_classes(ours_source)
        model = model_cls.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def save_random_ours(config_kwargs: dict, ours_source: str, model_dir: str) -> None:
    """Build our model with seeded random weights and save it: the one checkpoint both implementations load."""
    _, config_cls, model_cls = ours_classes(ours_source)
    config = config_cls(**config_kwargs)
    torch.manual_seed(0)
    model_cls._from_config(config, dtype=torch.float32).save_pretrained(model_dir)


def check_same_logits(ours: ZayaLM, upstream: ZayaLM, sizes: BenchSizes) -> float:
    """Max |Δ logits| of a full forward on random tokens; aborts the benchmark if the two models disagree."""
    ids = random_ids(2, min(sizes.seq_len, 64), ours.config.vocab_size, seed=1)
    with torch.no_grad():
        diff = (ours(input_ids=ids).logits - upstream(input_ids=ids).logits).abs().max().item()
    if not diff <= LOGITS_TOLERANCE:
        raise SystemExit(f"ours and upstream disagree: max |diff logits| = {diff:.3g} > {LOGITS_TOLERANCE}")
    return diff


def greedy_tokens_identical(ours: ZayaLM, upstream: ZayaLM, sizes: BenchSizes) -> bool:
    """Whether both models greedily generate the same tokens for the decode prompt (informative only: with random
    weights a near-tie between two logits can legitimately flip on rounding)."""
    prompt = random_ids(1, sizes.prompt_len, ours.config.vocab_size, seed=5)
    return torch.equal(
        greedy_generate(ours, prompt, sizes.new_tokens), greedy_generate(upstream, prompt, sizes.new_tokens)
    )


def grouped_mm_ops_used(model: ZayaLM, sizes: BenchSizes) -> list[str]:
    """Names of the grouped-matmul ops a forward of `model` ran (proof that `grouped_mm` experts are in use)."""
    ids = random_ids(1, min(sizes.seq_len, 32), model.config.vocab_size, seed=2)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(input_ids=ids)
    return sorted({event.key for event in prof.key_averages() if "grouped_mm" in event.key})


def random_ids(batch: int, length: int, vocab_size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # Avoid the special ids so that nothing (padding, EOS) is treated specially.
    return torch.randint(3, vocab_size, (batch, length), generator=generator)


# --------------------------------------------------------------------------------------------------------------------
# The measured phases: each factory returns a closure that runs one repeat and returns the tokens it processed
# --------------------------------------------------------------------------------------------------------------------


def make_train_step(model: ZayaLM, sizes: BenchSizes) -> Callable[[], int]:
    ids = random_ids(sizes.train_batch, sizes.seq_len, model.config.vocab_size, seed=3)
    # Fused (one kernel for all tensors), as our trainers run it: the per-tensor default spent a quarter of this step.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step() -> int:
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.eval()
        return ids.numel()

    return step


def make_prefill(model: ZayaLM, sizes: BenchSizes) -> Callable[[], int]:
    ids = random_ids(sizes.prefill_batch, sizes.seq_len, model.config.vocab_size, seed=4)

    def prefill() -> int:
        with torch.no_grad():
            model(input_ids=ids, use_cache=True)
        return ids.numel()

    return prefill


def make_decode(model: ZayaLM, sizes: BenchSizes, batch: int) -> Callable[[], int]:
    prompt = random_ids(batch, sizes.prompt_len, model.config.vocab_size, seed=5)

    def decode() -> int:
        return greedy_generate(model, prompt, sizes.new_tokens).numel()

    return decode


def make_compiled_decode(
    model: ZayaForCausalLM, sizes: BenchSizes, batch: int, decoder: CompiledDecoder
) -> Callable[[], int]:
    """`make_decode` with every decode step through `decoder` (`zaya_model.cpu.decode.CompiledDecoder`)."""
    from zaya_model.cpu.decode import greedy_generate as compiled_greedy_generate

    prompt = random_ids(batch, sizes.prompt_len, model.config.vocab_size, seed=5)

    def decode() -> int:
        return compiled_greedy_generate(model, decoder, prompt, sizes.new_tokens).numel()

    return decode


def with_compiled_paths(model: ZayaForCausalLM, run: Callable[[], int], compiled: bool) -> Callable[[], int]:
    """`run` with our model's compiled layers (`zaya_model.cpu.compiled_layers`) switched on or off, so that one
    model object is timed both ways."""
    from zaya_model.cpu.compiled_layers import enable_compiled_layers

    def switched() -> int:
        enable_compiled_layers(model, compiled)
        return run()

    return switched


def greedy_generate(model: ZayaLM, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Exactly `new_tokens` greedy tokens per row; returns only the new tokens. No EOS token: `min_new_tokens` would
    hold rows to the length too, but through a logits processor that costs ~0.8 ms a step (it rebuilds a
    vocabulary-sized mask each time), a sixth of a compiled batch-1 step and the same for both implementations."""
    with torch.no_grad():
        # transformers' `GenerativePreTrainedModel`, the self type of `generate`, lists attributes (`encoder`, ...)
        # that a decoder-only model does not have.
        out = model.generate(  # type: ignore[misc]
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=PAD,
            eos_token_id=None,
        )
    generated = out[:, prompt.shape[1] :]
    if generated.shape[1] != new_tokens:
        raise RuntimeError(f"generate produced {generated.shape[1]} tokens, expected {new_tokens}")
    return generated


def make_phase(phase: str, model: ZayaLM, sizes: BenchSizes) -> Callable[[], int]:
    if phase == "train_step":
        return make_train_step(model, sizes)
    if phase == "prefill":
        return make_prefill(model, sizes)
    if phase in ("decode_b1", "decode_b8"):
        return make_decode(model, sizes, sizes.decode_batches[phase == "decode_b8"])
    raise ValueError(f"unknown phase {phase!r}")


@dataclass
class PhaseTiming:
    tokens_per_s: dict[str, list[float]] = field(default_factory=dict)
    seconds: dict[str, list[float]] = field(default_factory=dict)


def time_interleaved(
    runners: dict[str, Callable[[], int]], warmup: int, repeats: int, device: torch.device | None = None
) -> PhaseTiming:
    """Warm up each runner, then alternate them (A B, B A, A B, ...) so drifting machine load hits both alike; on a
    GPU `device`, synchronised before and after each timed call."""
    names = list(runners)
    for _ in range(warmup):
        for name in names:
            runners[name]()
    timing = PhaseTiming({n: [] for n in names}, {n: [] for n in names})
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else reversed(names):
            synchronize(device)
            start = time.perf_counter()
            tokens = runners[name]()
            synchronize(device)
            elapsed = time.perf_counter() - start
            timing.seconds[name].append(elapsed)
            timing.tokens_per_s[name].append(tokens / elapsed)
    return timing


def synchronize(device: torch.device | None) -> None:
    """Wait for the work queued on a CUDA (or ROCm) `device`; nothing to wait for on the CPU."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------------------------------
# Peak memory: one fresh subprocess per (implementation, phase)
# --------------------------------------------------------------------------------------------------------------------


def reset_peak_rss() -> bool:
    """Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measure_phase_memory(impl: str, phase: str, model_dir: str, sizes: BenchSizes, ours_source: str) -> dict:
    """Peak RSS growth of one phase (run twice: the first run allocates AdamW state and caches) over the RSS after
    the model is loaded and the inputs are built."""
    model = load_model(impl, model_dir, ours_source)
    run = make_phase(phase, model, sizes)
    # Loaded weights can still be memory-mapped pages of the checkpoint that become resident on first use: touch
    # them now, so they are part of the baseline rather than of the phase's peak.
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.sum()
    gc.collect()
    if reset_peak_rss():
        method = "VmHWM after phase - VmRSS before (peak reset via /proc/self/clear_refs)"
        baseline_kib = environment.proc_status_kib("VmRSS")
        run()
        run()
        peak_kib = environment.proc_status_kib("VmHWM")
    else:
        method = "ru_maxrss after phase - ru_maxrss after load"
        baseline_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        run()
        run()
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_mib": (peak_kib - baseline_kib) / 1024, "baseline_mib": baseline_kib / 1024, "method": method}


def run_isolated(target: Callable[..., dict], *args, timeout_s: int) -> dict:
    """Run `target(*args)` in a fresh process forked from a clean fork server (torch already imported, nothing
    computed yet), so each measurement starts from the same state and a hang or crash cannot stall the benchmark."""
    context = multiprocessing.get_context("forkserver")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_isolated_entry, args=(sender, torch.get_num_threads(), target, args), daemon=True)
    process.start()
    sender.close()
    try:
        if not receiver.poll(timeout_s):
            process.kill()
            return {"error": f"timed out after {timeout_s} s"}
        return receiver.recv()
    except EOFError:  # the child died without answering (e.g. SIGILL from an AMX instruction)
        process.join(5)
        return {"error": f"worker died with exit code {process.exitcode}"}
    finally:
        process.join(5)
        receiver.close()


def _isolated_entry(sender, num_threads: int, target: Callable[..., dict], args: tuple) -> None:
    torch.set_num_threads(num_threads)
    init_amx()
    prepare_training_process()
    quiet_transformers()
    try:
        result = target(*args)
    except Exception as error:  # reported in the JSON instead of killing the whole benchmark
        result = {"error": f"{type(error).__name__}: {error}"}
    sender.send(result)
    sender.close()


def start_fork_server(ours_source: str) -> threading.Thread:
    """Start the fork server, which imports the heavy modules once so each isolated measurement starts in a second.

    Starting it blocks until those imports are done, so it happens in a thread that overlaps them with building the
    models; join the thread before timing anything, so the server sits idle by then."""
    preload = ["__main__", "transformers.models.zaya.modeling_zaya", "transformers.models.qwen3.modeling_qwen3"]
    if ours_source == "zaya_model":
        preload.append("zaya_model")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(preload)
    starter = threading.Thread(target=_bring_up_fork_server, args=(context,), daemon=True)
    starter.start()
    return starter


def _bring_up_fork_server(context) -> None:
    process = context.Process(target=_do_nothing, daemon=True)
    process.start()
    process.join()


def _do_nothing() -> None:
    """Forked only to bring the fork server up."""


# --------------------------------------------------------------------------------------------------------------------
# KV + state bytes per token
# --------------------------------------------------------------------------------------------------------------------


def cache_tensors(obj, seen: set[int] | None = None) -> list[torch.Tensor]:
    """Every tensor reachable from a cache object through attributes, lists, tuples and dicts (each object once)."""
    seen = set() if seen is None else seen
    leaf_types = (str, int, float, bool, torch.dtype, torch.device, torch.nn.Module)  # a module is never cache state
    if id(obj) in seen or obj is None or isinstance(obj, leaf_types):
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, list | tuple | set):
        children = list(obj)
    elif hasattr(obj, "__dict__"):
        children = list(vars(obj).values())
    else:
        return []
    found = []
    for child in children:
        found += cache_tensors(child, seen)
    return found


def cache_bytes_per_token(model: transformers.PreTrainedModel, num_tokens: int) -> dict:
    """Prefill one sequence of `num_tokens` and sum the bytes of the tensors held by the returned cache."""
    ids = random_ids(1, num_tokens, model.config.vocab_size, seed=6)
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    tensors = cache_tensors(cache)
    # Two views of one buffer count once, as the larger view.
    by_storage: dict[int, int] = {}
    for tensor in tensors:
        key = tensor.untyped_storage().data_ptr()
        by_storage[key] = max(by_storage.get(key, 0), tensor.numel() * tensor.element_size())
    total = sum(by_storage.values())
    return {
        "cache_class": type(cache).__name__,
        "num_tensors": len(tensors),
        "total_bytes": total,
        "bytes_per_token": total / num_tokens,
    }


def reference_transformer(sizes: BenchSizes, num_kv_heads: int) -> transformers.PreTrainedModel:
    """A standard Qwen3 transformer as wide as the benchmark model (same heads, head_dim and layers)."""
    m = sizes.model
    config = transformers.Qwen3Config(
        vocab_size=m["vocab_size"],
        hidden_size=m["hidden_size"],
        intermediate_size=m["moe_intermediate_size"],
        num_hidden_layers=m["num_hidden_layers"],
        num_attention_heads=m["num_attention_heads"],
        num_key_value_heads=num_kv_heads,
        head_dim=m["head_dim"],
        max_position_embeddings=max(4096, sizes.seq_len),
    )
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


# --------------------------------------------------------------------------------------------------------------------
# FLOPs and matmul ceilings
# --------------------------------------------------------------------------------------------------------------------


def train_step_flops(model: ZayaLM, sizes: BenchSizes) -> dict:
    """Analytic FLOPs of one train step (forward + backward; the AdamW update is O(params), ignored).

    FLOPs = 6 * N_active * T + 6 * L * (H * d) * S * T, with T = batch * seq tokens, where
    - N_active = parameters one token multiplies with (`active_parameters`, from the product's `count_parameters`):
      all parameters, minus the (E - 1) unused experts of each layer (top-1 routing; tokens sent to the skip class
      make this a slight overestimate). The tied embedding counts once,
      for the LM head matmul (the embedding lookup costs no FLOPs). 6 = 2 (multiply-add) * 3 (forward + 2 backward).
    - the attention term: QK^T and PV each cost 2 * (H * d) FLOPs per (query, key) pair; with a causal mask a query
      sees S / 2 keys on average, so 2 * 2 * H * d * S / 2 = 2 * H * d * S per token per layer forward, times 3 for
      training.
    """
    tokens = sizes.train_batch * sizes.seq_len
    return {
        "total_params": sum(p.numel() for p in model.parameters()),
        "active_params_per_token": active_parameters(model),
        "tokens_per_step": tokens,
        "flops_per_step": flops_per_token(model, sizes.seq_len) * tokens,
        "formula": "6 * active_params * tokens + 6 * layers * (heads * head_dim) * seq * tokens",
    }


def active_parameters(model: ZayaLM) -> int:
    """Parameters one token multiplies with, as the product counts them (`zaya_model.count_parameters`: the experts
    a top-1 token does not use left out), plus the tied embedding once, for the LM head matmul."""
    from zaya_model import count_parameters

    # Upstream's model (`--ours transformers`) has ours' module tree, all that `count_parameters` reads.
    counts = count_parameters(cast(ZayaForCausalLM, model))
    return counts["active_non_embedding"] + model.config.vocab_size * model.config.hidden_size


def flops_per_token(model: ZayaLM, seq_len: int, passes: int = 6) -> float:
    """`passes` * (active parameters + layers * query width * seq): multiply-adds (2) x forward + backward (3) for a
    train step (`passes` 6; 2 for a forward), plus causal attention (QK^T and PV over seq / 2 keys on average)."""
    config = model.config
    attention = config.num_hidden_layers * config.num_attention_heads * config.head_dim * seq_len
    return passes * (active_parameters(model) + attention)


def matmul_gflops(
    size: int,
    repeats: int,
    *,
    bf16_autocast: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    warmup: int = 1,
    calls_per_sample: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """GFLOP/s of a `size`^2 matmul of random `dtype` tensors (under bf16 autocast if asked): `warmup` untimed calls,
    then `repeats` samples, each `calls_per_sample` calls timed by `clock` (on a GPU, synchronised around them)."""
    a, b = (torch.randn(size, size, dtype=dtype, device=device) for _ in range(2))
    autocast = torch.autocast(a.device.type, dtype=torch.bfloat16) if bf16_autocast else contextlib.nullcontext()
    samples = []
    with autocast:
        for _ in range(warmup):
            a @ b
        for _ in range(repeats):
            synchronize(device)
            start = clock()
            for _ in range(calls_per_sample):
                a @ b
            synchronize(device)
            samples.append(calls_per_sample * 2 * size**3 / (clock() - start) / 1e9)
    return samples


def init_amx() -> bool:
    """Ask Linux for AMX tile permission; without it a bf16 matmul on AMX CPUs can hang or die with SIGILL."""
    return bool(torch.cpu._init_amx()) if hasattr(torch.cpu, "_init_amx") else False


def bf16_matmul_probe() -> dict:
    """GFLOP/s of a `BF16_PROBE_SIZE`^2 matmul in bf16 and in fp32 (tensors already in the dtype, so no autocast
    casts are timed; each kernel compiled by a first call). Without hardware bf16 (AMX or AVX512-BF16) bf16 runs a
    slow reference kernel, ~1 s here, and loses to fp32."""
    result: dict = {"size": BF16_PROBE_SIZE}
    for name, dtype in (("bf16_gflops", torch.bfloat16), ("fp32_gflops", torch.float32)):
        result[name] = median(matmul_gflops(BF16_PROBE_SIZE, 5, dtype=dtype))
    return result


def measure_bf16(model_dir: str, sizes: BenchSizes, ours_source: str) -> dict:
    """Matmul and train-step speed under bf16 autocast (run in a subprocess with a timeout by the main process);
    ours with compiled layers, and eager as `ours_eager`, as in fp32.

    Without hardware bf16 (AMX or AVX512-BF16) a bf16 matmul runs a slow reference kernel (a 2048^2 matmul takes
    ~15 s): a small probe detects that, and then only the probe is reported, with the reason."""
    amx = init_amx()
    probe = bf16_matmul_probe()
    result = {"amx_initialized": amx, "probe": probe}
    if probe["bf16_gflops"] < probe["fp32_gflops"]:
        result["skipped"] = "bf16 matmul is slower than fp32 on this CPU (no hardware bf16): only the probe ran"
        return result
    result["matmul_size"] = sizes.matmul_size
    result["matmul_gflops"] = matmul_gflops(sizes.matmul_size, sizes.bf16_repeats, bf16_autocast=True)
    models = {impl: load_model(impl, model_dir, ours_source) for impl in ("ours", "upstream")}
    runners = {impl: make_train_step(model, sizes) for impl, model in models.items()}
    ours = models["ours"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if isinstance(ours, ZayaForCausalLM):  # the compiled paths of `zaya_model.cpu` are ours only
            runners["ours_eager"] = with_compiled_paths(ours, make_train_step(ours, sizes), False)
            runners["ours"] = with_compiled_paths(ours, runners["ours"], True)
            start = time.perf_counter()
            runners["ours"]()
            result["compile_seconds"] = time.perf_counter() - start
        timing = time_interleaved(runners, warmup=1, repeats=sizes.bf16_repeats)
    result["train_step_seconds"] = timing.seconds
    return result


# --------------------------------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------------------------------


def machine_info() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in _cpuinfo_lines() if ln.startswith("model name")), "unknown")
    flags = next((ln.split(":", 1)[1].split() for ln in _cpuinfo_lines() if ln.startswith("flags")), [])
    return {
        **environment.machine_summary(),
        "cpu": cpu,
        "cpu_flags_of_note": sorted(f for f in flags if f.startswith(("amx", "avx512_bf16", "avx512f"))),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ["OMP_NUM_THREADS"],
    }


def _cpuinfo_lines() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def run_benchmark(sizes: BenchSizes, mode: str, ours_source_arg: str) -> dict:
    ours_source, _, _ = ours_classes(ours_source_arg)
    if ours_source == "transformers":
        print("WARNING: --ours transformers: 'ours' is upstream transformers (ratios are ~1 by design)")
    report: dict = {
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "mode": mode,
        "ours_source": ours_source,
        "machine": machine_info(),
        "sizes": asdict(sizes),
        "config": model_config_kwargs(sizes.model, sizes.seq_len),
        "stage_seconds": {},
    }
    stage = functools.partial(timed_stage, report["stage_seconds"])
    fork_server_ready = start_fork_server(ours_source)  # its imports overlap with building the models
    with tempfile.TemporaryDirectory(prefix="zaya-bench-") as model_dir:
        with stage("build ours, save it, load both from the checkpoint"):
            # Both timed models come from the same checkpoint, so they are loaded the same way.
            save_random_ours(report["config"], ours_source, model_dir)
            ours = load_model("ours", model_dir, ours_source)
            upstream = load_model("upstream", model_dir, ours_source)
        models = {"ours": ours, "upstream": upstream}
        flops = train_step_flops(ours, sizes)
        report["parameters"] = {
            "total": flops["total_params"],
            "active_per_token": flops["active_params_per_token"],
        }
        print(
            f"model: {flops['total_params'] / 1e6:.1f}M parameters, "
            f"{flops['active_params_per_token'] / 1e6:.1f}M active per token"
        )
        check_models(models, sizes, report)
        with stage("wait for the fork server"):
            fork_server_ready.join()
        time_phases(models, sizes, report, stage)

        del models, ours, upstream
        gc.collect()
        with stage("KV + state bytes per token"):
            report["kv_state_bytes_per_token"] = measure_cache_sizes(model_dir, sizes, ours_source)

        with stage("peak memory (a fresh process per phase)"):
            report["peak_memory_mib"] = measure_peak_memory(model_dir, sizes, ours_source)

        with stage("matmul ceilings and bf16 autocast"):
            report["gflops"] = measure_gflops(report, flops, model_dir, sizes, ours_source)
    return report


def check_models(models: dict[str, ZayaLM], sizes: BenchSizes, report: dict) -> None:
    """Record that the two models are set up as compared: upstream with its `grouped_mm` experts, the attention
    implementations, the same logits (aborts otherwise) and whether their greedy tokens agree."""
    ours, upstream = models["ours"], models["upstream"]
    grouped_ops = grouped_mm_ops_used(upstream, sizes)
    report["upstream_experts"] = {
        "implementation": upstream.config._experts_implementation,
        "grouped_mm_ops_seen": grouped_ops,
    }
    if upstream.config._experts_implementation != "grouped_mm" or not grouped_ops:
        raise SystemExit(f"upstream does not run grouped_mm experts: {report['upstream_experts']}")
    report["attention_implementation"] = {n: m.config._attn_implementation for n, m in models.items()}
    report["max_abs_logits_diff"] = check_same_logits(ours, upstream, sizes)
    print(f"same weights: max |diff logits| = {report['max_abs_logits_diff']:.2e}")
    report["greedy_tokens_identical"] = greedy_tokens_identical(ours, upstream, sizes)


def time_phases(models: dict[str, ZayaLM], sizes: BenchSizes, report: dict, stage) -> None:
    """Interleaved timing of every phase; fills the report's samples, seconds, medians, ratios and targets.

    Ours runs with its compiled paths (`zaya_model.cpu`: compiled layers for the train step and prefill, compiled
    decode steps for decoding), compiled before timing; the same model fully eager is timed alongside as
    `ours_eager`."""
    report["samples"], report["seconds"], report["medians"] = {}, {}, {}
    ours = models["ours"]
    decoder = None
    if isinstance(ours, ZayaForCausalLM):  # the compiled paths of `zaya_model.cpu` are ours only
        from zaya_model.cpu.decode import CompiledDecoder

        decoder = CompiledDecoder(ours)
    report["compile_seconds"] = {}
    # Inference phases first: the train step changes the weights.
    for phase in ("prefill", "decode_b1", "decode_b8", "train_step"):
        with stage(f"timing {phase}"):
            runners = {impl: make_phase(phase, model, sizes) for impl, model in models.items()}
            if isinstance(ours, ZayaForCausalLM) and decoder is not None:
                runners["ours_eager"] = with_compiled_paths(ours, make_phase(phase, ours, sizes), False)
                if phase in ("decode_b1", "decode_b8"):
                    batch = sizes.decode_batches[phase == "decode_b8"]
                    runners["ours"] = make_compiled_decode(ours, sizes, batch, decoder)
                runners["ours"] = with_compiled_paths(ours, runners["ours"], True)
                start = time.perf_counter()
                runners["ours"]()  # compiles this phase's graphs
                report["compile_seconds"][phase] = time.perf_counter() - start
            timing = time_interleaved(runners, sizes.warmup, sizes.repeats)
        report["samples"][phase] = timing.tokens_per_s
        report["seconds"][phase] = timing.seconds
        report["medians"][phase] = {impl: median(v) for impl, v in timing.tokens_per_s.items()}
        del runners  # frees the AdamW states
        gc.collect()
    medians = report["medians"]
    report["ratios"] = {phase: ratio(medians[phase]["ours"], medians[phase]["upstream"]) for phase in PHASES}
    report["ratios_eager"] = {
        phase: ratio(medians[phase]["ours_eager"], medians[phase]["upstream"])
        for phase in PHASES
        if "ours_eager" in medians[phase]
    }
    report["targets"] = {
        phase: {
            "min_ratio": target,
            "ratio": report["ratios"][phase],
            "met": report["ratios"][phase] is not None and report["ratios"][phase] >= target,
        }
        for phase, target in TARGETS.items()
    }


def measure_peak_memory(model_dir: str, sizes: BenchSizes, ours_source: str) -> dict:
    """Each phase's peak memory, for each implementation, each in a fresh process."""
    return {
        phase: {
            impl: run_isolated(
                measure_phase_memory, impl, phase, model_dir, sizes, ours_source, timeout_s=sizes.worker_timeout_s
            )
            for impl in ("ours", "upstream")
        }
        for phase in PHASES
    }


def measure_cache_sizes(model_dir: str, sizes: BenchSizes, ours_source: str) -> dict:
    n = sizes.seq_len
    caches = {
        "ours": cache_bytes_per_token(load_model("ours", model_dir, ours_source), n),
        "upstream": cache_bytes_per_token(load_model("upstream", model_dir, ours_source), n),
        "gqa_transformer": cache_bytes_per_token(reference_transformer(sizes, sizes.model["num_key_value_heads"]), n),
        "mha_transformer": cache_bytes_per_token(reference_transformer(sizes, sizes.model["num_attention_heads"]), n),
    }
    per_token = {name: r["bytes_per_token"] for name, r in caches.items()}
    ratios = {
        "ours/upstream": ratio(per_token["ours"], per_token["upstream"]),
        "ours/gqa": ratio(per_token["ours"], per_token["gqa_transformer"]),
        "ours/mha": ratio(per_token["ours"], per_token["mha_transformer"]),
        "upstream/gqa": ratio(per_token["upstream"], per_token["gqa_transformer"]),
        "upstream/mha": ratio(per_token["upstream"], per_token["mha_transformer"]),
    }
    return {**caches, "prefill_tokens": n, "ratios": ratios}


def measure_gflops(report: dict, flops: dict, model_dir: str, sizes: BenchSizes, ours_source: str) -> dict:
    fp32_matmul = matmul_gflops(sizes.matmul_size, max(3, sizes.repeats), bf16_autocast=False)
    fp32 = {
        "matmul_size": sizes.matmul_size,
        "matmul_gflops_samples": fp32_matmul,
        "matmul_gflops": median(fp32_matmul),
    }
    for impl in report["seconds"]["train_step"]:
        achieved = flops["flops_per_step"] / median(report["seconds"]["train_step"][impl]) / 1e9
        fp32[f"train_step_gflops_{impl}"] = achieved
        fp32[f"train_step_fraction_of_matmul_{impl}"] = achieved / fp32["matmul_gflops"]

    bf16 = run_isolated(measure_bf16, model_dir, sizes, ours_source, timeout_s=sizes.bf16_timeout_s)
    if "matmul_gflops" in bf16:
        bf16["matmul_gflops_samples"] = bf16.pop("matmul_gflops")
        bf16["matmul_gflops"] = median(bf16["matmul_gflops_samples"])
        for impl, seconds in bf16["train_step_seconds"].items():
            achieved = flops["flops_per_step"] / median(seconds) / 1e9
            bf16[f"train_step_gflops_{impl}"] = achieved
            bf16[f"train_step_fraction_of_matmul_{impl}"] = achieved / bf16["matmul_gflops"]
    return {
        "flops_per_train_step": flops["flops_per_step"],
        "flops_formula": flops["formula"],
        "fp32": fp32,
        "bf16_autocast": bf16,
    }


# --------------------------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------------------------


PHASE_LABELS = {
    "train_step": "train step tok/s",
    "prefill": "prefill tok/s",
    "decode_b1": "greedy decode b1 tok/s",
    "decode_b8": "greedy decode b8 tok/s",
}


def print_table(report: dict) -> None:
    rows: list[tuple[str, ...]] = [("metric", "ours", "upstream", "ours/upstream", "target")]
    rows += speed_rows(report) + memory_rows(report) + gflops_rows(report)
    print(environment.format_rows(rows))
    print(
        f"ours = {report['ours_source']}; max |diff logits| {report['max_abs_logits_diff']:.1e}; "
        f"greedy tokens identical: {report['greedy_tokens_identical']}; "
        f"{report['parameters']['total'] / 1e6:.1f}M params; {report['machine']['cpu']}"
    )
    print(
        "ours/upstream: ours with its compiled paths against upstream eager; 'ours eager' rows: eager against eager. "
        "Upstream is never compiled here: transformers compiles generate() only with a compilable cache, which its "
        "zaya lacks (_can_compile_fullgraph = False); a torch.compile'd upstream train step and prefill is not "
        "measured here (gpu_check's upstream_compiled rows)."
    )


def speed_rows(report: dict) -> list[tuple[str, ...]]:
    """Each phase's tokens/s, ours (compiled paths) and ours eager against upstream, with the targets."""
    medians, ratios, labels = report["medians"], report["ratios"], PHASE_LABELS
    rows: list[tuple[str, ...]] = []
    for phase in PHASES:
        target = report["targets"].get(phase)
        target_text = "" if target is None else f">={target['min_ratio']}x {'met' if target['met'] else 'NOT met'}"
        rows.append(
            (
                labels[phase],
                fmt(medians[phase]["ours"]),
                fmt(medians[phase]["upstream"]),
                fmt_ratio(ratios[phase]),
                target_text,
            )
        )
    for phase, eager_ratio in report["ratios_eager"].items():
        rows.append(
            (
                f"{labels[phase]}, ours eager",
                fmt(medians[phase]["ours_eager"]),
                fmt(medians[phase]["upstream"]),
                fmt_ratio(eager_ratio),
                f"ours above: {COMPILED_PATHS[phase]}, compiled first ({report['compile_seconds'][phase]:,.0f} s)",
            )
        )
    return rows


def memory_rows(report: dict) -> list[tuple[str, ...]]:
    """Each phase's peak memory, and the KV + state bytes per token against plain transformers'."""
    rows: list[tuple[str, ...]] = []
    for phase in PHASES:
        mem = report["peak_memory_mib"][phase]
        ours_mib, up_mib = mem["ours"].get("peak_mib"), mem["upstream"].get("peak_mib")
        rows.append(
            (
                f"peak memory {phase} MiB" + (" (eager)" if phase.startswith("decode") else ""),
                fmt(ours_mib, ",.1f"),
                fmt(up_mib, ",.1f"),
                fmt_ratio(ratio(ours_mib, up_mib)),
                "",
            )
        )
    kv = report["kv_state_bytes_per_token"]
    rows.append(
        (
            "KV+state bytes/token",
            fmt(kv["ours"]["bytes_per_token"]),
            fmt(kv["upstream"]["bytes_per_token"]),
            fmt_ratio(kv["ratios"]["ours/upstream"]),
            f"GQA {kv['gqa_transformer']['bytes_per_token']:,.0f}, MHA {kv['mha_transformer']['bytes_per_token']:,.0f}",
        )
    )
    return rows


def gflops_rows(report: dict) -> list[tuple[str, ...]]:
    """The train step's GFLOP/s in fp32 and under bf16 autocast, against a plain matmul's."""
    rows: list[tuple[str, ...]] = []
    for precision in ("fp32", "bf16_autocast"):
        g = report["gflops"][precision]
        if "error" in g:
            rows.append((f"train GFLOP/s {precision}", "n/a", "n/a", "", g["error"][:70]))
            continue
        ours_gflops, up_gflops = g.get("train_step_gflops_ours"), g.get("train_step_gflops_upstream")
        if "skipped" in g:
            probe = g["probe"]
            note = f"{probe['size']}^2 matmul {probe['bf16_gflops']:,.1f} GFLOP/s; {g['skipped']}"
        else:
            note = f"{g['matmul_size']}^2 matmul {g['matmul_gflops']:,.1f} GFLOP/s"
        rows.append(
            (
                f"train GFLOP/s {precision}",
                fmt(ours_gflops, ",.1f"),
                fmt(up_gflops, ",.1f"),
                fmt_ratio(ratio(ours_gflops, up_gflops)),
                note,
            )
        )
        eager_gflops = g.get("train_step_gflops_ours_eager")
        if eager_gflops is not None:
            rows.append(
                (
                    f"train GFLOP/s {precision}, ours eager",
                    fmt(eager_gflops, ",.1f"),
                    fmt(up_gflops, ",.1f"),
                    fmt_ratio(ratio(eager_gflops, up_gflops)),
                    "",
                )
            )
    return rows


def quiet_transformers() -> None:
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny config and few repeats (a smoke test, seconds)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON report path (default {DEFAULT_OUT})")
    parser.add_argument(
        "--threads",
        type=int,
        default=environment.DEFAULT_THREADS,
        help="torch threads (default 2, the benchmark's setting; the smoke test uses 1)",
    )
    parser.add_argument(
        "--ours",
        choices=("zaya_model", "transformers"),
        default="zaya_model",
        help="where 'ours' comes from; 'transformers' benchmarks upstream against itself",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    environment.use_threads(args.threads)
    init_amx()
    process = prepare_training_process()
    quiet_transformers()
    mode = "quick" if args.quick else "full"
    report = run_benchmark(QUICK if args.quick else FULL, mode, args.ours)
    report["process"] = process
    environment.publish_report(args.out, report, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
