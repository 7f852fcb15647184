"""Pretraining speed on CPU: our training loop against transformers' `Trainer` and upstream `zaya`, MFU, checkpoints.

Run: `python -m benchmarks.pretrain_bench [--quick] [--threads N] [--clock wall|cpu] [--shapes NAME ...]
[--impls NAME ...] [--out benchmarks/results/pretrain_bench.json]`

For each model shape (full: the `tiny` and `cpu` presets (`cpu` is the CPU fine-tuning recipe's base) and a 512-wide
ZAYA1-ratio model; quick: a micro model) and dtype
(fp32, and bf16 autocast where the CPU has native bf16):
- **our loop** (`Pretrainer.train()`: forward, backward, clipping, AdamW, balancing update; each step also pays for
  streaming tokenization and packing of its rows), as `zaya pretrain` runs by default (`ours`) and with `--compile`
  (`ours_compiled`: compiled layers, compiled in the warm-up step);
- **Trainer**: the same model, initial weights, packed rows, batch, optimizer settings and schedule under
  `transformers.Trainer` (rows pre-packed in memory and taken in our loop's order, so each timed step trains the
  same batch in both loops; no balancing update);
- **upstream**: the same `Trainer` run with upstream `transformers.ZayaForCausalLM` (`grouped_mm` experts, sdpa;
  loaded as `benchmarks.model_bench` loads it) from a checkpoint of the same initial weights, on the same rows (the run
  aborts if its logits differ from ours), eager (`upstream`) and compiled as transformers compiles a model for
  training (`upstream_compiled`: `TrainingArguments(torch_compile=True)`; full runs only: compiling upstream on 2
  cores takes minutes);
- **one clock for every loop**: the benchmark reads its clock at each loop's end-of-step hook (our loop's
  `TrainingHooks.on_metrics`, `Trainer`'s `on_step_end` callback), so each interval holds everything the loop does
  for one step; the first two steps (compiling, warm-up) are not counted. The clock is the wall clock
  (`time.perf_counter()`), or with `--clock cpu` the process's CPU time (`time.process_time()`): on a machine
  shared with other jobs the wall clock measures the others' load, while with `--threads 1` a step's CPU seconds are
  what it takes on an idle core (tokens/s then mean tokens per CPU-second; the 2-process runs, whose work is split
  over processes, are left out, and the matmul peak is timed on the same clock);
- **ratios, eager and best**: `ours_over_upstream` (eager against eager: our loop against upstream under `Trainer`),
  `best_over_best` (each side's faster path: ours or ours compiled, against upstream or upstream compiled; issue 36's
  target: >= 1), `trainer_ours_over_upstream` (both models under `Trainer`, eager: the model alone); the
  implementations alternate (in order, then in reverse, ...) so that load from other processes hits them alike;
- **our loop on 2 processes** (fp32, forked gloo ranks with half the batch and half the threads each, so the same
  global batch and cores): replicated (`--sharding none`) and FSDP2 (`--sharding fsdp`);
- **GFLOP/s and MFU**: analytic FLOPs per token (`6 * active params + 6 * layers * query width * seq`, see
  `benchmarks.model_bench.flops_per_token`) times tokens/s, against a plain matmul's GFLOP/s in the same dtype on
  this machine (issue 3's target: our loop >= 50%);
- **checkpoint stall** (fp32): how long training paused per checkpoint (the CPU copy; the write runs in the
  background) next to what a synchronous `save_pretrained` of the same model takes in the training thread, for the
  replicated format and for the sharded (DCP) format of `--sharding fsdp` (1 process).
`--impls` times only the implementations named (e.g. `--impls ours trainer`); a ratio or target that needs one
left out is reported as absent (null), and the 2-process runs and the checkpoint stall (our loop's) run only with
`ours`.
The benchmark's processes are prepared as `zaya pretrain`'s is (`zaya_model.training.runtime`: freed memory kept for
reuse, subnormal floats flushed to zero).
Absolute numbers depend on the machine and its load: compare within one run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import environment
from benchmarks.environment import fmt

DEFAULT_OUT = environment.default_out("pretrain_bench")
# Our loop (eager, and with compiled layers); our model under Trainer; upstream's model under Trainer (eager, and
# compiled by Trainer in full runs).
IMPLS = ("ours", "ours_compiled", "trainer", "upstream", "upstream_compiled")
QUICK_IMPLS = IMPLS[:-1]
TARGET_OURS_OVER_UPSTREAM = 2.0  # issue 3, fp32 tokens/s, eager against eager
TARGET_BEST_OVER_BEST = 1.0  # issue 36: not below upstream's best path, each dtype
TARGET_MFU = 0.5  # issue 3, of the plain matmul's GFLOP/s in the same dtype
UNTIMED_STEPS = 2  # the first steps compile and warm up
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]  # set from --clock


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="micro model, 3 timed steps: a smoke run")
    parser.add_argument("--threads", type=int, default=environment.DEFAULT_THREADS, help="torch threads (default 2)")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="time steps by the wall clock or by the process's CPU time (a shared machine; use with --threads 1)",
    )
    parser.add_argument("--shapes", nargs="+", metavar="NAME", help="only these shapes (default: all of the mode's)")
    parser.add_argument(
        "--impls",
        nargs="+",
        choices=IMPLS,
        metavar="NAME",
        help=f"only these implementations, of {', '.join(IMPLS)} (default: all of the mode's; --quick leaves out "
        "upstream_compiled)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="alternating rounds per shape and dtype, each running every implementation once (default 2, 1 with "
        "--quick; more rounds narrow the medians on a noisy machine)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON report path")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def shapes(quick: bool) -> list[dict]:
    from benchmarks.model_bench import FULL
    from zaya_model.pretrain.presets import MICRO_MODEL, PRESETS

    if quick:
        return [dict(name="micro", model=MICRO_MODEL, seq_len=32, batch_size=4, vocab=320, steps=3, rounds=1)]
    # model_bench's 512-wide model (ZAYA1's ratios), with the vocabulary of the tokenizer trained here.
    wide = {key: value for key, value in FULL.model.items() if key != "vocab_size"} | {"max_position_embeddings": 1024}
    recipe = PRESETS["cpu"]
    return [
        dict(name="tiny", model=PRESETS["tiny"].model, seq_len=128, batch_size=4, vocab=1024, steps=8, rounds=2),
        dict(
            name="cpu",
            model=recipe.model,
            seq_len=recipe.seq_len,
            batch_size=recipe.batch_size,
            vocab=recipe.tokenizer_vocab_size,
            steps=4,
            rounds=2,
        ),
        dict(name="wide-512", model=wide, seq_len=512, batch_size=4, vocab=1024, steps=3, rounds=2),
    ]


def selected_shapes(args: argparse.Namespace) -> list[dict]:
    available = shapes(args.quick)
    if not args.shapes:
        return available
    unknown = set(args.shapes) - {shape["name"] for shape in available}
    if unknown:
        raise SystemExit(f"--shapes: unknown {sorted(unknown)}; choose from {[s['name'] for s in available]}")
    return [shape for shape in available if shape["name"] in args.shapes]


def selected_impls(args: argparse.Namespace) -> tuple[str, ...]:
    """The implementations to time, in `IMPLS` order: `--impls`, else the mode's."""
    if args.impls:
        return tuple(impl for impl in IMPLS if impl in args.impls)
    return QUICK_IMPLS if args.quick else IMPLS


def not_measured(args: argparse.Namespace, impls: tuple[str, ...]) -> dict[str, str]:
    """Why each implementation left out of `impls` was not timed."""
    if not args.impls and args.quick:
        return {"upstream_compiled": "--quick: compiling upstream on CPU takes minutes"}
    return {impl: "not in --impls" for impl in IMPLS if impl not in impls}


def bf16_available() -> str | None:
    """None when bf16 autocast is native here, else why not: `zaya pretrain --dtype bf16`'s own check (which also
    asks Linux for AMX permission, without which bf16 matmuls can hang or die with SIGILL on AMX CPUs)."""
    import torch

    from zaya_model.pretrain.train import PretrainError, autocast_dtype

    try:
        autocast_dtype("bf16", torch.device("cpu"))
    except PretrainError:
        return "no native bf16 (AVX512-BF16 or AMX) on this CPU"
    return None


def step_speeds(ends: list[float], tokens_per_step: int) -> list[float]:
    """tokens/s of each step from the clock readings at consecutive step ends, the untimed first steps left out."""
    timed = ends[UNTIMED_STEPS - 1 :]
    return [tokens_per_step / (b - a) for a, b in zip(timed, timed[1:], strict=False)]


def step_clock_hooks(ends: list[float]):
    """Our loop's hooks, reading the benchmark's clock at the end of every step."""
    from zaya_model.training.callbacks import TrainingHooks

    class StepClock(TrainingHooks):
        def on_metrics(self, step: int, metrics: dict) -> None:
            ends.append(clock())

    return StepClock()


def measure_our_loop(corpus, tokenizer, directory: Path, settings) -> list[float]:
    """tokens/s of every step after the untimed ones. The first step runs in a call of its own, which returns once
    its checkpoints (steps 0 and 1) are on disk: no timed step overlaps a background checkpoint write."""
    from zaya_model.pretrain.train import Pretrainer

    ends: list[float] = []
    trainer = Pretrainer(corpus, directory, settings, tokenizer_path=tokenizer, hooks=step_clock_hooks(ends))
    trainer.train(until_step=1)
    trainer.train()
    return step_speeds(ends, settings.batch_size * settings.seq_len)


def _train_rank(rank, threads, init_file, corpus, tokenizer, directory, settings, clock_file) -> None:
    import torch
    import torch.distributed as dist

    from zaya_model.pretrain.train import Pretrainer
    from zaya_model.training.distributed import DistributedContext

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    ends: list[float] = []
    try:
        context = DistributedContext(rank, 2)
        hooks = step_clock_hooks(ends)
        trainer = Pretrainer(corpus, directory, settings, tokenizer_path=tokenizer, distributed=context, hooks=hooks)
        trainer.train(until_step=1)  # warm-up, as in measure_our_loop
        trainer.train()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        clock_file.write_text(json.dumps(ends))


def measure_two_processes(corpus, tokenizer, directory: Path, settings, threads: int) -> list[float]:
    """Global tokens/s of our loop on 2 gloo processes, each with half the batch and half the threads."""
    import multiprocessing

    directory.mkdir(parents=True)
    half = settings.replace(batch_size=settings.batch_size // 2)
    clock_file = directory / "step_ends.json"
    args = (max(1, threads // 2), directory / "init", corpus, tokenizer, directory / "run", half, clock_file)
    ranks = [multiprocessing.get_context("fork").Process(target=_train_rank, args=(rank, *args)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    if any(process.exitcode != 0 for process in ranks):
        raise RuntimeError(f"a training process failed: exit codes {[process.exitcode for process in ranks]}")
    return step_speeds(json.loads(clock_file.read_text()), settings.batch_size * settings.seq_len)


def upstream_copy(model, directory: Path, seq_len: int):
    """Upstream `transformers.ZayaForCausalLM` with `model`'s weights, loaded as `benchmarks.model_bench` loads it."""
    import dataclasses

    from benchmarks.model_bench import FULL, check_same_logits, load_model

    model.save_pretrained(directory)
    upstream = load_model("upstream", str(directory), "zaya_model")
    check_same_logits(model.eval(), upstream, dataclasses.replace(FULL, seq_len=seq_len))  # aborts if they differ
    model.train()
    return upstream


def measure_trainer(
    corpus, tokenizer, directory: Path, settings, upstream: bool = False, compiled: bool = False
) -> list[float]:
    """tokens/s of every step after the untimed ones under transformers' Trainer, on the rows our stream packs, with
    our model or (`upstream`) upstream's with the same initial weights; `compiled`: Trainer compiles the model."""
    from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

    from zaya_model.pretrain.train import Pretrainer

    source = Pretrainer(corpus, directory / "source", settings, tokenizer_path=tokenizer)  # model + stream only
    model = upstream_copy(source.model, directory / "initial", settings.seq_len) if upstream else source.model
    rows = []
    for _ in range(settings.max_steps):
        batch = source.stream.next_batch(settings.batch_size)
        rows += [{key: value[i] for key, value in batch.items()} for i in range(settings.batch_size)]
    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(clock())

    arguments = TrainingArguments(
        output_dir=str(directory / "trainer"),
        per_device_train_batch_size=settings.batch_size,
        max_steps=settings.max_steps,
        learning_rate=settings.lr,
        warmup_steps=settings.warmup_steps,
        lr_scheduler_type="cosine",
        weight_decay=settings.weight_decay,
        adam_beta2=0.95,
        max_grad_norm=settings.max_grad_norm,
        bf16=settings.dtype == "bf16",
        use_cpu=True,
        save_strategy="no",
        eval_strategy="no",
        logging_steps=settings.max_steps,
        report_to=[],
        torch_compile=compiled,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=settings.seed,
        train_sampling_strategy="sequential",  # our loop's batches in its order: the timed steps do the same work
    )
    trainer = Trainer(
        model=model,
        args=arguments,
        train_dataset=rows,
        data_collator=default_data_collator,
        callbacks=[StepClock()],
    )
    trainer.train()
    return step_speeds(ends, settings.batch_size * settings.seq_len)


def sync_save_seconds(model, directory: Path) -> float:
    started = time.perf_counter()
    model.save_pretrained(directory)
    return time.perf_counter() - started


def checkpoint_stall(corpus, tokenizer, directory: Path, settings) -> dict:
    """Per-checkpoint training stall (async) and a synchronous save_pretrained, for both checkpoint formats."""
    from zaya_model.pretrain.train import Pretrainer

    result = {}
    for sharding in ("none", "fsdp"):
        # A save every other step: with short steps the next save may wait for the previous write (wait_s).
        run = settings.replace(sharding=sharding, max_steps=4, save_every=2, eval_every=1000)
        trainer = Pretrainer(corpus, directory / sharding, run, tokenizer_path=tokenizer)
        trainer.train()
        timings = trainer.checkpoint_timings
        result["replicated" if sharding == "none" else "sharded_dcp"] = {
            "checkpoints": len(timings),
            "stall_s": statistics.median(t["stall_s"] for t in timings),
            "waiting_for_previous_write_s": statistics.median(t["wait_s"] for t in timings),
            "background_write_s": statistics.median(t["write_s"] for t in timings),
            "sync_save_pretrained_s": sync_save_seconds(trainer.model, directory / f"sync-{sharding}"),
        }
    return result


def make_corpus(directory: Path, cases: int) -> Path:
    from finetune.datasets.synthetic import generate_cases, render_case_file

    path = directory / "corpus.jsonl"
    texts = [render_case_file(case) for case in generate_cases(cases, seed=7)]
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path


def make_tokenizer(corpus: Path, directory: Path, vocab: int) -> Path:
    from zaya_model.pretrain.tokenizer import train_tokenizer

    texts = (json.loads(line)["text"] for line in corpus.read_text().splitlines())
    train_tokenizer(texts, vocab_size=vocab).save_pretrained(directory)
    return directory


def run(args: argparse.Namespace) -> dict:
    import torch
    import transformers

    from benchmarks.model_bench import matmul_gflops
    from zaya_model.pretrain.presets import PretrainSettings

    global clock
    clock = CLOCKS[args.clock]
    environment.use_threads(args.threads)
    bf16_reason = bf16_available()
    dtypes = ["fp32"] if bf16_reason else ["fp32", "bf16"]
    matmul_size = 512 if args.quick else 2048
    peaks = {
        dtype: statistics.median(
            matmul_gflops(matmul_size, 3 if args.quick else 5, bf16_autocast=dtype == "bf16", clock=clock)
        )
        for dtype in dtypes
    }
    report: dict = {
        "mode": "quick" if args.quick else "full",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            **environment.machine_summary(),
            "processor": platform.processor() or platform.machine(),
            "threads": args.threads,
            "clock": args.clock,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "matmul": {"size": matmul_size, "gflops": peaks},
        "bf16_skipped": bf16_reason,
        "results": [],
    }
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        corpus = make_corpus(scratch, 150 if args.quick else 600)
        for shape in selected_shapes(args):
            tokenizer = make_tokenizer(corpus, scratch / f"tokenizer-{shape['name']}", shape["vocab"])
            base = PretrainSettings(
                model=shape["model"],
                tokenizer_vocab_size=shape["vocab"],
                seq_len=shape["seq_len"],
                batch_size=shape["batch_size"],
                max_steps=shape["steps"] + UNTIMED_STEPS,
                warmup_steps=1,
                eval_every=1000,
                save_every=1000,
                eval_rows=4,
                shuffle_buffer=16,
                step_timeout_s=0,
            )
            for dtype in dtypes:
                settings = base.replace(dtype=dtype)
                entry = measure_shape(args, shape, settings, corpus, tokenizer, scratch, peaks[dtype])
                report["results"].append(entry)
    return report


def measure_shape(
    args: argparse.Namespace, shape: dict, settings, corpus: Path, tokenizer: Path, scratch: Path, peak: float
) -> dict:
    """One shape at one dtype (`settings`): every implementation's tokens/s in alternating rounds, the ratios,
    GFLOP/s and MFU against `peak` (the matmul's GFLOP/s in that dtype), the targets, the 2-process runs and (fp32)
    the checkpoint stall."""
    from transformers import PreTrainedTokenizerFast

    from benchmarks.model_bench import flops_per_token
    from zaya_model import ZayaForCausalLM

    dtype = settings.dtype
    impls = selected_impls(args)
    speeds: dict[str, list[float]] = {impl: [] for impl in impls}
    rounds = args.rounds or shape["rounds"]
    for round_ in range(rounds):  # alternate the order: forward, then reversed
        for impl in impls if round_ % 2 == 0 else impls[::-1]:
            directory = scratch / f"{shape['name']}-{dtype}-{impl}-{round_}"
            if impl.startswith("ours"):
                speeds[impl] += measure_our_loop(
                    corpus, tokenizer, directory, settings.replace(compile=impl == "ours_compiled")
                )
            else:
                speeds[impl] += measure_trainer(
                    corpus,
                    tokenizer,
                    directory,
                    settings,
                    upstream=impl.startswith("upstream"),
                    compiled=impl == "upstream_compiled",
                )
    model = ZayaForCausalLM(settings.zaya_config(PreTrainedTokenizerFast.from_pretrained(tokenizer)))
    flops = flops_per_token(model, settings.seq_len)
    entry: dict = {
        "shape": shape["name"],
        "dtype": dtype,
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokens_per_step": settings.batch_size * settings.seq_len,
        "rounds": rounds,
        "flops_per_token": flops,
        "tokens_per_s": speeds,
        "median_tokens_per_s": {impl: statistics.median(values) for impl, values in speeds.items()},
    }
    if skipped := not_measured(args, impls):
        entry["not_measured"] = skipped
    entry |= ratios(entry["median_tokens_per_s"])
    if dtype == "fp32" and args.clock == "wall" and "ours" in impls:  # same global batch on 2 gloo processes
        for sharding in ("none", "fsdp"):
            directory = scratch / f"{shape['name']}-2proc-{sharding}"
            two_processes = measure_two_processes(
                corpus, tokenizer, directory, settings.replace(sharding=sharding), args.threads
            )
            entry["tokens_per_s"][f"ours_2proc_{sharding}"] = two_processes
            entry["median_tokens_per_s"][f"ours_2proc_{sharding}"] = statistics.median(two_processes)
    entry["gflops"] = {impl: speed * flops / 1e9 for impl, speed in entry["median_tokens_per_s"].items()}
    entry["mfu_vs_matmul"] = {impl: value / peak for impl, value in entry["gflops"].items()}
    entry["targets"] = targets(entry)
    if dtype == "fp32" and "ours" in impls:
        entry["checkpoint"] = checkpoint_stall(corpus, tokenizer, scratch / f"ckpt-{shape['name']}", settings)
    return entry


def ratios(median: dict[str, float]) -> dict:
    """Eager against eager, best against best (each side's faster path of those timed, and which it was), and the
    model alone; a ratio is None (absent) when an implementation it needs was not timed."""

    def ratio(numerator: str | None, denominator: str | None) -> float | None:
        if numerator not in median or denominator not in median:
            return None
        return median[numerator] / median[denominator]

    def best(candidates: tuple[str, str]) -> str | None:
        return max((impl for impl in candidates if impl in median), key=median.__getitem__, default=None)

    ours_best, upstream_best = best(("ours", "ours_compiled")), best(("upstream", "upstream_compiled"))
    return {
        "ours_over_upstream": ratio("ours", "upstream"),
        "best": {"ours": ours_best, "upstream": upstream_best},
        "best_over_best": ratio(ours_best, upstream_best),
        "ours_over_trainer": ratio("ours", "trainer"),
        "trainer_ours_over_upstream": ratio("trainer", "upstream"),
    }


def targets(entry: dict) -> dict:
    """Issue 3's and issue 36's targets for one (shape, dtype) result: value, bound and whether it is met (value and
    met None when an implementation the target needs was not timed)."""
    checks = {"best_over_best": (entry["best_over_best"], TARGET_BEST_OVER_BEST)}
    for impl in ("ours", "ours_compiled"):
        checks[f"mfu_vs_matmul_{impl}"] = (entry["mfu_vs_matmul"].get(impl), TARGET_MFU)
    if entry["dtype"] == "fp32":
        checks["ours_over_upstream"] = (entry["ours_over_upstream"], TARGET_OURS_OVER_UPSTREAM)
    return {
        name: {"value": value, "min": bound, "met": None if value is None else value >= bound}
        for name, (value, bound) in checks.items()
    }


def table(report: dict) -> str:
    lines = [
        f"clock: {report['machine']['clock']} ({report['machine']['threads']} threads); "
        f"matmul peak ({report['matmul']['size']}^2): "
        + ", ".join(f"{dtype} {value:.0f} GFLOP/s" for dtype, value in report["matmul"]["gflops"].items()),
        "",
        "| shape | dtype | ours tok/s | ours compiled tok/s | Trainer tok/s | upstream tok/s | upstream compiled tok/s "
        "| ours/upstream (eager) | best/best | Trainer ours/upstream | ours/Trainer | ours GFLOP/s | ours MFU "
        "| ours compiled MFU | Trainer MFU | upstream MFU | upstream compiled MFU | ours 2 proc tok/s "
        "| ours 2 proc FSDP tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in report["results"]:
        speed, mfu, best = entry["median_tokens_per_s"], entry["mfu_vs_matmul"], entry["best"]
        best_pair = f" ({best['ours']} / {best['upstream']})" if entry["best_over_best"] is not None else ""
        cells = [
            *(fmt(speed.get(impl), ".0f") for impl in IMPLS),
            fmt(entry["ours_over_upstream"], ".2f"),
            fmt(entry["best_over_best"], ".2f") + best_pair,
            fmt(entry["trainer_ours_over_upstream"], ".2f"),
            fmt(entry["ours_over_trainer"], ".2f"),
            fmt(entry["gflops"].get("ours"), ".1f"),
            *(fmt(mfu.get(impl), ".1%") for impl in IMPLS),
            fmt(speed.get("ours_2proc_none"), ".0f"),
            fmt(speed.get("ours_2proc_fsdp"), ".0f"),
        ]
        lines.append(f"| {entry['shape']} | {entry['dtype']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Targets: best/best >= 1 each dtype (issue 36); ours/upstream eager >= 2x in fp32 (issue 3); ours "
        "MFU >= 50% of the matmul, each dtype, eager and compiled (issue 3)",
    ]
    for entry in report["results"]:
        for name, target in entry["targets"].items():
            verdict = {None: "absent", True: "met", False: "NOT met"}[target["met"]]
            lines.append(
                f"- {entry['shape']} {entry['dtype']} {name}: {fmt(target['value'], '.2f')} (>= {target['min']}) "
                + verdict
            )
        for impl, reason in entry.get("not_measured", {}).items():
            lines.append(f"- {entry['shape']} {entry['dtype']} {impl} not measured: {reason}")
    lines += [
        "",
        "| shape | checkpoint format | training stall s | of which waiting for previous write | background write s "
        "| sync save_pretrained s |",
        "|---|---|---|---|---|---|",
    ]
    for entry in report["results"]:
        for name, timing in entry.get("checkpoint", {}).items():
            lines.append(
                f"| {entry['shape']} | {name} | {timing['stall_s']:.4f} | {timing['waiting_for_previous_write_s']:.4f} "
                f"| {timing['background_write_s']:.4f} | {timing['sync_save_pretrained_s']:.4f} |"
            )
    if report["bf16_skipped"]:
        lines.append(f"\nbf16 not measured: {report['bf16_skipped']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from zaya_model.training.runtime import prepare_training_process

    args = parse_args(argv)
    process = prepare_training_process()  # first, so torch's threads take it; inherited by the forked ranks
    report = run(args)
    report["process"] = process
    environment.write_report(args.out, report)
    print(table(report))
    print(f"\nreport: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
