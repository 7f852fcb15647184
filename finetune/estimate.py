"""Before a run: how many tokens it will train and, given a throughput, how long that takes.

Tokens are billed as the trainer counts them (`finetune.trainer_mixin`): the dataset's trained tokens (its
validation report's `n_trained_tokens`, the tokens that carry loss) once per epoch, with "auto" epochs resolved as
the run will resolve them (`finetune.auto`). A `max_steps` that ends the run before its epochs scales the count by
the share of steps run. A DPO run also trains the newline the chat template writes after each answer's end of turn
(TRL's completion is the templated text after the prompt), one token per answer the estimate leaves out.

The time is the trained tokens over a throughput in trained tokens per second, which comes from one of two places:

- `measure_throughput` (`zaya finetune --dry-run`): the base model, set up as the run sets it up (LoRA or full,
  gradient checkpointing), times forward and backward passes on the dataset's first batch, after one untimed pass.
  Optimizer steps, evaluation, checkpoints and loading are not in it, nor the DPO reference model's forward pass;
  with `compile` the passes run eager (the compiled run's first step compiles, later ones are faster).
- the recorded throughput of earlier jobs on the same base model (the API's estimate, `server.services.training`):
  each succeeded job stores its run's trained tokens per second of training in its model version's metrics.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from .auto import ResolvedHyperparameters, resolve_hyperparameters
from .settings import FineTuneSettings

if TYPE_CHECKING:
    from zaya_model import ZayaConfig

    from .datasets.validation import ValidationReport
    from .run import FineTuneRun

TIMED_PASSES = 2


@dataclass(frozen=True)
class TrainingEstimate:
    n_examples: int
    n_trained_tokens_per_epoch: int
    hyperparameters: ResolvedHyperparameters
    n_steps: int  # optimizer steps the run will take
    trained_tokens: int  # n_trained_tokens_per_epoch x n_epochs (scaled down when max_steps ends the run early)
    trained_tokens_per_second: float | None = None
    estimated_seconds: float | None = None  # of training: trained_tokens / trained_tokens_per_second
    throughput_source: str | None = None  # how trained_tokens_per_second was obtained

    def with_throughput(self, tokens_per_second: float | None, source: str | None) -> TrainingEstimate:
        if not tokens_per_second or tokens_per_second <= 0:
            return replace(self, trained_tokens_per_second=None, estimated_seconds=None, throughput_source=source)
        seconds = self.trained_tokens / tokens_per_second
        return replace(
            self, trained_tokens_per_second=tokens_per_second, estimated_seconds=seconds, throughput_source=source
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["hyperparameters"] = self.hyperparameters.to_dict()
        return data

    def lines(self) -> list[str]:
        """The estimate for a terminal."""
        hyper = self.hyperparameters
        steps = f"{self.n_steps} steps of batch {hyper.batch_size}"
        lines = [
            f"{self.n_examples} examples, {hyper.n_epochs} epochs, {steps}, learning rate {hyper.learning_rate:.3g}",
            f"trained tokens: {self.n_trained_tokens_per_epoch:,} per epoch x {hyper.n_epochs} epochs = "
            f"{self.trained_tokens:,}",
        ]
        if self.estimated_seconds is None:
            lines.append(f"estimated time: unknown ({self.throughput_source or 'no throughput'})")
        else:
            lines.append(
                f"throughput: {self.trained_tokens_per_second:,.0f} trained tokens/s ({self.throughput_source})"
            )
            lines.append(f"estimated training time: {format_seconds(self.estimated_seconds)}")
        return lines


def estimate_tokens(
    settings: FineTuneSettings, report: ValidationReport, config: ZayaConfig | None
) -> TrainingEstimate:
    """The tokens a run of `settings` on the dataset of `report` (validated with the base model's tokenizer) trains."""
    if report.n_trained_tokens is None:
        raise ValueError("the validation report has no token counts (validate with the base model's tokenizer)")
    resolved = resolve_hyperparameters(settings, report.n_examples, config)
    steps_per_epoch = math.ceil(report.n_examples / resolved.batch_size)
    full_steps = steps_per_epoch * resolved.n_epochs
    max_steps = settings.hyperparameters.max_steps
    n_steps = min(full_steps, max_steps) if max_steps else full_steps
    trained_tokens = report.n_trained_tokens * resolved.n_epochs
    if n_steps < full_steps:
        trained_tokens = round(trained_tokens * n_steps / full_steps)
    return TrainingEstimate(
        n_examples=report.n_examples,
        n_trained_tokens_per_epoch=report.n_trained_tokens,
        hyperparameters=resolved,
        n_steps=n_steps,
        trained_tokens=trained_tokens,
    )


def estimate_run(run: FineTuneRun, *, measure: bool = True) -> TrainingEstimate:
    """`zaya finetune --dry-run`: check the run's inputs as the run does (FinetuneError names the field), count its
    trained tokens and, with `measure`, time the base model on the first batch."""
    from zaya_model import ZayaConfig

    from .run import check_inputs_and_dataset

    tokenizer, report = check_inputs_and_dataset(run)
    config = ZayaConfig.from_pretrained(run.model_dir)
    estimate = estimate_tokens(run.settings, report, config)
    if not measure:
        return estimate.with_throughput(None, "not measured")
    rate = measure_throughput(run, tokenizer, estimate.hyperparameters.batch_size)
    passes = f"measured: {TIMED_PASSES} timed forward/backward passes on the first batch"
    return estimate.with_throughput(rate, passes)


def measure_throughput(run: FineTuneRun, tokenizer: Any, batch_size: int, passes: int = TIMED_PASSES) -> float:
    """Trained tokens per second of forward and backward passes of the run's model on the dataset's first batch."""
    import torch
    from peft import get_peft_model

    from zaya_model import ZayaForCausalLM

    from .data import IGNORE_INDEX, TokenizedDataset, make_collator, read_examples
    from .datasets.formats import DatasetFormat, Example
    from .run import make_lora_config

    settings = run.settings
    examples: list[Example] = []
    for example in read_examples(run.train_file)[:batch_size]:
        is_pair = example.format is DatasetFormat.PREFERENCE
        examples.extend(example.conversations() if is_pair else (example,))
    packing = getattr(settings.hyperparameters, "packing", True)
    batch = make_collator(tokenizer, packing)(TokenizedDataset(examples, tokenizer).features)
    n_trained = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())

    torch.manual_seed(run.seed)
    base = ZayaForCausalLM.from_pretrained(run.model_dir, dtype=torch.float32)
    model = get_peft_model(base, make_lora_config(base, settings, tokenizer)) if settings.adapter == "lora" else base
    if settings.hyperparameters.gradient_checkpointing:  # PEFT's wrapper would forward the call to `base`
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()

    def forward_backward() -> None:
        model(**batch, skip_logits=True, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    forward_backward()  # untimed: first-call allocations
    started = time.perf_counter()
    for _ in range(passes):
        forward_backward()
    seconds = (time.perf_counter() - started) / passes
    return n_trained / seconds


def format_seconds(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes = seconds / 60
    if minutes < 60:
        return f"{minutes:.1f} min"
    return f"{minutes / 60:.1f} h"
