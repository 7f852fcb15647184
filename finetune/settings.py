"""The fine-tuning settings: one pydantic model, read by the API, `zaya finetune` and the job worker.

`FineTuneSettings` is OpenAI's `method` object of `POST /v1/fine_tuning/jobs`, kept field for field:
`{"type": "supervised", "supervised": {"hyperparameters": {"n_epochs", "batch_size", "learning_rate_multiplier"}}}`
or `{"type": "dpo", "dpo": {"hyperparameters": {..., "beta"}}}`. Our additions live inside the method's block:
`adapter` ("lora" | "full"), `lora`, `merge_adapter` and further hyperparameters (bounds on the run, evaluation
cadence, checkpoint rotation, memory and speed switches). The API validates a request's `method` with it, the
worker reads a job's stored `method` back with it, and `zaya finetune`'s flags are generated from it
(`command_line.flags`), so there is one set of defaults and a bad value is reported under the field's own name.

"auto" stays a value until a run resolves it from the dataset and the model (`finetune.auto`).
"""

from __future__ import annotations

import argparse
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
)
from pydantic_core import PydanticCustomError

from command_line.flags import Cli, Flag, FlagError, flag_error, flag_values, model_flags, set_path

METHOD_TYPES = ("supervised", "dpo")
# learning rate = base rate of the adapter kind, scaled to the model (finetune.auto) x learning_rate_multiplier
BASE_LEARNING_RATE = {"lora": 2e-4, "full": 2e-5}
DEFAULT_LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj_current", "v_proj_delayed", "o_proj")


def _auto_or(explained: str) -> WrapValidator:
    """The validator of an `"auto"`-or-number field: one error saying both (instead of one per union member)."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("auto_or_number", f'Input should be "auto" or {explained}') from None

    return WrapValidator(validate)


Epochs = Annotated[Literal["auto"] | Annotated[int, Field(ge=1, le=100)], _auto_or("an integer from 1 to 100")]
BatchSize = Annotated[Literal["auto"] | Annotated[int, Field(ge=1, le=1024)], _auto_or("an integer from 1 to 1024")]
Multiplier = Annotated[
    Literal["auto"] | Annotated[float, Field(gt=0, le=100, allow_inf_nan=False)], _auto_or("a number in (0, 100]")
]
Beta = Annotated[
    Literal["auto"] | Annotated[float, Field(gt=0, le=100, allow_inf_nan=False)], _auto_or("a number in (0, 100]")
]
Count = Annotated[int, Field(ge=1, le=1 << 40)]


class FinetuneError(ValueError):
    """A bad setting, input path or dataset; `field` names it ("train_file", "method.supervised.lora.r", ...)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


class Strict(BaseModel):
    # Strict: JSON's 3 is an integer, "3" is not (as OpenAI's API); the CLI parses its text into the field's type.
    model_config = ConfigDict(extra="forbid", strict=True)


class _Hyperparameters(Strict):
    """What every method shares: OpenAI's three, then ours."""

    n_epochs: Epochs = Field("auto", description="passes over the training set, or auto (from the dataset size)")
    batch_size: BatchSize = Field("auto", description="examples per optimizer step, or auto")
    learning_rate_multiplier: Multiplier = Field(
        "auto",
        description="x the auto learning rate (LoRA 2e-4, full 2e-5, scaled up for models narrower than 2048 and "
        "by the LoRA rank and alpha), or auto",
    )
    max_steps: Count | None = Field(None, description="stop after this many optimizer steps")
    max_seconds: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = Field(
        None, description="stop after this many seconds of training"
    )
    eval_every: Count | None = Field(
        None, description="evaluate and checkpoint every this many steps (default: once per epoch)"
    )
    early_stopping_patience: Count | None = Field(
        None, description="stop after this many evaluations without a better validation loss (needs validation data)"
    )
    max_seq_len: Annotated[int, Field(ge=2, le=1 << 24)] | None = Field(
        None, description="longest example in tokens (default: the model's context length)"
    )
    keep_checkpoints: Count | None = Field(
        None, description="keep only the newest this many checkpoints and the best (default: all)"
    )
    balancing_bias_lr: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] = Field(
        1e-3, description="full fine-tuning's router balancing-bias update rate, as in pretraining (0: off)"
    )
    gradient_checkpointing: bool = Field(
        False, description="recompute each layer in the backward pass: far less activation memory, ~one more forward"
    )
    compile: bool = Field(
        False,
        description="run each block's attention, routing and merge as compiled graphs: faster steps after the "
        "first, which compiles",
    )


class Hyperparameters(_Hyperparameters):
    """`method.supervised.hyperparameters`."""

    packing: bool = Field(True, description="pack examples into rows (no cross-example attention) instead of padding")


class DpoHyperparameters(_Hyperparameters):
    """`method.dpo.hyperparameters`: OpenAI's `beta` besides the shared ones."""

    beta: Beta = Field(
        "auto", description="DPO: how strongly the policy is held to the reference model (higher: closer), or auto"
    )


class LoraSettings(Strict):
    r: Annotated[int, Field(ge=1, le=1024)] = Field(8, description="LoRA rank")
    alpha: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        16.0, description="LoRA scale numerator (alpha/r)"
    )
    dropout: Annotated[float, Field(ge=0, lt=1)] = Field(0.0, description="dropout on the LoRA input")
    target_modules: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = Field(
        None,
        description="module names to adapt (default: the attention projections "
        + " ".join(DEFAULT_LORA_TARGET_MODULES)
        + ")",
    )
    target_experts: bool = Field(True, description="also adapt the fused experts (PEFT target_parameters)")

    @property
    def trains_template_tokens(self) -> bool:
        return False


class SupervisedLoraSettings(LoraSettings):
    """A supervised run's LoRA. A dpo run has no `train_template_tokens`: TRL's DPO scores answers with a fused LM
    head that reads the head's weight directly, past PEFT's token rows (and its starting model trained them)."""

    train_template_tokens: bool = Field(
        True,
        description="also train the embedding rows of the special tokens the chat template writes (<|im_start|>, "
        "<|im_end|>), which plain-text pretraining never trains (PEFT trainable_token_indices; such an adapter is "
        "served merged into its base)",
    )

    @property
    def trains_template_tokens(self) -> bool:
        return self.train_template_tokens


class _MethodSettings(Strict):
    """A method's block: OpenAI's `hyperparameters` (each method's own class), then ours."""

    hyperparameters: _Hyperparameters
    adapter: Annotated[Literal["lora", "full"], Cli(name="method")] = Field(
        "lora", description="lora: train a LoRA adapter; full: update every weight"
    )
    lora: LoraSettings = Field(default_factory=LoraSettings)
    merge_adapter: bool = Field(False, description="also merge the LoRA adapter into a full checkpoint")

    @field_validator("merge_adapter")
    @classmethod
    def _only_adapters_merge(cls, merge: bool, info: ValidationInfo) -> bool:
        if merge and info.data.get("adapter") == "full":
            raise PydanticCustomError(
                "invalid_combination", "only a LoRA run has an adapter to merge (adapter is full)"
            )
        return merge


class SupervisedSettings(_MethodSettings):
    """`method.supervised`: OpenAI's `hyperparameters`, then ours."""

    hyperparameters: Annotated[Hyperparameters, Cli(flatten=True)] = Field(default_factory=Hyperparameters)
    lora: SupervisedLoraSettings = Field(default_factory=SupervisedLoraSettings)


class DpoSettings(_MethodSettings):
    """`method.dpo`: trains on preference pairs against the frozen starting model."""

    hyperparameters: Annotated[DpoHyperparameters, Cli(flatten=True)] = Field(default_factory=DpoHyperparameters)


class FineTuneSettings(Strict):
    """OpenAI's `method`: the type, and that type's block (filled with defaults when omitted)."""

    type: Literal["supervised", "dpo"] = Field("supervised", description="training method: supervised or dpo")
    # Validated even when omitted, so the chosen one is filled with its defaults.
    supervised: Annotated[SupervisedSettings | None, Cli(flatten=True)] = Field(None, validate_default=True)
    dpo: Annotated[DpoSettings | None, Cli(flatten=True)] = Field(None, validate_default=True)

    @field_validator("supervised", "dpo", mode="after")
    @classmethod
    def _block_of_the_type(cls, block: _MethodSettings | None, info: ValidationInfo) -> _MethodSettings | None:
        chosen = info.data.get("type")
        if chosen is None:  # the type itself was invalid; that error is reported
            return block
        if info.field_name != chosen:
            if block is not None:
                raise PydanticCustomError("invalid_combination", f"given but type is {chosen!r}")
            return None
        return block if block is not None else (DpoSettings() if chosen == "dpo" else SupervisedSettings())

    @property
    def method(self) -> SupervisedSettings | DpoSettings:
        """The chosen type's block (validation fills it)."""
        block = self.dpo if self.type == "dpo" else self.supervised
        if block is None:
            raise ValueError(f"method.{self.type} is missing")
        return block

    @property
    def hyperparameters(self) -> Hyperparameters | DpoHyperparameters:
        return self.method.hyperparameters

    @property
    def adapter(self) -> str:
        return self.method.adapter

    @property
    def lora(self) -> LoraSettings:
        return self.method.lora

    @property
    def data_parallelism(self) -> str:
        """How several processes train one run: full fine-tuning shards parameters, gradients and optimizer state
        (FSDP2), LoRA's few trainable weights are replicated (DDP)."""
        return "FSDP2" if self.adapter == "full" else "DDP"

    def dataset_format_problem(self, found: str | None) -> str | None:
        """Why a dataset in format `found` (a validation report's) cannot train these settings, or None: a dpo run
        needs preference data, a supervised run any other format."""
        if self.type == "dpo" and found != "preference":
            return (
                f"is in {found} format; a dpo job needs preference data "
                "(input, preferred_output and non_preferred_output on each line)"
            )
        if self.type == "supervised" and found == "preference":
            return "is preference data; train on it with method type dpo"
        return None

    def setting(self, *names: str) -> str:
        """The full name of a setting of the chosen block: ("lora", "r") -> "method.supervised.lora.r"."""
        return ".".join(("method", self.type, *names))

    def check_inputs(self, *, has_validation_file: bool) -> None:
        """What the settings ask of a run's inputs; FinetuneError naming the setting."""
        if self.hyperparameters.early_stopping_patience is not None and not has_validation_file:
            raise FinetuneError(
                self.setting("hyperparameters", "early_stopping_patience"),
                "needs a validation file to measure the validation loss",
            )

    @classmethod
    def from_options(cls, type: str = "supervised", **options: Any) -> FineTuneSettings:
        """Settings from `zaya finetune`'s flag names (`lora_r=4`, `method="full"`, `n_epochs=2`): one flat
        vocabulary for scripts and tests, mapped by the same generated flags. Raises ValidationError."""
        by_name = {flag.dest: flag for flag in cli_flags() if flag.path[0] in ("type", type)}
        unknown = set(options) - set(by_name)
        if unknown:
            raise TypeError(f"unknown fine-tuning options for type {type!r}: {', '.join(sorted(unknown))}")
        values: dict[str, Any] = {"type": type}
        for name, value in options.items():
            set_path(values, by_name[name].path, value)
        return cls.model_validate(values)


def cli_flags() -> list[Flag]:
    """`zaya finetune`'s settings flags: `--type`, then every method's (a name shared by two methods appears once
    per method, with the same field)."""
    return model_flags(FineTuneSettings)


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    from command_line.flags import add_flags

    unique: dict[str, Flag] = {}
    for flag in cli_flags():
        unique.setdefault(flag.dest, flag)
    add_flags(parser.add_argument_group("fine-tuning settings (as the API's method object)"), list(unique.values()))


def settings_from_flags(namespace: argparse.Namespace) -> FineTuneSettings:
    """The settings a command line gives; FlagError names the flag at fault."""
    flags = cli_flags()
    chosen_type = getattr(namespace, "type", "supervised")
    chosen = [flag for flag in flags if flag.path[0] in ("type", chosen_type)]
    names = {flag.dest for flag in chosen}
    for flag in flags:
        if flag.dest not in names and hasattr(namespace, flag.dest):
            raise FlagError(flag.option, f"only applies with --type {flag.path[0]}")
    try:
        return FineTuneSettings.model_validate(flag_values(chosen, namespace))
    except ValidationError as error:
        raise flag_error(chosen, error) from None
