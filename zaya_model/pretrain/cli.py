"""`zaya pretrain`: pretrain a ZAYA model on a corpus; rerunning with the same `--output` resumes."""

from __future__ import annotations

import argparse

# Exit status after a SIGTERM checkpoint: 128 + SIGTERM, the shell convention, so a supervisor sees "not finished".
EXIT_INTERRUPTED = 143


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "pretrain",
        help="pretrain a ZAYA model on a text corpus (resumable)",
        description="Pretrain a ZAYA model on text files or JSONL with a `text` field (a file or a directory). "
        "Trains a tokenizer when none is given. Rerun with the same --output to resume from its last checkpoint.",
    )
    parser.add_argument("--data", required=True, help="corpus: a .txt/.jsonl file or a directory of them")
    parser.add_argument("--output", required=True, help="run directory: checkpoints, metrics, final model")
    # Checked when the command runs: importing the presets here would load torch for every `zaya` command.
    parser.add_argument("--preset", default="tiny", help="model shape and settings: tiny or zaya1-base")
    parser.add_argument("--max-steps", type=int, help="optimizer steps in total")
    parser.add_argument("--seq-len", type=int, help="tokens per packed row")
    parser.add_argument("--seed", type=int, help="seed for initialisation, data order and the validation split")
    parser.add_argument("--batch-size", type=int, help="rows per micro-batch")
    parser.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step")
    parser.add_argument("--optimizer", choices=["adamw", "muon"], help="muon: Muon for 2-D weights, AdamW for the rest")
    parser.add_argument("--lr", type=float, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int)
    parser.add_argument("--dtype", choices=["auto", "fp32", "bf16"], help="auto: bf16 autocast on capable GPUs")
    parser.add_argument("--sharding", choices=["none", "fsdp"],
                        help="fsdp: FSDP2-shard model and optimizer under torchrun, one checkpoint shard per rank")
    parser.add_argument("--vocab-size", type=int, dest="tokenizer_vocab_size", metavar="N",
                        help="vocabulary size of a trained tokenizer")
    parser.add_argument("--tokenizer", help="use this tokenizer directory instead of training one")
    parser.add_argument("--validation-fraction", type=float, help="share of documents held out")
    parser.add_argument("--eval-every", type=int)
    parser.add_argument("--save-every", type=int)
    parser.add_argument("--keep-last", type=int, help="checkpoints kept besides the best")
    parser.add_argument("--compile", action="store_true", default=None,
                        help="run each block's attention, routing and merge as compiled graphs (torch.compile): "
                        "faster steps after the first, which compiles")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


_SETTING_FLAGS = (
    "max_steps", "seq_len", "seed", "batch_size", "grad_accum", "optimizer", "lr", "warmup_steps", "dtype",
    "sharding", "tokenizer_vocab_size", "validation_fraction", "eval_every", "save_every", "keep_last", "compile",
)


def run(args: argparse.Namespace) -> int:
    from zaya_cli import CommandError

    from ..training.checkpointing import CheckpointWriteError
    from ..training.runtime import prepare_training_process
    from .corpus import CorpusError
    from .presets import get_preset
    from .train import Pretrainer, PretrainError

    prepare_training_process()  # this process only trains
    overrides = {name: getattr(args, name) for name in _SETTING_FLAGS if getattr(args, name) is not None}
    try:
        settings = get_preset(args.preset).replace(**overrides)
        trainer = Pretrainer(args.data, args.output, settings, tokenizer_path=args.tokenizer,
                             progress=not args.no_progress)
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
