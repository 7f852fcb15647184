"""The `local` engine: `zaya_model` on CPU with batched decoding, for development, tests and the embedded default.

One scheduler per loaded model version decodes every running sequence of that version in one forward pass per step
(continuous batching): between steps it admits waiting requests by prefilling them together, left-padded, and
merging their caches into the running batch (keys/values left-padded to a common length, CCA state stacked).
Finished and cancelled sequences leave the batch at once. Positions come from each row's attention mask, so padding
never changes a sequence's result. One compute thread steps every scheduler in turn, and weights load on a thread
that ends with the load (`server.engines.threads` says why).

Decode steps run as compiled graphs (`zaya_model.cpu.decode`: several times faster per token on CPU than eager
steps) once they are compiled: after a model loads, a background thread compiles one graph per batch-size bucket
(powers of two up to `max_batch_size`; a batch runs at the smallest compiled bucket that holds it, with padding rows),
and until a bucket is ready its batches decode eagerly, so no request waits for a compilation. `health()` reports
"warming" until every bucket is compiled. Without a working C++ compiler the engine logs a warning and stays eager;
`ZAYA_LOCAL_ENGINE_COMPILE=false` turns compilation off. Prefill stays eager.

Adapters: an adapter version is merged into its own copy of the base weights when it is loaded
(`zaya_model.training.adapter_merge`) and served as a separate model; requests on the same adapter batch together.
Merging keeps the decode path identical for base and adapter requests and supports LoRA on attention and experts
alike, at the cost of one copy of the weights per loaded adapter (fine for the small models this engine is for; at most
`max_loaded_models` versions stay in memory, least recently used idle ones are unloaded first).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerBase

from server.engines.base import (
    ChoiceDelta,
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
)
from server.engines.grammar import GrammarCompiler, GrammarError, GrammarMatcher, OutputGrammar
from server.engines.output import ChoiceOutput
from server.engines.sampling import TokenSampler, choice_generator
from server.engines.threads import on_own_thread
from server.settings import LocalEngineSettings
from zaya_model import ZayaForCausalLM
from zaya_model.cache_zaya import ZayaCache, ZayaCacheLayer
from zaya_model.cpu.decode import CompiledDecoder, StaticDecodeCache, capacity_for
from zaya_model.pretrain.tokenizer import decode_text

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

# A request that met its model being unloaded finds it loaded again on retry.
MODEL_UNLOADED = "The model was unloaded; retry shortly."
UNLOADED_RETRY_AFTER_S = 1
PROMPT_SCORING_CHUNK = 256  # prompt positions whose logits are computed at once for prompt logprobs


@dataclass
class _Request:
    prompt_token_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    deltas: DeltaQueue
    grammar: xgrammar.CompiledGrammar | None = None  # `params.grammar` compiled for the model's tokenizer
    cancelled: threading.Event = field(default_factory=threading.Event)

    def send(self, item: ChoiceDelta | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.deltas.put_nowait, item)


@dataclass
class _Sequence:
    """One choice of a request: one row of the batch."""

    request: _Request
    output: ChoiceOutput
    sampler: TokenSampler
    matcher: GrammarMatcher | None = None  # the choice's place in its request's grammar, if it has one
    next_token: int = -1

    @property
    def finished(self) -> bool:
        return self.output.finished


@dataclass
class SchedulerStats:
    steps: int = 0
    max_batch_size_seen: int = 0
    decoded_tokens: int = 0
    running: int = 0
    compiled_steps: int = 0  # decode steps that ran as a compiled graph


@dataclass
class _Batch:
    """The sequences a scheduler decodes together, one row each, and their cache (every layer filled)."""

    rows: list[_Sequence]
    cache: ZayaCache
    mask: torch.Tensor  # [rows, cached length]: 0 on left padding
    static: StaticDecodeCache | None = None  # the compiled steps' buffers, which `cache` views

    def compiled_step(
        self, decoder: CompiledDecoder, bucket: int, input_ids: torch.Tensor, position_ids: torch.Tensor, length: int
    ) -> torch.Tensor:
        """One decode step through `decoder`'s graph of `bucket` rows: this batch's rows, then padding rows that
        attend only to their own slot. The cache's layers view the graph's buffers, which the step writes."""
        rows = len(self.rows)
        static = self.static
        if static is None or static.batch != bucket or static.capacity <= length:
            static = self.static = StaticDecodeCache.adopt(self.cache, bucket, capacity_for(length + 1))
        padded_ids = input_ids.new_zeros(bucket, 1)
        padded_ids[:rows] = input_ids
        padded_positions = position_ids.new_zeros(bucket, 1)
        padded_positions[:rows] = position_ids
        attend = torch.zeros(bucket, static.capacity, dtype=torch.bool)
        attend[:rows, : length + 1] = self.mask.bool()
        attend[rows:, length] = True
        logits = decoder(padded_ids, padded_positions, attend, torch.tensor([length]), static)
        for layer in self.cache.layers:
            layer.length += 1
        return logits[:rows]

    def merge(self, rows: list[_Sequence], cache: ZayaCache, mask: torch.Tensor) -> None:
        """Append prefilled rows, left-padding the shorter cache to a common length."""
        self.static = None
        length = max(self.mask.shape[1], mask.shape[1])
        for running, new in zip(self.cache.layers, cache.layers, strict=True):
            keys, values, conv_state, shift_state = _filled(running)
            new_keys, new_values, new_conv_state, new_shift_state = _filled(new)
            running.keys = torch.cat(
                [_left_pad(keys[:, :, : running.length], length), _left_pad(new_keys[:, :, : new.length], length)]
            )
            running.values = torch.cat(
                [_left_pad(values[:, :, : running.length], length), _left_pad(new_values[:, :, : new.length], length)]
            )
            running.length = length
            running.conv_state = torch.cat([conv_state, new_conv_state])
            running.shift_state = torch.cat([shift_state, new_shift_state])
        self.mask = torch.cat([_left_pad(self.mask, length), _left_pad(mask, length)])
        self.rows = self.rows + rows

    def keep(self, indices: list[int]) -> None:
        """Keep only the rows at `indices` (at least one)."""
        self.static = None
        self.rows = [self.rows[i] for i in indices]
        index = torch.tensor(indices)
        for layer in self.cache.layers:
            layer.batch_select_indices(index)
        self.mask = self.mask[index]
        self._trim_padding()

    def _trim_padding(self) -> None:
        """Drop leading cache columns that are padding in every row (left behind by finished long prompts)."""
        first_real = int(self.mask.any(0).int().argmax())
        if first_real == 0:
            return
        for layer in self.cache.layers:
            keys, values, _, _ = _filled(layer)
            layer.keys = keys[:, :, first_real : layer.length].contiguous()
            layer.values = values[:, :, first_real : layer.length].contiguous()
            layer.length -= first_real
        self.mask = self.mask[:, first_real:]


def _filled(layer: ZayaCacheLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prefilled cache layer's keys, values, conv state and shift state."""
    keys, values, conv_state, shift_state = layer.keys, layer.values, layer.conv_state, layer.shift_state
    if keys is None or values is None or conv_state is None or shift_state is None:
        raise ValueError("a running batch's cache layer is not filled")
    return keys, values, conv_state, shift_state


def _left_pad(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Left-pad a mask [rows, T] or keys/values [rows, heads, T, dim] with zeros to `length` positions."""
    time_dim = 1 if tensor.dim() == 2 else 2
    missing = length - tensor.shape[time_dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[time_dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=time_dim)


class _ComputeThread:
    """The engine's one thread for forward passes: it steps every loaded model's scheduler in turn.

    One thread, not one per model: an idle thread that has run torch ops slows every op of the busy one
    (`server.engines.threads` explains), and models stepping at once would only contend for the same cores.
    """

    def __init__(self) -> None:
        self.schedulers: list[_Scheduler] = []  # replaced under `lock`, never mutated: the thread reads a snapshot
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="zaya-local-engine", daemon=True)
        self.thread.start()

    def add(self, scheduler: _Scheduler) -> None:
        with self.lock:
            self.schedulers = [*self.schedulers, scheduler]
        self.wake.set()

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=30)

    def _run(self) -> None:
        with torch.inference_mode():
            while not self.stopping:
                self.wake.clear()  # before looking for work: a submit after this point wakes the wait below
                pending = False
                for scheduler in self.schedulers:
                    if scheduler.closing:
                        with self.lock:
                            self.schedulers = [other for other in self.schedulers if other is not scheduler]
                        scheduler.retire()
                    else:
                        pending |= scheduler.step()
                if not pending:
                    self.wake.wait()


class _CompiledSteps:
    """A model's compiled decode steps, compiled on a background thread, smallest batch bucket first."""

    def __init__(self, model: ZayaForCausalLM, max_batch_size: int):
        self.decoder = CompiledDecoder(model)
        self.buckets = sorted({min(2**power, max_batch_size) for power in range(max_batch_size.bit_length() + 1)})
        self.ready: tuple[int, ...] = ()  # replaced, never mutated: the compute thread reads it without a lock
        self.error: str | None = None
        self.stopping = False
        self.thread = threading.Thread(target=self._compile, name="zaya-local-engine-compile", daemon=True)
        self.thread.start()

    @property
    def warming(self) -> bool:
        return self.thread.is_alive()

    def bucket(self, rows: int) -> int | None:
        """The smallest compiled batch size that holds `rows` rows, if any."""
        return next((bucket for bucket in self.ready if bucket >= rows), None)

    def stop(self, timeout: float) -> None:
        self.stopping = True
        self.thread.join(timeout)

    def _compile(self) -> None:
        for bucket in self.buckets:
            if self.stopping:
                return
            try:
                self.decoder.warm(bucket)
            except Exception as error:  # no C++ compiler, or anything else inductor cannot build
                self.error = f"{type(error).__name__}: {error}".splitlines()[0]
                logger.warning("compiling decode steps failed, decoding eagerly: %s", self.error)
                return
            self.ready = (*self.ready, bucket)


class _Scheduler:
    """Owns one model: admits its requests and decodes all of its running sequences together, a step at a time on
    the engine's compute thread."""

    def __init__(
        self,
        model: ZayaForCausalLM,
        tokenizer: PreTrainedTokenizerBase,
        settings: LocalEngineSettings,
        wake: threading.Event,
    ):
        self.model, self.tokenizer, self.settings, self.wake = model, tokenizer, settings, wake
        self.compiled = _CompiledSteps(model, settings.max_batch_size) if settings.compile else None
        self.end_ids = end_of_sequence_ids(tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.inbox: queue.Queue[_Request] = queue.Queue()
        self.backlog: deque[_Request] = deque()  # taken from the inbox, waiting for room in the batch
        self.waiting = 0
        self.waiting_lock = threading.Lock()
        self.closing = False
        self.closed = threading.Event()
        self.batch: _Batch | None = None  # None while no sequence runs
        self.stats = SchedulerStats()

    @property
    def rows(self) -> list[_Sequence]:
        """The running sequences."""
        return self.batch.rows if self.batch is not None else []

    # --- called from the event loop -------------------------------------------------------------------------
    def submit(self, request: _Request) -> None:
        with self.waiting_lock:
            if self.closing:
                raise EngineUnavailable(MODEL_UNLOADED, retry_after_s=UNLOADED_RETRY_AFTER_S)
            # Room now in the batch plus the queue bound; read racily from the event loop, which is close enough.
            capacity = max(self.settings.max_batch_size - len(self.rows), 0) + self.settings.max_queued_requests
            if self.waiting >= capacity:
                raise EngineOverloaded("The engine's request queue is full; retry shortly.")
            self.waiting += 1
            self.inbox.put(request)
        self.wake.set()

    @property
    def busy(self) -> bool:
        return bool(self.rows) or self.waiting > 0

    def close(self) -> None:
        """Ask the compute thread to fail this model's requests and drop it; `closed` is set when it has."""
        with self.waiting_lock:
            self.closing = True
        self.wake.set()
        if self.compiled is not None:
            self.compiled.stopping = True

    # --- on the compute thread ------------------------------------------------------------------------------
    def step(self) -> bool:
        """Admit what fits, then one decode step for every running sequence; whether work remains."""
        try:
            admitted = self._take_waiting()
            if admitted:
                self._prefill(admitted)
            self._drop_finished()
            if self.batch is not None:
                self._decode_step(self.batch)
                self._drop_finished()
        except Exception as error:  # a failed forward fails its batch, never the engine
            logger.exception("local engine step failed")
            self._fail_all(EngineFailure(f"Generation failed: {error}"))
        return bool(self.rows or self.backlog)

    def retire(self) -> None:
        self._fail_all(EngineUnavailable(MODEL_UNLOADED, retry_after_s=UNLOADED_RETRY_AFTER_S))
        self.closed.set()

    def _take_waiting(self) -> list[_Request]:
        """Waiting requests that fit in the batch now, oldest first."""
        self._drain_inbox()
        admitted: list[_Request] = []
        free = self.settings.max_batch_size - len(self.rows)
        while self.backlog and self.backlog[0].params.n <= free:
            request = self.backlog.popleft()
            with self.waiting_lock:
                self.waiting -= 1
            if not request.cancelled.is_set():
                admitted.append(request)
                free -= request.params.n
        return admitted

    def _drain_inbox(self) -> None:
        """Move every submitted request to the backlog."""
        while True:
            try:
                self.backlog.append(self.inbox.get_nowait())
            except queue.Empty:
                return

    def _prefill(self, requests: list[_Request]) -> None:
        width = max(len(request.prompt_token_ids) for request in requests)
        input_ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for i, request in enumerate(requests):
            prompt = request.prompt_token_ids
            input_ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        # One row per request: its n choices share the prompt, so their cache rows are copies of that row's.
        output = self.model.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=True,
        )
        hidden = output.last_hidden_state
        rows = [row for i, request in enumerate(requests) for row in self._choices(request, hidden[i])]
        choices = torch.tensor([i for i, request in enumerate(requests) for _ in range(request.params.n)])
        cache = output.past_key_values
        for layer in cache.layers:
            layer.batch_select_indices(choices)
        if self.batch is None:
            self.batch = _Batch(rows, cache, mask[choices])
        else:
            self.batch.merge(rows, cache, mask[choices])
        for row in rows:
            if row.request.params.max_tokens == 0:  # the prompt scored, nothing to generate
                row.output.end("length")
                self._send(row)
        self._sample(rows, self.model.lm_head(hidden[choices, -1]))

    def _choices(self, request: _Request, hidden: torch.Tensor) -> list[_Sequence]:
        """The request's rows, one per choice; `hidden`: its prefilled row's last hidden states (left-padded)."""
        params, prompt = request.params, request.prompt_token_ids
        scored = None
        if params.prompt_logprobs is not None:
            scored = self._score_prompt(hidden[hidden.shape[0] - len(prompt) :], prompt, params.prompt_logprobs)
        return [
            _Sequence(
                request,
                ChoiceOutput(index, self.tokenizer, params, self.end_ids, scored),
                TokenSampler(params, prompt, self.end_ids, choice_generator(params.seed, index)),
                GrammarMatcher(request.grammar, self.model.config.vocab_size) if request.grammar else None,
            )
            for index in range(params.n)
        ]

    def _score_prompt(self, hidden: torch.Tensor, prompt: list[int], top: int) -> list[TokenLogprob]:
        """Each prompt token's logprob given the tokens before it (`hidden`: the prompt's last hidden states)."""
        entries = [TokenLogprob(decode_text(self.tokenizer, [prompt[0]]), None)]
        for start in range(0, len(prompt) - 1, PROMPT_SCORING_CHUNK):
            logits = self.model.lm_head(hidden[start : start + PROMPT_SCORING_CHUNK])
            targets = prompt[start + 1 : start + 1 + PROMPT_SCORING_CHUNK]
            entries += [self._logprob(row, token, top) for row, token in zip(logits, targets, strict=False)]
        return entries

    def _decode_step(self, batch: _Batch) -> None:
        input_ids = torch.tensor([[row.next_token] for row in batch.rows])
        length = batch.mask.shape[1]
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch.rows), 1)], dim=-1)
        position_ids = batch.mask.sum(-1, keepdim=True) - 1
        compiled = self.compiled
        bucket = compiled.bucket(len(batch.rows)) if compiled is not None else None
        if compiled is None or bucket is None:
            batch.static = None  # the eager step replaces the cache's CCA state tensors
            output = self.model(
                input_ids=input_ids,
                attention_mask=batch.mask,
                position_ids=position_ids,
                past_key_values=batch.cache,
                use_cache=True,
            )
            logits = output.logits[:, -1]
        else:
            logits = batch.compiled_step(compiled.decoder, bucket, input_ids, position_ids, length)
            self.stats.compiled_steps += 1
        self.stats.steps += 1
        self.stats.max_batch_size_seen = max(self.stats.max_batch_size_seen, len(batch.rows))
        self._sample(batch.rows, logits)

    def _sample(self, rows: list[_Sequence], logits: torch.Tensor) -> None:
        for row, row_logits in zip(rows, logits, strict=True):
            if row.finished:
                continue
            params = row.request.params
            if row.matcher is not None:
                row_logits = row.matcher.mask(row_logits)
            token = row.next_token = row.sampler(row_logits)
            if row.matcher is not None and not row.matcher.accept(token):
                # The grammar library contradicting its own mask fails this request only; its rows leave the batch.
                row.request.send(EngineFailure(f"Generation failed: the grammar refused token {token} it allowed."))
                row.request.cancelled.set()
                continue
            self.stats.decoded_tokens += 1
            row.output.add(token, self._logprob(row_logits, token, params.top_logprobs) if params.logprobs else None)
            self._send(row)

    def _send(self, row: _Sequence) -> None:
        delta = row.output.take()
        if delta is not None:
            row.request.send(delta)

    def _logprob(self, logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
        """The model's own logprob of `token` given next-token `logits`, with the `top` best alternatives."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        alternatives: tuple[tuple[str, float], ...] = ()
        if top:
            values, ids = logprobs.topk(top)
            alternatives = tuple(
                (decode_text(self.tokenizer, [i]), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)
            )
        token_text = decode_text(self.tokenizer, [token])
        return TokenLogprob(token=token_text, logprob=float(logprobs[token]), top=alternatives)

    def _drop_finished(self) -> None:
        batch = self.batch
        if batch is not None:
            keep = [i for i, row in enumerate(batch.rows) if not row.finished and not row.request.cancelled.is_set()]
            if not keep:
                self.batch = None
            elif len(keep) < len(batch.rows):
                batch.keep(keep)
        self.stats.running = len(self.rows)

    def _fail_all(self, error: EngineError) -> None:
        requests = {id(row.request): row.request for row in self.rows}
        self.batch = None
        self.stats.running = 0
        with self.waiting_lock:  # `submit` adds to the inbox under this lock: nothing slips in unanswered
            self._drain_inbox()
            self.waiting -= len(self.backlog)
        requests.update((id(request), request) for request in self.backlog)
        self.backlog.clear()
        for request in requests.values():
            request.send(error)


@dataclass
class _Loaded:
    scheduler: _Scheduler
    base_version_id: str


class LocalEngine(Engine):
    name = "local"

    def __init__(self, settings: LocalEngineSettings | None = None) -> None:
        super().__init__()
        self.settings = settings or LocalEngineSettings()
        self._loaded: LoadedModels[_Loaded] = LoadedModels()  # by served version id
        self._grammar_compilers: dict[str, GrammarCompiler] = {}  # by base version id
        self._locks: dict[str, asyncio.Lock] = {}
        self._compute: _ComputeThread | None = None  # started with the first model

    @property
    def max_choices(self) -> int:
        return self.settings.max_batch_size

    # --- loading --------------------------------------------------------------------------------------------
    async def load_model(self, model: ModelRef) -> None:
        await self._ensure_loaded(model, None)

    async def load_adapter(self, adapter: ModelRef, base: ModelRef) -> None:
        await self._ensure_loaded(base, adapter)

    async def unload_model(self, version_id: str) -> None:
        for served_id, loaded in list(self._loaded.items()):
            if served_id == version_id or loaded.base_version_id == version_id:
                await self._unload(served_id)
        self._forget(version_id)
        self._grammar_compilers.pop(version_id, None)

    async def unload_adapter(self, version_id: str) -> None:
        await self._unload(version_id)

    async def _ensure_loaded(self, base: ModelRef, adapter: ModelRef | None) -> _Scheduler:
        served = adapter or base
        lock = self._locks.setdefault(served.version_id, asyncio.Lock())
        async with lock:
            if served.version_id not in self._loaded:
                tokenizer = await self.tokenizer(base)
                model = await on_own_thread(_load_weights, base, adapter)
                await self._loaded.make_room(
                    self.settings.max_loaded_models, lambda loaded: loaded.scheduler.busy, self._unload
                )
                if self._compute is None:
                    self._compute = _ComputeThread()
                scheduler = _Scheduler(model, tokenizer, self.settings, self._compute.wake)
                self._compute.add(scheduler)
                self._loaded[served.version_id] = _Loaded(scheduler, base.version_id)
            return self._loaded.use(served.version_id).scheduler

    async def _unload(self, served_id: str) -> None:
        loaded = self._loaded.pop(served_id, None)
        if loaded is not None:
            loaded.scheduler.close()
            await asyncio.to_thread(loaded.scheduler.closed.wait, 30)
            if loaded.scheduler.compiled is not None:
                # A graph being compiled cannot be interrupted: wait for it (the thread then ends).
                await asyncio.to_thread(loaded.scheduler.compiled.stop, 600)

    # --- generation -----------------------------------------------------------------------------------------
    async def _submit(
        self,
        model: ModelRef,
        prompt_token_ids: list[int],
        params: SamplingParams,
        adapter: ModelRef | None,
        deltas: DeltaQueue,
    ) -> Callable[[], None]:
        scheduler = await self._ensure_loaded(model, adapter)
        grammar = await self._compile(model, scheduler, params.grammar) if params.grammar is not None else None
        request = _Request(list(prompt_token_ids), params, asyncio.get_running_loop(), deltas, grammar)
        scheduler.submit(request)
        # The scheduler drops a cancelled request's rows at its next step.
        return request.cancelled.set

    async def _compile(
        self, model: ModelRef, scheduler: _Scheduler, grammar: OutputGrammar
    ) -> xgrammar.CompiledGrammar:
        """`grammar` compiled for the model's tokenizer, off the event loop and the compute thread (reading a
        large vocabulary, or compiling a large schema, takes a while)."""
        compiler = self._grammar_compilers.get(model.version_id)
        if compiler is None:
            vocab_size = scheduler.model.config.vocab_size
            stop_ids = sorted(scheduler.end_ids)
            compiler = await asyncio.to_thread(GrammarCompiler, scheduler.tokenizer, vocab_size, stop_ids)
            self._grammar_compilers[model.version_id] = compiler
        try:
            return await asyncio.to_thread(compiler.compile, grammar)
        except GrammarError as error:
            raise EngineError(error.message, param=error.param) from error

    def stats(self, version_id: str) -> SchedulerStats | None:
        """Counters of the scheduler serving `version_id` (tests and metrics)."""
        loaded = self._loaded.get(version_id)
        return loaded.scheduler.stats if loaded else None

    def health(self) -> dict[str, Any]:
        """`status` is "warming" while any loaded model's decode steps are being compiled (requests are served
        meanwhile, eagerly for batch sizes not yet compiled), else "ok"."""
        compiled = {
            served_id: loaded.scheduler.compiled
            for served_id, loaded in self._loaded.items()
            if loaded.scheduler.compiled is not None
        }
        return {
            "status": "warming" if any(steps.warming for steps in compiled.values()) else "ok",
            "engine": self.name,
            "loaded_models": list(self._loaded),
            "compiled_batch_sizes": {served_id: list(steps.ready) for served_id, steps in compiled.items()},
            "compile_errors": {served_id: steps.error for served_id, steps in compiled.items() if steps.error},
            "running_sequences": sum(loaded.scheduler.stats.running for loaded in self._loaded.values()),
            "queued_requests": sum(loaded.scheduler.waiting for loaded in self._loaded.values()),
        }

    async def close(self) -> None:
        for served_id in list(self._loaded):
            await self._unload(served_id)
        if self._compute is not None:
            compute, self._compute = self._compute, None
            await asyncio.to_thread(compute.stop)


# `from_pretrained` patches process-wide state while it builds a model (meta device, skipped inits): one at a time.
_LOAD_LOCK = threading.Lock()


def _load_weights(base: ModelRef, adapter: ModelRef | None) -> ZayaForCausalLM:
    with _LOAD_LOCK:
        try:
            model = ZayaForCausalLM.from_pretrained(base.path, dtype=torch.float32)
        except Exception as error:
            raise ModelLoadError(f"Model version {base.version_id} could not be loaded: {error}") from error
        if adapter is not None:
            model = _merge_adapter(model, adapter)
    model.eval()
    return model


def _merge_adapter(model: ZayaForCausalLM, adapter: ModelRef) -> ZayaForCausalLM:
    from zaya_model.training.adapter_merge import merge_adapter

    config_path = adapter.path / "adapter_config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"Adapter version {adapter.version_id} has no adapter_config.json.")
    try:
        merged = merge_adapter(model, adapter.path)
    except Exception as error:
        raise ModelLoadError(
            f"Adapter version {adapter.version_id} cannot be applied to its base model: {error}"
        ) from error
    if not isinstance(merged, ZayaForCausalLM):  # merging gives the base model back, with the adapter folded in
        raise ModelLoadError(f"Merging adapter version {adapter.version_id} gave a {type(merged).__name__}.")
    return merged
