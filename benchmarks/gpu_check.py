"""Our ZAYA1 on a GPU (CUDA or ROCm): checked against the CPU reference, timed beside upstream `transformers`' `zaya`.

Run: `python -m benchmarks.gpu_check [--quick] [--device D] [--compile auto|on|off] [--budget-s S] [--only PART..]`
(`--quick`: tiny shapes, a smoke test that also runs on CPU; CI runs it there. `--compile auto` compiles on a GPU
only: on 2 CPU cores compiling both models takes many minutes, and the compiled rows are then not measured.)

1. **Checks against the CPU reference** (our model, eager, fp32 on the CPU), on model_bench's shape:
   - fp32 logits on the device, through the reference path and through the grouped-matmul experts
     (`zaya_model.kernels.grouped_mm_experts`): relative error `|out - ref| / |ref|` at most `FP32_TOLERANCE`
     (TF32 off);
   - bf16 greedy generation on the device (bf16 weights, grouped-matmul experts): the device's bf16 logits over the
     generated sequence within `BF16_TOLERANCE` of the reference's, and every generated token consistent with the
     reference: its reference logit is the maximum or within twice the bf16 error at that position of it (only then
     can rounding flip an argmax). Agreement with the reference's own fp32 greedy tokens is reported too.
2. **Speed beside upstream on the same device, same weights, same batches** (upstream `ZayaForCausalLM` built from
   the same config, loaded with our state dict, `grouped_mm` experts and sdpa as model_bench loads it; a shape's
   upstream rows are dropped if its fp32 logits differ from ours). For model_bench's shape (hidden 512, 8 layers) and
   a ZAYA1-base-wide layer stack (the widths of `ZayaConfig.zaya1_base()`: hidden 2048, 16 experts, 2048-wide
   experts, 8 x 128 query heads, 2 KV heads; `WIDE_LAYERS` layers; model_bench's vocabulary, so that the layer stack
   and not a 262k-word LM head is measured):
   - **train step** (forward + backward + fused AdamW) in bf16 two ways: `autocast` (fp32 weights and optimizer,
     bf16 autocast: `zaya pretrain --dtype bf16` and `Trainer(bf16=True)`) and `bf16 weights` (the model in bf16);
     tokens/s and MFU against a bf16 matmul measured in the same run;
   - **prefill** (`no_grad` forward with `use_cache=True`, bf16 weights): tokens/s, MFU;
   - **greedy decode** at batch 1 and 32 (`generate`, bf16 weights, a 128-token prompt, exactly 64 new tokens):
     generated tokens/s.
   Implementations: `ours_eager` (the reference model as it is), `ours_best` (grouped-matmul experts, plus compiled
   layers for train steps and prefill: `enable_compiled_layers`; decoding steps are not compiled on this path),
   `upstream_eager` (as shipped) and
   `upstream_compiled` (`torch.compile(model)`, for train steps and prefill; transformers does not compile ZAYA's
   generation: `_can_compile_fullgraph = False`, its hybrid cache is not a compilable cache). Each row states
   eager/eager and best/best (each side's faster path). Before timing, each implementation's first call (compiling
   where it compiles) is a check: for train steps one forward + backward without an optimizer step, whose loss and
   gradient norm must agree across the four (same weights, same batch: all of them train the same model); for
   prefill, its logits against its own side's eager path.
   Timing: one clock for every loop, outside it: `time.perf_counter()` around each call, the device synchronised
   before and after; implementations interleaved (A B C D, then D C B A, ...). Rows are measured in priority order
   (the wide stack's train step first); once `--budget-s` seconds have passed, the remaining rows are recorded as not
   measured, with that reason.

The JSON report (`--out`) is rewritten after every row, so a run cut short still leaves what it measured. Exit status
1 if a check failed or a row raised (the row records the error).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks import environment
from benchmarks import model_bench as mb
from benchmarks.environment import fmt
from zaya_model import ZayaConfig, ZayaForCausalLM
from zaya_model.cpu.compiled_layers import enable_compiled_layers
from zaya_model.kernels.grouped_mm_experts import use_grouped_mm_experts

DEFAULT_OUT = environment.default_out("gpu_check")
FP32_TOLERANCE = 1e-4  # relative error of fp32 logits, device against CPU
NEAR_TIE = 1e-3  # largest routing margin (biased probability) that fp32 rounding may flip
BF16_TOLERANCE = 3e-2  # relative error of bf16 logits against the fp32 reference
LOSS_TOLERANCE = 2e-2  # relative spread of the first bf16 loss across implementations
GRAD_NORM_TOLERANCE = 5e-2  # relative spread of the first gradient norm
PREFILL_TOLERANCE = 5e-2  # relative error of a faster path's bf16 prefill logits against its eager path's
LOGITS_KEPT = 64  # last positions of each prefill's logits compared across implementations
TARGET_WIDE_TRAIN = 1.3  # ours / upstream, bf16 train step of the wide stack, best against best
WIDE_LAYERS = 4
IMPLS = ("ours_eager", "ours_best", "upstream_eager", "upstream_compiled")
NOT_COMPILING = "compiling is off in this run (--compile; off by default on a CPU)"
NO_COMPILED_GENERATION = (
    "transformers does not compile ZAYA's generation (ZayaPreTrainedModel._can_compile_fullgraph = False: its hybrid "
    "cache is not a compilable cache)"
)


@dataclass(frozen=True)
class Shape:
    name: str
    model: dict
    seq_len: int
    train_batch: int
    prefill_batch: int
    prompt_len: int
    new_tokens: int
    decode_batches: tuple[int, ...]


@dataclass(frozen=True)
class Sizes:
    """Everything that `--quick` shrinks."""

    shapes: tuple[Shape, ...]
    check_model: dict
    check_seq: int
    check_prompt: int
    check_new_tokens: int
    warmup: int
    repeats: int
    matmul_size: int


def wide_model(layers: int, vocab_size: int) -> dict:
    """A ZAYA1-base-wide layer stack: `ZayaConfig.zaya1_base()`'s widths, `layers` blocks, upstream's behaviour for
    what upstream cannot express (skip class outputs zero, residual in fp32)."""
    base = ZayaConfig.zaya1_base()
    widths = (
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "moe_intermediate_size",
        "num_experts",
        "router_hidden_size",
    )
    return {key: getattr(base, key) for key in widths} | {"num_hidden_layers": layers, "vocab_size": vocab_size}


FULL = Sizes(
    shapes=(
        Shape("zaya1-base-wide", wide_model(WIDE_LAYERS, mb.FULL.model["vocab_size"]), 2048, 16, 16, 128, 64, (1, 32)),
        Shape("model_bench", mb.FULL.model, 2048, 16, 16, 128, 64, (1, 32)),
    ),
    check_model=mb.FULL.model,
    check_seq=128,
    check_prompt=16,
    check_new_tokens=32,
    warmup=1,
    repeats=5,
    matmul_size=8192,
)
QUICK = Sizes(
    shapes=(
        Shape("wide-tiny", dict(mb.QUICK.model, hidden_size=128, moe_intermediate_size=128), 32, 2, 2, 8, 4, (1, 4)),
        Shape("model_bench-tiny", mb.QUICK.model, 32, 2, 2, 8, 4, (1, 4)),
    ),
    check_model=mb.QUICK.model,
    check_seq=16,
    check_prompt=8,
    check_new_tokens=8,
    warmup=1,
    repeats=2,
    matmul_size=256,
)


# --------------------------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------------------------


def build_ours(model: dict, seq_len: int, device: torch.device) -> ZayaForCausalLM:
    """Our model with seeded random weights, built on `device`."""
    torch.manual_seed(0)
    with torch.device(device):
        built = ZayaForCausalLM._from_config(
            ZayaConfig(**mb.model_config_kwargs(model, seq_len)), attn_implementation="sdpa", dtype=torch.float32
        )
    return built.eval()


def upstream_copy(ours: ZayaForCausalLM, model: dict, seq_len: int) -> transformers.ZayaForCausalLM:
    """Upstream `transformers.ZayaForCausalLM` with `ours`' weights, on its device, as model_bench loads it."""
    with torch.device(ours.device):
        upstream = transformers.ZayaForCausalLM._from_config(
            transformers.ZayaConfig(**mb.model_config_kwargs(model, seq_len)),
            attn_implementation="sdpa",
            experts_implementation="grouped_mm",
            dtype=torch.float32,
        )
    upstream.load_state_dict(ours.state_dict())
    return upstream.eval()


def set_ours_path(model: ZayaForCausalLM, best: bool, compiled_layers: bool) -> None:
    use_grouped_mm_experts(model, best)
    enable_compiled_layers(model, best and compiled_layers)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


# --------------------------------------------------------------------------------------------------------------------
# 1. Checks against the CPU reference
# --------------------------------------------------------------------------------------------------------------------


def check_against_cpu(sizes: Sizes, device: torch.device) -> dict:
    reference = build_ours(sizes.check_model, sizes.check_seq, torch.device("cpu"))
    on_device = copy.deepcopy(reference).to(device)  # type: ignore[arg-type]  # transformers' @wraps(Module.to) reads to mypy as unbound
    ids = mb.random_ids(2, sizes.check_seq, reference.config.vocab_size, seed=1)
    result: dict = {"model": sizes.check_model, "fp32_logits": {}}
    # The plain fp32 attention kernel: fused ones may round through TF32.
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        expected = routed_forward(reference, ids)
        for path in ("reference", "grouped_mm_experts"):
            use_grouped_mm_experts(on_device, path == "grouped_mm_experts")
            result["fp32_logits"][path] = compare_fp32(routed_forward(on_device, ids.to(device)), expected)
    del on_device
    result["bf16_greedy"] = check_bf16_greedy(reference, sizes, device)
    result["passed"] = all(r["passed"] for r in result["fp32_logits"].values()) and result["bf16_greedy"]["passed"]
    return result


def routed_forward(model: ZayaForCausalLM, ids: torch.Tensor) -> dict:
    """Logits of a forward, with every layer's expert choice [layers, batch, seq] and the margin of that choice over
    the runner-up (biased probabilities, as the router compares them)."""
    routed = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda router, _inputs, out: routed.append((router, out[0], out[1])))
        for layer in model.model.layers
    ]
    try:
        logits = model(input_ids=ids).logits.float().cpu()
    finally:
        for hook in hooks:
            hook.remove()
    margins = []
    for router, router_logits, _ in routed:
        top2 = (torch.softmax(router_logits.float(), dim=-1) + router.balancing_biases).topk(2, dim=-1).values
        margins.append((top2[..., 0] - top2[..., 1]).cpu())
    choices = torch.stack([choice.cpu() for _, _, choice in routed])
    return {"logits": logits, "choices": choices, "margins": torch.stack(margins)}


def compare_fp32(out: dict, expected: dict) -> dict:
    """fp32 logits on the device against the CPU's. A random model has near-tie routing choices that rounding can
    flip; a flipped token changes itself and every later token of its sequence, so logits are compared up to each
    sequence's first flip, and each flip must be a near tie on the CPU (margin at most `NEAR_TIE`)."""
    flipped = out["choices"] != expected["choices"]  # [layers, batch, seq]
    flipped_tokens = flipped.any(dim=0)
    seq = flipped_tokens.shape[1]
    first_flip = torch.where(flipped_tokens, torch.arange(seq), seq).amin(dim=1)
    compared = torch.arange(seq)[None, :] < first_flip[:, None]
    logits, expected_logits = out["logits"][compared], expected["logits"][compared]
    enough = int(compared.sum()) * 4 >= compared.numel()  # at least a quarter of the positions
    error = relative_error(logits, expected_logits) if enough else None
    flip_margin = float(expected["margins"][flipped].max()) if flipped.any() else 0.0
    return {
        "relative_error": error,
        "max_abs_diff": float((logits - expected_logits).abs().max()) if enough else None,
        "compared_positions": int(compared.sum()),
        "positions": compared.numel(),
        "routing_flips": int(flipped.sum()),
        "largest_flipped_margin": flip_margin,
        "tolerance": FP32_TOLERANCE,
        "passed": error is not None and error <= FP32_TOLERANCE and flip_margin <= NEAR_TIE,
    }


def check_bf16_greedy(reference: ZayaForCausalLM, sizes: Sizes, device: torch.device) -> dict:
    """Generation runs with the grouped-matmul experts; compiled layers are checked by the speed rows (same loss and
    gradient norm for train steps, same logits for prefill)."""
    model = copy.deepcopy(reference).to(device, torch.bfloat16)  # type: ignore[arg-type]  # transformers' @wraps(Module.to) reads to mypy as unbound
    use_grouped_mm_experts(model)
    prompt = mb.random_ids(2, sizes.check_prompt, reference.config.vocab_size, seed=5)
    generated = mb.greedy_generate(model, prompt.to(device), sizes.check_new_tokens).cpu()
    sequence = torch.cat((prompt, generated), dim=1)
    with torch.no_grad():
        ref_logits = reference(input_ids=sequence).logits
        logits = model(input_ids=sequence.to(device)).logits.float().cpu()
    # Logits at position p predict token p + 1: the generated tokens' predictions.
    predicting = slice(sizes.check_prompt - 1, sequence.shape[1] - 1)
    ref_at, dev_at = ref_logits[:, predicting], logits[:, predicting]
    error = (dev_at - ref_at).abs().amax(dim=-1)
    gap = ref_at.amax(dim=-1) - ref_at.gather(-1, generated[..., None]).squeeze(-1)
    consistent = gap <= 2 * error + 1e-6
    reference_tokens = mb.greedy_generate(reference, prompt, sizes.check_new_tokens)
    logits_error = relative_error(dev_at, ref_at)
    return {
        "tokens": generated.numel(),
        "consistent_tokens": int(consistent.sum()),
        "largest_gap_over_error": float((gap / (2 * error + 1e-6)).max()),
        "agree_with_reference_greedy": float((generated == reference_tokens).float().mean()),
        "logits_relative_error": logits_error,
        "tolerance": BF16_TOLERANCE,
        "passed": bool(consistent.all()) and logits_error <= BF16_TOLERANCE,
    }


# --------------------------------------------------------------------------------------------------------------------
# 2. Speed
# --------------------------------------------------------------------------------------------------------------------


def matmul_tflops(device: torch.device, size: int) -> float:
    """Median TFLOP/s of a `size`^3 bf16 matmul on `device` (random data; 3 warm-ups, 5 timed batches of 5)."""
    gflops = mb.matmul_gflops(size, 5, dtype=torch.bfloat16, device=device, warmup=3, calls_per_sample=5)
    return statistics.median(gflops) / 1e3


class ShapeModels:
    """Ours and upstream with the same weights on the device, converted to bf16 once the fp32 rows are done."""

    def __init__(self, shape: Shape, device: torch.device, compile_models: bool):
        self.shape, self.device, self.compile = shape, device, compile_models
        self.ours = build_ours(shape.model, shape.seq_len, device)
        self.upstream = upstream_copy(self.ours, shape.model, shape.seq_len)
        self.upstream_compiled = torch.compile(self.upstream) if compile_models else None
        self.dtype = torch.float32
        ids = mb.random_ids(2, min(shape.seq_len, 64), self.ours.config.vocab_size, seed=1).to(device)
        with torch.no_grad():
            self.same_logits_error = relative_error(
                self.upstream(input_ids=ids).logits, self.ours(input_ids=ids).logits
            )
        self.upstream_agrees = self.same_logits_error <= FP32_TOLERANCE

    def upstream_forward(self, impl: str) -> Callable[..., Any]:
        """What runs upstream's forward for `impl`: the model, or the model compiled (`upstream_compiled`)."""
        if impl != "upstream_compiled":
            return self.upstream
        if self.upstream_compiled is None:
            raise RuntimeError(NOT_COMPILING)
        return self.upstream_compiled

    def to(self, dtype: torch.dtype) -> None:
        if dtype != self.dtype:
            self.ours.to(dtype)  # type: ignore[arg-type]  # transformers' @wraps(Module.to) reads to mypy as unbound
            self.upstream.to(dtype)  # type: ignore[arg-type]  # transformers' @wraps(Module.to) reads to mypy as unbound
            self.dtype = dtype


def peak_gib(device: torch.device, before: int) -> float | None:
    if device.type != "cuda":
        return None
    return (torch.cuda.max_memory_allocated(device) - before) / 2**30


def first_call(run: Callable[[], dict], device: torch.device) -> dict:
    """One call, timed (compiling where the implementation compiles), with the device memory it took at peak."""
    before = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    mb.synchronize(device)
    start = time.perf_counter()
    result = run()
    mb.synchronize(device)
    return {"first_call_s": time.perf_counter() - start, "peak_gib": peak_gib(device, before), **result}


def train_runners(models: ShapeModels, precision: str) -> tuple[dict, dict]:
    """(first calls, timed steps) per implementation: forward + backward (+ fused AdamW for timed steps)."""
    shape, device = models.shape, models.device
    models.to(torch.float32 if precision == "autocast" else torch.bfloat16)
    ids = mb.random_ids(shape.train_batch, shape.seq_len, models.ours.config.vocab_size, seed=3).to(device)
    autocast = precision == "autocast"
    optimizers = {
        name: torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
        for name, model in (("ours", models.ours), ("upstream", models.upstream))
    }

    def runner(impl: str) -> tuple[Callable[[], dict], Callable[[], int]]:
        side = impl.split("_")[0]
        params_model = models.ours if side == "ours" else models.upstream

        def backward() -> torch.Tensor:
            call = models.ours if side == "ours" else models.upstream_forward(impl)
            if side == "ours":
                set_ours_path(models.ours, impl == "ours_best", compiled_layers=models.compile)
            params_model.train()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = call(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            return loss

        def probe() -> dict:
            loss = backward()
            grads = [p.grad.float().norm() for p in params_model.parameters() if p.grad is not None]
            params_model.zero_grad(set_to_none=True)
            return {"loss": float(loss), "grad_norm": float(torch.stack(grads).norm())}

        def step() -> int:
            backward()
            optimizers[side].step()
            optimizers[side].zero_grad(set_to_none=True)
            return ids.numel()

        return probe, step

    runners = {impl: runner(impl) for impl in IMPLS}
    return {impl: r[0] for impl, r in runners.items()}, {impl: r[1] for impl, r in runners.items()}


def prefill_runners(models: ShapeModels) -> tuple[dict, dict]:
    """(first calls, timed calls): each first call also keeps its last positions' logits, to compare the four."""
    shape, device = models.shape, models.device
    models.to(torch.bfloat16)
    ids = mb.random_ids(shape.prefill_batch, shape.seq_len, models.ours.config.vocab_size, seed=4).to(device)

    def runner(impl: str) -> Callable[[], torch.Tensor]:
        def prefill() -> torch.Tensor:
            if impl.startswith("ours"):
                set_ours_path(models.ours, impl == "ours_best", compiled_layers=models.compile)
                models.ours.eval()
                with torch.no_grad():
                    return models.ours(input_ids=ids, use_cache=True).logits
            models.upstream.eval()
            with torch.no_grad():
                return models.upstream_forward(impl)(input_ids=ids, use_cache=True).logits

        return prefill

    def probe(prefill: Callable[[], torch.Tensor]) -> Callable[[], dict]:
        return lambda: {"logits": prefill()[:, -LOGITS_KEPT:].float()}

    def step(prefill: Callable[[], torch.Tensor]) -> Callable[[], int]:
        def timed() -> int:
            prefill()
            return ids.numel()

        return timed

    calls = {impl: runner(impl) for impl in IMPLS}
    return {impl: probe(call) for impl, call in calls.items()}, {impl: step(call) for impl, call in calls.items()}


def decode_runners(models: ShapeModels, batch: int) -> tuple[dict, dict]:
    shape, device = models.shape, models.device
    models.to(torch.bfloat16)
    prompt = mb.random_ids(batch, shape.prompt_len, models.ours.config.vocab_size, seed=5).to(device)

    def runner(impl: str) -> Callable[[], int]:
        def decode() -> int:
            if impl.startswith("ours"):
                # Best path: the experts without host syncs; decoding steps are not compiled on this path.
                set_ours_path(models.ours, impl == "ours_best", compiled_layers=False)
                models.ours.eval()
                return mb.greedy_generate(models.ours, prompt, shape.new_tokens).numel()
            models.upstream.eval()
            return mb.greedy_generate(models.upstream, prompt, shape.new_tokens).numel()

        return decode

    steps = {impl: runner(impl) for impl in IMPLS if impl != "upstream_compiled"}
    return {impl: _no_details(step) for impl, step in steps.items()}, steps


def _no_details(step: Callable[[], int]) -> Callable[[], dict]:
    def run() -> dict:
        step()
        return {}

    return run


def measure_row(models: ShapeModels, phase: str, precision: str, sizes: Sizes, peak_tflops: float) -> dict:
    shape, device = models.shape, models.device
    if phase == "train":
        probes, steps = train_runners(models, precision)
        tokens, passes = shape.train_batch * shape.seq_len, 6
    elif phase == "prefill":
        probes, steps = prefill_runners(models)
        tokens, passes = shape.prefill_batch * shape.seq_len, 2
    else:
        batch = int(phase.removeprefix("decode_b"))
        probes, steps = decode_runners(models, batch)
        tokens, passes = batch * shape.new_tokens, None
    row: dict = {"shape": shape.name, "phase": phase, "precision": precision, "tokens_per_call": tokens, "impls": {}}
    if not models.upstream_agrees:
        reason = f"upstream's fp32 logits differ from ours (relative error {models.same_logits_error:.2g})"
        for impl in ("upstream_eager", "upstream_compiled"):
            probes.pop(impl, None)
            steps.pop(impl, None)
            row["impls"][impl] = {"not_measured": reason}
    if not models.compile:
        probes.pop("upstream_compiled", None)
        steps.pop("upstream_compiled", None)
        row["impls"].setdefault("upstream_compiled", {"not_measured": NOT_COMPILING})
    if "upstream_compiled" not in steps and "upstream_compiled" not in row["impls"]:
        row["impls"]["upstream_compiled"] = {"not_measured": NO_COMPILED_GENERATION}
    logits = {}
    for impl, probe in probes.items():
        print(f"  {shape.name} {phase} {precision}: first call of {impl}", flush=True)
        try:
            row["impls"][impl] = first_call(probe, device)
        except Exception as error:  # this implementation is left out of the row; the others still run
            traceback.print_exc()
            row["impls"][impl] = {"error": f"{type(error).__name__}: {str(error)[:500]}"}
            steps.pop(impl)
            continue
        if "logits" in row["impls"][impl]:
            logits[impl] = row["impls"][impl].pop("logits")
    if logits:
        row["same_outputs"] = same_outputs(logits)
    del logits
    for impl, samples in mb.time_interleaved(steps, sizes.warmup, sizes.repeats, device).tokens_per_s.items():
        row["impls"][impl] |= {"tokens_per_s": samples, "median_tokens_per_s": statistics.median(samples)}
    if passes is not None:
        flops = mb.flops_per_token(models.ours, shape.seq_len, passes)
        row["flops_per_token"] = flops
        for result in row["impls"].values():
            if "median_tokens_per_s" in result:
                result["mfu"] = result["median_tokens_per_s"] * flops / (peak_tflops * 1e12)
    row |= summarise(row)
    return row


def same_outputs(logits: dict[str, torch.Tensor]) -> dict:
    """Relative error of each faster path's prefill logits against its own side's eager path. (Ours against upstream
    is checked in fp32 when the models are built: in bf16 their routers round differently, and a random model's
    near-tie routing choices flip.)"""
    errors = {}
    for impl, eager in (("ours_best", "ours_eager"), ("upstream_compiled", "upstream_eager")):
        if impl in logits and eager in logits:
            errors[impl] = relative_error(logits[impl], logits[eager])
    # Gated on ours only: upstream's bf16 router (softmax in bf16) flips more near ties between its two paths.
    return {"relative_errors": errors, "passed": errors.get("ours_best", 0.0) <= PREFILL_TOLERANCE}


def summarise(row: dict) -> dict:
    """eager/eager and best/best ratios of a row, and (train) whether every implementation trained the same thing."""
    speed = {impl: r["median_tokens_per_s"] for impl, r in row["impls"].items() if "median_tokens_per_s" in r}
    out: dict = {}
    if "ours_eager" in speed and "upstream_eager" in speed:
        out["eager_over_eager"] = speed["ours_eager"] / speed["upstream_eager"]
    ours = {impl: value for impl, value in speed.items() if impl.startswith("ours")}
    upstream = {impl: value for impl, value in speed.items() if impl.startswith("upstream")}
    if ours and upstream:
        ours_best, upstream_best = max(ours, key=ours.__getitem__), max(upstream, key=upstream.__getitem__)
        out["best"] = {"ours": ours_best, "upstream": upstream_best}
        out["best_over_best"] = ours[ours_best] / upstream[upstream_best]
    losses = {impl: r["loss"] for impl, r in row["impls"].items() if "loss" in r}
    if losses:
        norms = {impl: row["impls"][impl]["grad_norm"] for impl in losses}
        loss_spread = (max(losses.values()) - min(losses.values())) / abs(statistics.median(losses.values()))
        norm_spread = (max(norms.values()) - min(norms.values())) / statistics.median(norms.values())
        out["same_training"] = {
            "loss_spread": loss_spread,
            "grad_norm_spread": norm_spread,
            "passed": loss_spread <= LOSS_TOLERANCE and norm_spread <= GRAD_NORM_TOLERANCE,
        }
    return out


def planned_rows(shapes: tuple[Shape, ...]) -> list[tuple[Shape, str, str]]:
    """(shape, phase, precision) in priority order: the wide stack's train steps and prefill, model_bench's shape's,
    then decoding."""
    wide, narrow = shapes
    rows = [(wide, "train", "autocast"), (wide, "train", "bf16 weights"), (wide, "prefill", "bf16 weights")]
    rows += [(narrow, "train", "autocast"), (narrow, "prefill", "bf16 weights")]
    return rows + [
        (shape, f"decode_b{batch}", "bf16 weights") for shape in (narrow, wide) for batch in shape.decode_batches
    ]


def measure_speed(
    sizes: Sizes,
    device: torch.device,
    compile_models: bool,
    peak_tflops: float,
    report: dict,
    save: Callable[[], None],
    deadline: float,
    only: list[str] | None,
):
    models: dict[str, ShapeModels] = {}
    for shape, phase, precision in planned_rows(sizes.shapes):
        key = {"shape": shape.name, "phase": phase, "precision": precision}
        if only and not any(part in f"{shape.name}/{phase}/{precision}" for part in only):
            report["rows"].append(key | {"not_measured": "not selected in this run (--only)"})
            continue
        if time.monotonic() > deadline:
            report["rows"].append(key | {"not_measured": "the run's time budget (--budget-s) was spent"})
            continue
        print(f"{shape.name} {phase} ({precision}) ...", flush=True)
        try:
            if shape.name not in models:
                models[shape.name] = ShapeModels(shape, device, compile_models)
                report["upstream_logits_error"][shape.name] = models[shape.name].same_logits_error
            row = measure_row(models[shape.name], phase, precision, sizes, peak_tflops)
        except Exception as error:  # a row that breaks records why; the others still run
            traceback.print_exc()
            row = key | {"error": f"{type(error).__name__}: {str(error)[:500]}"}
        finally:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        report["rows"].append(row)
        save()


# --------------------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------------------


def device_info(device: torch.device) -> dict:
    info = {
        **environment.machine_summary(),
        "device": device.type,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info |= {
            "name": properties.name,
            "memory_gib": properties.total_memory / 2**30,
            "multiprocessors": properties.multi_processor_count,
            "backend": f"ROCm {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}",
        }
    else:
        info["name"] = platform.processor() or platform.machine()
    return info


def targets(report: dict) -> dict:
    for row in report["rows"]:
        if row["phase"] == "train" and row["precision"] == "autocast" and row["shape"] == report["wide_shape"]:
            value = row.get("best_over_best")
            return {
                "wide_train_best_over_best": {
                    "value": value,
                    "min": TARGET_WIDE_TRAIN,
                    "met": value is not None and value >= TARGET_WIDE_TRAIN,
                }
            }
    return {}


def table(report: dict) -> str:
    lines = [
        f"{report['machine']['name']} ({report['machine']['device']}), torch {report['machine']['torch']}, "
        f"transformers {report['machine']['transformers']}; bf16 matmul {report['matmul_tflops']:.0f} TFLOP/s "
        f"({report['sizes']['matmul_size']}^3)",
        checks_line(report["checks"]),
    ]
    lines += [
        "",
        "| shape | phase | precision | ours eager | ours best | upstream eager | upstream compiled | eager/eager "
        "| best/best | ours best MFU | upstream best MFU |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        head = f"| {row['shape']} | {row['phase']} | {row['precision']} |"
        if "impls" not in row:
            lines.append(f"{head} {row.get('not_measured') or row.get('error')} |||||||")
            continue
        cells = []
        for impl in IMPLS:
            result = row["impls"].get(impl, {})
            if "median_tokens_per_s" in result:
                cells.append(fmt(result["median_tokens_per_s"]))
            else:
                cells.append("error" if "error" in result else "n/a: " + str(result.get("not_measured", "-")))
        best = row.get("best", {})
        mfu = [row["impls"].get(best.get(side), {}).get("mfu") for side in ("ours", "upstream")]
        lines.append(
            f"{head} {' | '.join(cells)} | {fmt(row.get('eager_over_eager'), '.2f')} | "
            f"{fmt(row.get('best_over_best'), '.2f')} | {fmt(mfu[0], '.1%')} | {fmt(mfu[1], '.1%')} |"
        )
    lines.append("\n(tokens/s; decode rows: generated tokens/s; best = each side's faster path)")
    for row in report["rows"]:
        if "same_training" in row:
            same = row["same_training"]
            lines.append(
                f"- {row['shape']} train ({row['precision']}): first loss spread {same['loss_spread']:.1e}, gradient "
                f"norm spread {same['grad_norm_spread']:.1e} across implementations: "
                + ("same training" if same["passed"] else "DIFFERENT")
            )
        if "same_outputs" in row:
            errors = row["same_outputs"]["relative_errors"]
            lines.append(
                f"- {row['shape']} prefill: logits relative error against the same side's eager path: "
                + ", ".join(f"{impl} {error:.1e}" for impl, error in errors.items())
                + (" (same outputs)" if row["same_outputs"]["passed"] else " DIFFERENT")
            )
        for impl, result in row.get("impls", {}).items():
            if "error" in result:
                lines.append(f"- {row['shape']} {row['phase']} {impl}: {result['error']}")
    for name, target in report["targets"].items():
        verdict = "not measured" if target["value"] is None else "met" if target["met"] else "NOT met"
        lines.append(f"- target {name}: {fmt(target['value'], '.2f')} (>= {target['min']}) {verdict}")
    return "\n".join(lines)


def checks_line(checks: dict) -> str:
    """The checks against the CPU reference, in one line."""
    if "error" in checks:
        return f"checks against the CPU reference: ERROR {checks['error']}"
    greedy = checks["bf16_greedy"]
    return (
        "checks against the CPU reference: fp32 logits relative error "
        + ", ".join(
            f"{path} {fmt(r['relative_error'], '.1e')} ({r['compared_positions']}/{r['positions']} positions, "
            f"{r['routing_flips']} near-tie routing flips)"
            for path, r in checks["fp32_logits"].items()
        )
        + f" (<= {FP32_TOLERANCE}); bf16 greedy: {greedy['consistent_tokens']}/{greedy['tokens']} tokens "
        f"consistent, {greedy['agree_with_reference_greedy']:.0%} equal to the fp32 reference's, logits relative "
        f"error {greedy['logits_relative_error']:.1e} (<= {BF16_TOLERANCE}): "
        + ("passed" if checks["passed"] else "FAILED")
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 2 repeats: a smoke test (runs on CPU)")
    parser.add_argument("--device", default=None, help="cuda (ROCm too) or cpu (default: cuda if available)")
    parser.add_argument("--budget-s", type=float, default=None, help="stop starting new rows after this many seconds")
    parser.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="torch.compile ours' layers and upstream (auto: on a GPU only; compiling on 2 CPU cores takes minutes)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="PART",
        help="measure only the rows whose 'shape/phase/precision' contains one of these (e.g. decode, wide/train)",
    )
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: every core)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON report path (default {DEFAULT_OUT})")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    environment.use_threads(args.threads or os.cpu_count() or 1)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 stays fp32 (the fp32 check; upstream's fp32 experts)
    torch.backends.cudnn.allow_tf32 = False
    mb.init_amx()
    mb.quiet_transformers()
    sizes = QUICK if args.quick else FULL
    compile_models = args.compile == "on" or (args.compile == "auto" and device.type != "cpu")
    report: dict = {
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m benchmarks.gpu_check", *(argv if argv is not None else sys.argv[1:])]),
        "mode": "quick" if args.quick else "full",
        "machine": device_info(device),
        "sizes": asdict(sizes),
        "wide_shape": sizes.shapes[0].name,
        "compiled": compile_models,
        "upstream_logits_error": {},
        "rows": [],
    }

    def save() -> None:
        environment.write_report(args.out, report)

    report["matmul_tflops"] = matmul_tflops(device, sizes.matmul_size)
    print("checks against the CPU reference ...", flush=True)
    try:
        report["checks"] = check_against_cpu(sizes, device)
    except Exception as error:
        traceback.print_exc()
        report["checks"] = {"error": f"{type(error).__name__}: {str(error)[:500]}", "passed": False}
    save()
    deadline = started + args.budget_s if args.budget_s else float("inf")
    measure_speed(sizes, device, compile_models, report["matmul_tflops"], report, save, deadline, args.only)
    report["targets"] = targets(report)
    report["seconds"] = time.monotonic() - started
    save()
    print(table(report))
    print(f"wrote {args.out}")
    return 0 if passed(report) else 1


def passed(report: dict) -> bool:
    """Every check passed and nothing raised (rows not measured, with their reason, do not fail a run)."""
    for row in report["rows"]:
        if "error" in row or any("error" in result for result in row.get("impls", {}).values()):
            return False
        if not all(row[check]["passed"] for check in ("same_training", "same_outputs") if check in row):
            return False
    return report["checks"]["passed"]


if __name__ == "__main__":
    sys.exit(main())
