"""`zaya pretrain`: pretrain a ZAYA model on a corpus; rerunning with the same `--output` resumes."""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import ValidationError

from command_line.flags import Flag, FlagError, add_flags, flag_error, flag_values, model_flags

from .settings import PretrainSettings

# Exit status after a SIGTERM checkpoint: 128 + SIGTERM, the shell convention, so a supervisor sees "not finished".
EXIT_INTERRUPTED = 143


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "pretrain",
        help="pretrain a ZAYA model on a text corpus (resumable)",
        description="Pretrain a ZAYA model on text files or JSONL with a `text` field (a file or a directory). "
        "Trains a tokenizer when none is given. Rerun with the same --output to resume from its last checkpoint.",
    )
    parser.add_argument("--data", required=True, help="corpus: a .txt/.jsonl file or a directory of them")
    parser.add_argument("--output", required=True, help="run directory: checkpoints, metrics, final model")
    # Checked when the command runs: importing the presets here would load torch for every `zaya` command.
    parser.add_argument(
        "--preset", default="tiny", help="model shape and settings: tiny, cpu (for chat fine-tuning) or zaya1-base"
    )
    parser.add_argument("--tokenizer", help="use this tokenizer directory instead of training one")
    parser.add_argument(
        "--init-from",
        metavar="MODEL_DIR",
        help="go on training this saved model (continued pretraining, e.g. on a bank's own corpus): its weights, "
        "shape and tokenizer; the preset and flags give the rest",
    )
    flags = model_flags(PretrainSettings)
    group = parser.add_argument_group("pretraining settings (each overrides the preset's value)")
    add_flags(group, flags, **{flag.dest: "the preset's" for flag in flags})
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from command_line import CommandError

    from ..training.checkpoint_dirs import CheckpointWriteError
    from ..training.runtime import prepare_training_process
    from .corpus import CorpusError
    from .presets import get_preset
    from .train import Pretrainer, PretrainError

    flags = model_flags(PretrainSettings)
    try:
        preset = get_preset(args.preset)
        given = flag_values(flags, args)
        shape = {} if args.init_from is None else {"model": _shape_to_start_from(args, flags, given)}
        settings = PretrainSettings.model_validate({**preset.model_dump(), **shape, **given})
    except FlagError as error:
        raise CommandError(str(error)) from None
    except ValidationError as error:
        raise CommandError(str(flag_error(flags, error))) from None
    except ValueError as error:
        raise CommandError(str(error)) from None
    prepare_training_process()  # this process only trains
    try:
        trainer = Pretrainer(
            args.data,
            args.output,
            settings,
            tokenizer_path=args.tokenizer,
            progress=not args.no_progress,
            init_from=args.init_from,
        )
        result = trainer.train()
    except (CorpusError, PretrainError, CheckpointWriteError, ValueError, OSError) as error:
        raise CommandError(str(error)) from None
    if not trainer.dist.is_main:  # under torchrun, rank 0 reports
        return EXIT_INTERRUPTED if result.status == "interrupted" else 0
    timings = trainer.checkpoint_timings
    if timings:
        stall = sum(t["stall_s"] for t in timings) / len(timings)
        if "save_pretrained_s" in timings[0]:
            blocking = sum(t["save_pretrained_s"] for t in timings) / len(timings)
            compared = f"a synchronous save_pretrained takes {blocking:.3f} s"
        else:  # sharded: what writing the shards took in the background
            blocking = sum(t["shards_s"] for t in timings) / len(timings)
            compared = f"writing the shards took {blocking:.3f} s"
        print(f"checkpoints: {len(timings)} written, training stalled {stall:.3f} s per save ({compared})")
    if result.status == "interrupted":
        print(f"stopped at step {result.step}; checkpoint saved, rerun the same command to resume")
        return EXIT_INTERRUPTED
    val = f", validation loss {result.val_loss:.4f}" if result.val_loss is not None else ""
    print(f"trained {result.step} steps{val}; model and tokenizer in {args.output}")
    return 0


def _shape_to_start_from(args: argparse.Namespace, flags: list[Flag], given: dict[str, Any]) -> dict[str, Any]:
    """The shape of the `--init-from` model; the options it makes moot are refused."""
    from ..configuration_zaya import ZayaConfig
    from .settings import model_shape

    moot = ["--tokenizer"] if args.tokenizer is not None else []
    moot += [flag.option for flag in flags if flag.path[0].startswith("tokenizer_") and flag.path[0] in given]
    if moot:
        raise FlagError(moot[0], "the model of --init-from brings its own tokenizer")
    try:
        return model_shape(ZayaConfig.from_pretrained(args.init_from))
    except (OSError, ValueError) as error:
        raise FlagError("--init-from", f"cannot start from {args.init_from}: {error}") from None
