"""Pretrain a ZAYA model on a raw-text corpus: resumable exactly, failure-tolerant, checkpointed asynchronously.

Why a training loop of our own rather than transformers' `Trainer` (read against transformers 5.19's `trainer.py`):
- Resume. `Trainer` restores the data position by replaying the dataloader and discarding the batches already
  trained (`skip_first_batches` in `_run_epoch`): on a streaming, tokenizing corpus that re-reads and re-tokenizes
  everything trained so far, at every restart. Our `PackedStream` saves a byte cursor, the partial row and the shuffle
  buffer, so a resume reads the next batch directly.
- Failure rollback. `_run_epoch` computes the gradient norm and then runs `optimizer.step()`,
  `lr_scheduler.step()` and `global_step += 1` unconditionally; a callback can neither veto a non-finite step nor
  rewind model, optimizer, scheduler, step counter and data position to the last good checkpoint in the middle of
  an epoch, which is what the rollback-and-skip below does.
- Checkpoints. `_save_checkpoint` writes synchronously, straight into `checkpoint-N`; ours are written from a CPU
  copy on a background thread into a temporary directory, fsynced, then renamed.
The reasons are behaviour, not speed: `benchmarks/pretrain_bench.py` times this loop against `Trainer` on the same
model, rows and optimizer settings.

Each optimizer step draws `grad_accum` packed batches, sums the token losses over all of them (normalised by the
batch's real token count, so accumulation equals one large batch), clips the gradient norm, steps AdamW (or Muon
for 2-D hidden weights + AdamW for the rest) under a warmup + cosine schedule, then updates the routers' balancing
biases and logs per-layer expert load, skip rate and load imbalance to `metrics.jsonl`.

One `Checkpointer` (`training/checkpointer.py`) saves and loads the run: the model, the optimizers and every other
object with `state_dict()` / `load_state_dict()`: the schedulers, the balancing-bias updater, the data stream's
position and the trainer itself (its step counter, the batches it skips and the RNG). The sharding setting chooses its
backend once.

A non-finite loss or gradient norm reloads the last checkpoint (model, optimizer, scheduler, biases, RNG, data
position), marks the offending batch to be skipped, and continues; more than `max_rollbacks` failures without a new
checkpoint in between stop the run. A step running longer than `step_timeout_s` dumps every thread's stack and exits
the process with status 1 (faulthandler), so a supervisor can restart it. SIGTERM checkpoints and stops.

Data parallel under `torchrun` (see `training/distributed.py`): every rank reads the same packed stream and trains on
its slice of each global batch; routing counts are summed across ranks, and so are gradients, one of two ways:
- `sharding="none"` (DDP-style): every rank holds the whole model and optimizer, gradients are all-reduced, and rank 0
  alone writes `save_pretrained` checkpoints.
- `sharding="fsdp"` (FSDP2, ZeRO-3-style, `training/sharding.py`): parameters, gradients and AdamW state are sharded
  over the ranks; every rank writes its own shard of each checkpoint in parallel with `torch.distributed.checkpoint`
  (the checkpointer's sharded backend, `training/sharded_checkpoint.py`), asynchronously, and the final model is
  gathered into a `save_pretrained` export. DCP reshards on load, so a checkpoint written by N processes resumes on
  M (1 included). Muon is refused here: it orthogonalises whole matrices and FSDP gives it row shards.
Either way a run may resume on a different number of processes with the same global batch (batch_size x processes);
rank 0 alone writes metrics, the loss plot and the tokenizer. Multi-node launch, e.g. 128 nodes x 8 MI300X (ROCm
torch; "nccl" maps to RCCL):
    torchrun --nnodes 128 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 \
        --no-python zaya pretrain --preset zaya1-base --optimizer adamw --sharding fsdp --data /shared/corpus \
        --output /shared/run
with `--output` on a filesystem every node sees (each rank writes its shard files there). Sharded async saves
coordinate over a gloo group of their own beside the training backend, as DCP requires a CPU backend for them, so they
work under NCCL/RCCL too (only tested on CPU with gloo: there is no GPU here).
"""

from __future__ import annotations

import faulthandler
import json
import math
import random
import shutil
import signal
import threading
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from transformers import PreTrainedTokenizerFast

from ..configuration_zaya import ZayaConfig
from ..cpu.compiled_layers import enable_compiled_layers, require_cpp_compiler
from ..modeling_zaya import ZayaForCausalLM
from ..training.atomic_io import atomic_directory, fsync_tree, write_text_atomic
from ..training.balancing import BalancingBiasUpdater
from ..training.callbacks import COMPILING_MESSAGE, STOP_REASONS, TrainingHooks
from ..training.checkpoint_dirs import latest_checkpoint
from ..training.checkpointer import Checkpointer
from ..training.distributed import DistributedContext
from ..training.sharding import is_sharded, local_scalar, shard_model
from .copying import COPIED_LOSS, STEPS_AFTER_COPYING, CopyingRows
from .corpus import (
    CorpusError,
    PackedStream,
    PackingSpec,
    as_rng_state,
    corpus_files,
    corpus_fingerprint,
    is_validation,
    iter_split,
    read_documents,
    rows_to_batch,
    validation_rows,
)
from .plot import write_loss_plot
from .presets import PretrainSettings
from .settings import model_shape
from .tokenizer import train_tokenizer

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
LOSS_PLOT_FILE = "loss.png"
TOKENIZER_DIR = "tokenizer"
CHECKPOINTS_DIR = "checkpoints"
# Settings a resumed run must share with the run that wrote the checkpoints (the rest may change, e.g. max_steps).
# The global batch (batch_size x processes) and its copying rows (copy_rows x processes) must match too: a run may
# resume on a different number of processes.
RESUME_INVARIANTS = (
    "model",
    "tokenizer_vocab_size",
    "seq_len",
    "grad_accum",
    "optimizer",
    "seed",
    "validation_fraction",
    "sharding",
)
_DEFAULTS = PretrainSettings()  # for settings added after a run.json was written


class PretrainError(RuntimeError):
    """A run cannot start or continue; the message says why in one line."""


@dataclass
class PretrainResult:
    step: int
    status: str  # "completed" or "interrupted"
    last_loss: float | None
    val_loss: float | None


def scan_corpus(files: list[Path], seed: int, validation_fraction: float) -> tuple[int, int]:
    """One streaming pass that rejects unreadable files early; returns (training, validation) document counts."""
    counts = [0, 0]
    for path in files:
        for text, _ in read_documents(path):
            counts[is_validation(text, seed, validation_fraction)] += 1
    if counts[0] == 0:
        raise CorpusError("the corpus has no training documents (is it empty?)")
    return counts[0], counts[1]


def warmup_cosine(settings: PretrainSettings):
    def factor(step: int) -> float:
        if step < settings.warmup_steps:
            return (step + 1) / settings.warmup_steps
        span = max(1, settings.max_steps - settings.warmup_steps)
        progress = min(1.0, (step - settings.warmup_steps) / span)
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return settings.min_lr_ratio + (1 - settings.min_lr_ratio) * cosine

    return factor


def build_optimizers(model: torch.nn.Module, settings: PretrainSettings) -> list[torch.optim.Optimizer]:
    """AdamW for everything, or Muon for the 2-D hidden weights (not embeddings/head) and AdamW for the rest."""
    matrices, decayed, plain = [], [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        is_embedding = "embed_tokens" in name or "lm_head" in name
        if settings.optimizer == "muon" and parameter.ndim == 2 and not is_embedding:
            matrices.append(parameter)
        elif parameter.ndim >= 2:
            decayed.append(parameter)
        else:
            plain.append(parameter)
    groups = [{"params": decayed, "weight_decay": settings.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    # fused: one kernel for all parameters (CPU and CUDA/ROCm); the per-tensor default makes each step much longer.
    adamw = torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.95), fused=True)
    optimizers: list[torch.optim.Optimizer] = [adamw]
    if matrices:
        # "match_rms_adamw" scales Muon's update to AdamW's RMS, so one learning rate serves both.
        muon = torch.optim.Muon(
            matrices, lr=settings.lr, weight_decay=settings.weight_decay, adjust_lr_fn="match_rms_adamw"
        )
        optimizers.append(muon)
    return optimizers


def clip_gradients(parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` with the same norm and the same gradients after it, as a plain tensor, except
    that gradients whose norm is within `max_norm` are left as they are instead of multiplied by exactly 1: one pass
    over every gradient saved on each step that does not clip (most steps of a long run). Its host read of the
    coefficient is one the caller makes anyway when it checks the norm is finite."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total_norm = torch.nn.utils.get_total_norm(grads)
    norm = local_scalar(total_norm)
    # The coefficient as clip_grads_with_norm_ computes it; a NaN norm (a rolled-back step) scales nothing.
    if bool(torch.clamp(max_norm / (norm + 1e-6), max=1.0) < 1.0):
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm)
    return norm


def autocast_dtype(setting: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for a `dtype` setting, or None for plain fp32."""
    if setting == "fp32":
        return None
    if device.type == "cuda":
        supported = torch.cuda.is_bf16_supported()
    elif setting == "bf16":
        # Ask Linux for AMX permission first: without it bf16 matmuls hang on AMX CPUs. Without native bf16
        # (AVX512-BF16 or AMX) autocast is emulated and slower than fp32, so it is refused.
        if hasattr(torch.cpu, "_init_amx"):
            torch.cpu._init_amx()
        supported = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    else:
        supported = False  # "auto" on CPU: fp32 (tiny models gain nothing from bf16 here)
    if setting == "bf16" and not supported:
        raise PretrainError(f"bf16 is not supported on {device.type} here; use --dtype fp32")
    return torch.bfloat16 if supported else None


class Pretrainer:
    """Sets up (or resumes) a run in `output`; `train()` runs it. `init_from`: a saved model (and its tokenizer) to
    go on training instead of a freshly initialised one; `settings.model` must then be its shape (`model_shape`)."""

    def __init__(
        self,
        data: str | Path,
        output: str | Path,
        settings: PretrainSettings,
        tokenizer_path: str | Path | None = None,
        progress: bool = False,
        hooks: TrainingHooks | None = None,
        distributed: DistributedContext | None = None,
        init_from: str | Path | None = None,
    ):
        self.output = Path(output)
        self.settings = settings
        self.init_from = None if init_from is None else Path(init_from).resolve()
        init_config = None if self.init_from is None else self._init_config(tokenizer_path)
        self.progress = progress
        self.hooks = hooks or TrainingHooks()
        self.dist = distributed or DistributedContext.from_environment()
        self.device = self.dist.device()
        self.autocast = autocast_dtype(settings.dtype, self.device)
        if settings.compile and self.device.type == "cpu":
            try:  # before anything is written
                require_cpp_compiler()
            except RuntimeError as error:
                raise PretrainError(f"--compile: {error}") from None
        self.files = corpus_files(data)
        self._prepare_output()
        resume_from = latest_checkpoint(self.output / CHECKPOINTS_DIR)
        self._check_run_file(resumed=resume_from is not None)
        if resume_from is None and self.dist.is_main:
            scan_corpus(self.files, settings.seed, settings.validation_fraction)
        self.tokenizer = self._load_or_train_tokenizer(self.init_from or tokenizer_path)
        self.config = init_config or settings.zaya_config(self.tokenizer)
        if len(self.tokenizer) > self.config.vocab_size:
            raise PretrainError(f"the tokenizer has {len(self.tokenizer)} tokens, the model {self.config.vocab_size}")
        self.model = self._build_model(load_weights=resume_from is None)  # a checkpoint holds its own
        # After sharding (which swaps in sharded parameters); loading a checkpoint copies into these same tensors.
        self.parameters = list(self.model.parameters())
        self.optimizers = build_optimizers(self.model, settings)
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, warmup_cosine(settings)) for o in self.optimizers]
        self.balancing = BalancingBiasUpdater(self.model, lr=settings.balancing_lr)
        spec = self._packing_spec()
        self.stream = PackedStream(self.files, self.tokenizer, spec, shuffle_buffer=settings.shuffle_buffer)
        # Copying rows: those mixed into the batches, the start's, and fixed held-out ones, from seeds of their own.
        self.copying = CopyingRows(self.tokenizer, settings.seq_len, settings.seed) if settings.copy_rows else None
        self.copying_held_out = (
            CopyingRows(self.tokenizer, settings.seq_len, seed=settings.seed + 2).next_batch(settings.batch_size)
            if settings.copy_rows or settings.copy_start_steps
            else None
        )
        self.validation = validation_rows(self.files, self.tokenizer, spec, settings.eval_rows)
        self.step = 0
        self.skipped_batches: set[int] = set()
        self.checkpointer = self._build_checkpointer()
        self.saved_step: int | None = None
        self.failures_since_checkpoint = 0
        self.last_val_loss: float | None = None
        self.checkpoint_timings: list[dict[str, float]] = []  # stall vs. save_pretrained time of each write
        self._stop_signal: int | None = None
        if resume_from is not None:
            self._resume(resume_from)
        if settings.compile:
            self.hooks.on_event("info", COMPILING_MESSAGE)
        self.dist.barrier()  # every rank is set up before rank 0 writes the first checkpoint

    # ----- set-up -----

    def _init_config(self, tokenizer_path: str | Path | None) -> ZayaConfig:
        """The config of the model the run starts from, checked against the settings."""
        assert self.init_from is not None
        if tokenizer_path is not None:
            raise PretrainError("a model to start from brings its own tokenizer; give no other")
        try:
            config = ZayaConfig.from_pretrained(self.init_from)
        except (OSError, ValueError) as error:
            raise PretrainError(f"cannot start from {self.init_from}: {error}") from None
        if model_shape(config) != self.settings.model:
            raise PretrainError(f"the settings' model shape is not the shape of {self.init_from}")
        return config

    def _build_model(self, load_weights: bool) -> ZayaForCausalLM:
        """The model on this process's device, sharded under FSDP: `init_from`'s weights in fp32 (when
        `load_weights`), else freshly initialised from the run's seed."""
        torch.manual_seed(self.settings.seed)
        if self.init_from is not None and load_weights:
            model = ZayaForCausalLM.from_pretrained(self.init_from, dtype=torch.float32)
        else:
            model = ZayaForCausalLM(self.config)
        model.to(self.device)  # type: ignore[arg-type]  # typeshed's wraps() loses self on transformers' `to`
        model.train()
        enable_compiled_layers(model, self.settings.compile)
        if self.settings.sharding == "fsdp" and self.dist.enabled:  # one process has nothing to shard
            shard_model(model)
        return model

    def _packing_spec(self) -> PackingSpec:
        settings = self.settings
        return PackingSpec(
            seq_len=settings.seq_len,
            bos_token_id=self.tokenizer.bos_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
            seed=settings.seed,
            validation_fraction=settings.validation_fraction,
            packing=settings.packing,
        )

    def _build_checkpointer(self) -> Checkpointer:
        # What a resume needs besides the model and optimizers, each with state_dict() / load_state_dict(); the
        # trainer's own entry (step, skipped batches, RNG) is loaded last, so its RNG state is the one that holds.
        states: dict[str, Stateful] = {f"scheduler{i}": scheduler for i, scheduler in enumerate(self.schedulers)}
        states |= {"balancing": self.balancing, "data": self.stream}
        if self.copying is not None:  # a resume keeps copy_rows (`_check_run_file`), so its checkpoints hold this
            states["copying"] = self.copying
        states["trainer"] = self
        return Checkpointer(
            self.output / CHECKPOINTS_DIR,
            self.model,
            self.optimizers,
            states,
            self.tokenizer,
            self.settings.keep_last,
            sharded=self.settings.sharding == "fsdp",
            is_main=self.dist.is_main,
            after_write=self._write_loss_plot if self.dist.is_main else None,
        )

    def _resume(self, checkpoint: Path) -> None:
        self._load(checkpoint)
        self._log({"event": "resumed", "step": self.step, "checkpoint": checkpoint.name})
        self.hooks.on_event("info", f"resumed from {checkpoint.name}", {"step": self.step})

    def _prepare_output(self) -> None:
        try:
            self.output.mkdir(parents=True, exist_ok=True)
            probe = self.output / f".write-probe-{self.dist.rank}"  # one per rank: ranks probe at once
            probe.write_text("ok")
            probe.unlink()
        except OSError as error:
            raise PretrainError(f"output directory {self.output} is not writable: {error.strerror}") from None

    def _check_run_file(self, resumed: bool) -> None:
        run_path = self.output / RUN_FILE
        current: dict[str, Any] = {
            "settings": self.settings.model_dump(),
            "global_batch_size": self.settings.batch_size * self.dist.world_size,
            "global_copy_rows": self.settings.copy_rows * self.dist.world_size,
            "corpus": corpus_fingerprint(self.files),
            "init_from": None if self.init_from is None else str(self.init_from),
        }
        if resumed and run_path.is_file():
            previous = json.loads(run_path.read_text())
            saved = {k: previous["settings"].get(k, getattr(_DEFAULTS, k)) for k in RESUME_INVARIANTS}
            changed = [k for k in RESUME_INVARIANTS if saved[k] != current["settings"][k]]
            if previous.get("global_batch_size") != current["global_batch_size"]:
                changed.append("batch_size x processes")
            if previous.get("global_copy_rows", 0) != current["global_copy_rows"]:
                changed.append("copy_rows x processes")
            if previous.get("init_from") != current["init_from"]:
                changed.append("init_from")
            if changed:
                raise PretrainError(
                    f"{self.output} holds a run with different settings ({', '.join(changed)}); "
                    "use a new --output or the original settings"
                )
            if previous["corpus"] != current["corpus"]:
                raise PretrainError(f"the corpus changed since the run in {self.output} started; use a new --output")
        if not self.dist.is_main:
            return
        write_text_atomic(run_path, json.dumps(current, indent=2))

    def _load_or_train_tokenizer(self, tokenizer_path: str | Path | None) -> PreTrainedTokenizerFast:
        saved = self.output / TOKENIZER_DIR
        if not saved.is_dir() and self.dist.is_main:
            self._save_tokenizer(self._new_tokenizer(tokenizer_path), saved)
        self.dist.barrier()  # the other ranks read what rank 0 trained
        return PreTrainedTokenizerFast.from_pretrained(saved)

    def _new_tokenizer(self, tokenizer_path: str | Path | None) -> PreTrainedTokenizerFast:
        if tokenizer_path is not None:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_path)
            if tokenizer.bos_token_id is None or tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
                raise PretrainError(f"tokenizer {tokenizer_path} needs BOS, EOS and PAD tokens")
        else:
            texts = iter_split(self.files, "train", self.settings.seed, self.settings.validation_fraction)
            tokenizer = train_tokenizer(
                texts, self.settings.tokenizer_vocab_size, split_digits=self.settings.tokenizer_split_digits
            )
        tokenizer.model_max_length = self.settings.max_positions
        return tokenizer

    def _save_tokenizer(self, tokenizer: PreTrainedTokenizerFast, saved: Path) -> None:
        with atomic_directory(saved) as staging:
            tokenizer.save_pretrained(staging)

    # ----- checkpoints -----

    def state_dict(self) -> dict[str, Any]:
        """The trainer's own state in a checkpoint: its step counter, the batches it skips, and the RNG."""
        rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {"step": self.step, "skipped_batches": sorted(self.skipped_batches), "rng": rng}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.skipped_batches = set(state["skipped_batches"])
        random.setstate(as_rng_state(state["rng"]["python"]))
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])

    def _save(self, val_loss: float | None = None, block: bool = False) -> None:
        """Checkpoint (rank 0 writes, or every rank its shard); `block` waits until it is on disk."""
        self.failures_since_checkpoint = 0
        self.saved_step = self.step
        stall_s = self.checkpointer.save(self.step, val_loss, block)
        if block:
            self.dist.barrier()  # rank 0 has renamed the checkpoint into place
        self._log({"event": "checkpoint", "step": self.step, "stall_s": round(stall_s, 4), "val_loss": val_loss})

    def _load(self, directory: Path) -> None:
        self.checkpointer.load(directory)
        self.saved_step = self.step
        for router in self.balancing.routers:
            router.routed_token_counts = None

    # ----- steps -----

    def _next_step_batches(self) -> tuple[int, list[dict[str, torch.Tensor]]]:
        """The micro-batches of the next optimizer step and the stream index that names them (for skipping)."""
        while True:
            index = self.stream.batches_drawn
            batches = [self._next_local_batch() for _ in range(self.settings.grad_accum)]
            if index not in self.skipped_batches:
                return index, batches
            self._log({"event": "skipped_batch", "batch": index, "step": self.step})

    def _next_local_batch(self) -> dict[str, torch.Tensor]:
        """This rank's rows of the next global batch: its corpus rows, then its copying rows when `copy_rows` is set
        (every rank reads the same stream and draws the same copying rows, so no state diverges)."""
        copies = self.settings.copy_rows
        batch = self._local_rows(self.stream.next_batch, self.settings.batch_size - copies)
        if self.copying is None:
            return batch
        copying = self._local_rows(self.copying.next_batch, copies)
        return {key: torch.cat([value, copying[key]]) for key, value in batch.items()}

    def _local_rows(self, draw, rows: int) -> dict[str, torch.Tensor]:
        """This rank's `rows` of a global batch that `draw(rows * world_size)` returns."""
        batch = draw(rows * self.dist.world_size)
        return {key: value[self.dist.rank * rows : (self.dist.rank + 1) * rows] for key, value in batch.items()}

    def _autocast(self):
        """bf16 autocast where the run uses it (`autocast_dtype`), else nothing."""
        return torch.autocast(self.device.type, dtype=self.autocast) if self.autocast else nullcontext()

    def _forward_loss(self, batch: dict[str, torch.Tensor], num_items: torch.Tensor) -> torch.Tensor:
        batch = {key: value.to(self.device) for key, value in batch.items()}
        with self._autocast():
            return self.model(**batch, use_cache=False, num_items_in_batch=num_items).loss

    def _backward(self, batches: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward over a step's micro-batches, gradients summed over the ranks and clipped: the global
        mean token loss and the gradient norm before clipping."""
        num_items = torch.stack([(batch["labels"][:, 1:] != -100).sum() for batch in batches]).sum().to(self.device)
        self.dist.sum_(num_items)  # each rank's loss is its share of the global mean
        loss = torch.zeros((), device=self.device)
        for batch in batches:
            micro_loss = self._forward_loss(batch, num_items)
            micro_loss.backward()
            loss += micro_loss.detach()
        self.dist.sum_(loss)
        if not is_sharded(self.model):  # FSDP reduce-scatters the gradients during backward
            self.dist.sum_gradients(self.parameters)
        max_norm = self.settings.max_grad_norm if self.settings.max_grad_norm > 0 else float("inf")
        return loss, clip_gradients(self.parameters, max_norm)

    def _balance(self) -> dict[str, Any]:
        """Update the routers' balancing biases from the step's routing counts, summed over the ranks (the routers
        found once: walking the module tree each step is a measurable share of a small model's step)."""
        for router in self.balancing.routers:
            if router.routed_token_counts is not None:
                self.dist.sum_(router.routed_token_counts)
        return self.balancing.step()

    def train_step(self) -> dict[str, Any] | None:
        """One optimizer step; returns its metrics, or None when a non-finite step was rolled back."""
        started = time.perf_counter()
        batch_index, batches = self._next_step_batches()
        loss, grad_norm = self._backward(batches)
        if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
            self._rollback(batch_index, loss.item(), grad_norm.item())
            return None
        learning_rate = self.schedulers[0].get_last_lr()[0]
        for optimizer, scheduler in zip(self.optimizers, self.schedulers, strict=True):
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        balance = self._balance()
        self.step += 1
        tokens = sum(batch["input_ids"].numel() for batch in batches) * self.dist.world_size
        return {
            "step": self.step,
            "loss": loss.item(),
            "grad_norm": grad_norm.item(),
            "lr": learning_rate,
            "tokens_per_s": tokens / (time.perf_counter() - started),
            "max_load_imbalance": balance["max_load_imbalance"],
            "load_imbalance": balance["load_imbalance"],
            "skip_rate": balance["skip_rate"],
            "expert_load": balance["expert_load"],
        }

    def _rollback(self, batch_index: int, loss: float, grad_norm: float) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        self.failures_since_checkpoint += 1
        if self.failures_since_checkpoint > self.settings.max_rollbacks:
            raise PretrainError(
                f"{self.failures_since_checkpoint} non-finite steps since the last checkpoint "
                f"(latest at step {self.step}, loss {loss}, grad norm {grad_norm}); stopping"
            )
        self.checkpointer.wait()
        self.dist.barrier()  # rank 0's last checkpoint is on disk
        checkpoint = self.checkpointer.latest()
        if checkpoint is None:  # `train` saves step 0 before its first step; someone removed the checkpoints
            raise PretrainError(f"no checkpoint in {self.checkpointer.directory} to roll back to")
        skipped = self.skipped_batches | {batch_index}
        failures = self.failures_since_checkpoint
        failed_step = self.step + 1
        self._load(checkpoint)
        self.skipped_batches = skipped
        self.failures_since_checkpoint = failures
        self._log(
            {
                "event": "rollback",
                "failed_step": failed_step,
                "batch": batch_index,
                "loss": loss,
                "grad_norm": grad_norm,
                "checkpoint": checkpoint.name,
                "resumed_step": self.step,
            }
        )
        self.hooks.on_event(
            "warning",
            f"non-finite step {failed_step} (loss {loss}, grad norm {grad_norm}): rolled back to {checkpoint.name}, "
            f"skipping batch {batch_index}",
            {"step": self.step, "batch": batch_index},
        )

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean token loss over the held-out rows (None when the split is empty)."""
        if not self.validation:
            return None
        self.model.eval()
        total, count = 0.0, 0
        for start in range(0, len(self.validation), self.settings.batch_size):
            batch = rows_to_batch(self.validation[start : start + self.settings.batch_size])
            batch = {key: value.to(self.device) for key, value in batch.items()}
            labels = batch.pop("labels")
            with self._autocast():
                logits = self.model(**batch, use_cache=False).logits.float()
            targets = labels[:, 1:]
            total += torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="sum"
            ).item()
            count += int((targets != -100).sum())
        self.model.train()
        return total / max(count, 1)

    @torch.no_grad()
    def copying_loss(self) -> float | None:
        """Mean loss on fixed held-out copying rows (None when the run uses none): under 1 nat while the model
        copies, ln(vocabulary) or more when it does not."""
        if self.copying_held_out is None:
            return None
        self.model.eval()
        with self._autocast():
            batch = {key: value.to(self.device) for key, value in self.copying_held_out.items()}
            loss = self.model(**batch, use_cache=False).loss.item()
        self.model.train()
        return loss

    def _evaluate_and_log(self) -> None:
        self.last_val_loss = self.evaluate()
        record = {"event": "eval", "step": self.step, "val_loss": self.last_val_loss}
        if self.copying_held_out is not None:
            record["copying_loss"] = self.copying_loss()
        self._log(record)

    def _copying_start(self) -> bool:
        """Train on copying rows alone until the model copies (`copying.py`): until the mean loss of the last 10
        steps falls under COPIED_LOSS, then STEPS_AFTER_COPYING steps more, at most `copy_start_steps`. The run's
        batch size in rows `copy_start_seq_len` long (at most seq_len), AdamW at the peak learning rate without
        decay, whose state is dropped afterwards. Not checkpointed: it is deterministic from the seed, so a run
        stopped during it (False) starts it again."""
        settings = self.settings
        rows = CopyingRows(self.tokenizer, min(settings.seq_len, settings.copy_start_seq_len), seed=settings.seed + 1)
        optimizer = torch.optim.AdamW(self.parameters, lr=settings.lr, weight_decay=0.0)
        recent: deque[float] = deque(maxlen=10)
        copying_from: int | None = None
        bar = self._progress_bar(settings.copy_start_steps, initial=0, desc="copying start")
        try:
            for step in range(1, settings.copy_start_steps + 1):
                batches = [self._local_rows(rows.next_batch, settings.batch_size) for _ in range(settings.grad_accum)]
                loss, grad_norm = self._backward(batches)
                if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
                    raise PretrainError(f"copying start: non-finite loss at step {step}; try a lower --lr")
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                self._balance()
                recent.append(loss.item())
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{recent[-1]:.3f}")
                stop_reason = self._stop_reason()
                if stop_reason is not None:
                    self._log({"event": "stopped", "reason": stop_reason, "step": 0, "copying_start_step": step})
                    self.hooks.on_event("info", f"stopped during the copying start ({stop_reason}); nothing saved")
                    return False
                if copying_from is None and len(recent) == recent.maxlen and sum(recent) / len(recent) < COPIED_LOSS:
                    copying_from = step
                if copying_from is not None and step >= copying_from + STEPS_AFTER_COPYING:
                    break
        finally:
            if bar is not None:
                bar.close()
        record = {"steps": step, "copying_from": copying_from, "copying_loss": round(sum(recent) / len(recent), 4)}
        self._log({"event": "copying_start", **record})
        if copying_from is None:
            message = f"copying start: the model does not copy yet after {step} steps (loss {record['copying_loss']})"
            self.hooks.on_event("warning", message, record)
        else:
            self.hooks.on_event("info", f"copying start: copies from step {copying_from}, {step} steps", record)
        return True

    # ----- the run -----

    def train(self, until_step: int | None = None) -> PretrainResult:
        """Train to `max_steps` (or stop after `until_step`), checkpointing on the way; SIGTERM saves and stops."""
        settings = self.settings
        target = settings.max_steps if until_step is None else min(until_step, settings.max_steps)
        previous_handler = self._install_sigterm_handler()
        bar = self._progress_bar(target, initial=self.step, desc="pretrain")
        metrics: dict[str, Any] | None = None
        try:
            if self.saved_step is None:
                if settings.copy_start_steps and not self._copying_start():
                    return PretrainResult(0, "interrupted", None, None)
                self._save()  # step 0: the first rollback target (a rollback waits for it to be on disk)
            while self.step < target:
                if settings.step_timeout_s > 0:
                    faulthandler.dump_traceback_later(settings.step_timeout_s, exit=True)
                metrics = self.train_step()
                faulthandler.cancel_dump_traceback_later()
                self._drain_checkpoint_timings()
                if metrics is None:
                    if bar is not None:
                        bar.n = self.step
                        bar.refresh()
                    continue
                self._log(metrics)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
                self.hooks.on_metrics(self.step, metrics)
                stop_reason = self._stop_reason()
                if stop_reason is not None:
                    if stop_reason != "cancel":
                        self._save(block=True)
                        self._drain_checkpoint_timings()
                    self._log({"event": "stopped", "reason": stop_reason, "step": self.step})
                    self.hooks.on_event("info", f"stopped at step {self.step}: {stop_reason}", {"step": self.step})
                    return PretrainResult(self.step, "interrupted", metrics["loss"], self.last_val_loss)
                if self.step % settings.eval_every == 0 or self.step % settings.save_every == 0:
                    self._evaluate_and_log()
                if self.step % settings.save_every == 0:
                    self._save(val_loss=self.last_val_loss)
            if self.step != self.saved_step:
                self._evaluate_and_log()
                self._save(val_loss=self.last_val_loss)
            self.checkpointer.wait()
            self._drain_checkpoint_timings()
            if self.step >= settings.max_steps:
                self._export_final()
            return PretrainResult(self.step, "completed", metrics["loss"] if metrics else None, self.last_val_loss)
        finally:
            faulthandler.cancel_dump_traceback_later()
            self.checkpointer.release()
            if bar is not None:
                bar.close()
            if previous_handler is not None:
                signal.signal(signal.SIGTERM, previous_handler)

    def _export_final(self) -> None:
        """Put the final model and tokenizer in the output directory itself (config.json last; rank 0 writes)."""
        temporary = self.output / ".tmp-final"
        if self.settings.sharding == "fsdp":
            # Collective: every rank sends its shards, rank 0 receives the full state (in CPU memory).
            full_state = get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
            if self.dist.is_main:
                shutil.rmtree(temporary, ignore_errors=True)
                self.model.save_pretrained(temporary, state_dict=full_state)
                self.tokenizer.save_pretrained(temporary)
                self._move_into_output(temporary)
            self.dist.barrier()
            return
        if not self.dist.is_main:
            return
        source = self.checkpointer.path(self.step)
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir()
        for path in source.iterdir():
            if path.is_file() and path.name != "training_state.pt":
                shutil.copy2(path, temporary / path.name)
        self._move_into_output(temporary)

    def _move_into_output(self, temporary: Path) -> None:
        """fsync the export in `temporary`, then rename its files into the output directory, config.json last."""
        fsync_tree(temporary)
        names = sorted(p.name for p in temporary.iterdir() if p.name != "config.json")
        for name in [*names, "config.json"]:
            (temporary / name).replace(self.output / name)
        temporary.rmdir()
        self._log({"event": "exported", "step": self.step, "directory": str(self.output)})

    def _stop_reason(self) -> str | None:
        """ "sigterm" or the hooks' "pause"/"cancel" when the run should stop after this step, else None."""
        request = self.hooks.should_stop()
        if request is not None and request not in STOP_REASONS:
            raise ValueError(f"should_stop() returned {request!r}; expected None, 'cancel' or 'pause'")
        if self._stop_signal is not None:
            request = "sigterm"
        # Ranks agree: any rank's save-and-stop beats a cancel, any stop beats going on.
        codes = {None: 0, "cancel": 1, "pause": 2, "sigterm": 2}
        agreed = self.dist.max(codes[request])
        if codes[request] != agreed:
            request = {0: None, 1: "cancel", 2: "sigterm"}[agreed]  # another rank was signalled
        return request

    def _install_sigterm_handler(self):
        if threading.current_thread() is not threading.main_thread():
            return None

        def request_stop(signum, frame):
            self._stop_signal = signum

        return signal.signal(signal.SIGTERM, request_stop)

    def _progress_bar(self, target: int, initial: int, desc: str):
        if not self.progress or not self.dist.is_main:
            return None
        from tqdm import tqdm

        return tqdm(total=target, initial=initial, desc=desc, unit="step", dynamic_ncols=True)

    def _write_loss_plot(self, step: int) -> None:
        """Redraw the loss curve next to the checkpoints (runs on the checkpoint writer thread, rank 0)."""
        write_loss_plot(self.output / METRICS_FILE, self.output / LOSS_PLOT_FILE)

    def _drain_checkpoint_timings(self) -> None:
        while self.checkpointer.completed_writes:
            timing = self.checkpointer.completed_writes.pop(0)
            self.checkpoint_timings.append(timing)
            self._log({"event": "checkpoint_written", **timing})
            step = int(timing["step"])
            self.hooks.on_checkpoint(step, str(self.checkpointer.path(step)), timing)

    def _log(self, record: dict[str, Any]) -> None:
        if not self.dist.is_main:
            return
        with (self.output / METRICS_FILE).open("a") as handle:
            handle.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")
