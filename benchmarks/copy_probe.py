"""Does a model copy values from its context? Two probes behind the quality table's copying rows.

Run: `python -m benchmarks.copy_probe induction [--distance 100] [--offset varied|fixed] [--steps 2000]` or
`python -m benchmarks.copy_probe notes --base DIR [--cases 40]`

- **induction**: a fresh ZAYA (two layers unless `--layers`) learns to repeat a block of random tokens it has just
  read (loss on the repeat only). The loss falls from ln(vocab) to near 0 once the model copies; the step where it
  first falls below 1 nat is reported. With `--offset varied` (the default) each row's block has its own length,
  from 8 tokens to `--distance`, so the copy sits a different distance back in every row: the model has to find the
  earlier occurrence of the current token and copy what followed it (an induction head), the skill that copies a
  value from a case file into an answer. With `--offset fixed` every block is `--distance` long, and a head that
  attends a fixed number of tokens back solves it without matching content: far easier, and not the skill the
  answers need.
- **notes**: a pretrained base (`zaya pretrain`'s output, trained on `zaya data sample`'s corpus of closed cases)
  writes the closing note of held-out flagged case files, greedy; exact match against the investigator's note. A
  base that copies writes the case's similarity score, country and deposit count; one that does not writes the
  values most common in its corpus.

Prints a table and writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from benchmarks import environment

DEFAULT_OUT = environment.default_out("copy_probe")
VOCAB = 256
COPIED_LOSS = 1.0  # nats: well below ln(VOCAB) = 5.5, the loss of a model that does not copy
MIN_BLOCK = 8  # the shortest block `--offset varied` repeats
NOTES_SEED = 100  # held-out cases: other than the corpus's (`write_corpus`, seed 7) and the chats' (seeds 1, 2)


def copy_batch(rows: int, distance: int, varied: bool):
    """`(input_ids, labels)`: each row is BOS, a block of random tokens and its repeat, then random tokens up to
    `2 * distance + 1`; labels only on the repeat's tokens after its first (each one is predictable from the block).
    `varied`: each row's block is `MIN_BLOCK` to `distance` tokens long; otherwise every block is `distance` long."""
    import torch

    ids = torch.randint(3, VOCAB, (rows, 2 * distance + 1))
    ids[:, 0] = 0
    labels = torch.full_like(ids, -100)
    lengths = torch.randint(MIN_BLOCK, distance + 1, (rows,)) if varied else torch.full((rows,), distance)
    for row, length in enumerate(lengths.tolist()):
        ids[row, 1 + length : 1 + 2 * length] = ids[row, 1 : 1 + length]
        labels[row, 2 + length : 1 + 2 * length] = ids[row, 2 + length : 1 + 2 * length]
    return ids, labels


def induction(args: argparse.Namespace) -> dict:
    import torch

    from zaya_model import ZayaConfig, ZayaForCausalLM

    torch.manual_seed(args.seed)
    rope = {"rope_type": "default", "rope_theta": args.rope_theta, "partial_rotary_factor": args.partial_rotary_factor}
    config = ZayaConfig(
        vocab_size=VOCAB,
        hidden_size=args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.width // 4,
        moe_intermediate_size=args.width,
        num_experts=4,
        router_hidden_size=64,
        max_position_embeddings=2 * args.distance + 2,
        rope_parameters=rope,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    model = ZayaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses, copied_at = [], None
    for step in range(1, args.steps + 1):
        ids, labels = copy_batch(args.batch, args.distance, varied=args.offset == "varied")
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 4))
        if copied_at is None and loss.item() < COPIED_LOSS:
            copied_at = step
    return {"losses": losses, "final_loss": losses[-1], "copied_at_step": copied_at}


def notes(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoTokenizer

    from finetune.datasets.sample import closed_case_text
    from finetune.datasets.styles import get_style
    from finetune.datasets.synthetic import explain_disposition, generate_cases, render_case_file
    from zaya_model import ZayaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    model = ZayaForCausalLM.from_pretrained(args.base).eval()
    style = get_style(args.variant)
    cases = [case for case in generate_cases(4 * args.cases, seed=NOTES_SEED + args.seed) if case.red_flags][
        : args.cases
    ]
    misses = []
    for case in cases:
        text = closed_case_text(render_case_file(case, style), note="")
        prompt = [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]]
        with torch.no_grad():
            output = model.generate(
                torch.tensor([prompt]), max_new_tokens=96, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        note = str(tokenizer.decode(output[0, len(prompt) :], skip_special_tokens=True)).strip()
        expected = explain_disposition(case, style)
        if not note.startswith(expected):  # a corpus document may go on after its note
            misses.append({"expected": expected, "written": note})
    return {"cases": len(cases), "exact_match": round(1 - len(misses) / len(cases), 4), "misses": misses}


def print_table(report: dict) -> None:
    rows: list[tuple[object, ...]]
    if report["probe"] == "induction":
        rows = [
            ("offset", "distance", "rope theta", "rotary share", "steps", "final loss", "copied at step"),
            (
                report["offset"],
                report["distance"] if report["offset"] == "fixed" else f"{MIN_BLOCK}-{report['distance']}",
                f"{report['rope_theta']:g}",
                report["partial_rotary_factor"],
                report["steps"],
                report["final_loss"],
                report["copied_at_step"] or "not within the run",
            ),
        ]
    else:
        rows = [
            ("base", "flagged cases", "closing note exact match"),
            (report["base"], report["cases"], report["exact_match"]),
        ]
    print(environment.format_rows(rows))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("probe", choices=("induction", "notes"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    group = parser.add_argument_group("induction")
    group.add_argument("--distance", type=int, default=100, help="tokens between a token and its copy (the most)")
    group.add_argument(
        "--offset", choices=("varied", "fixed"), default="varied", help="each row's distance its own, or all the same"
    )
    group.add_argument("--rope-theta", type=float, default=5e6, help="RoPE base (ZAYA1's: 5e6)")
    group.add_argument("--partial-rotary-factor", type=float, default=0.5, help="share of each head RoPE rotates")
    group.add_argument("--width", type=int, default=128)
    group.add_argument("--layers", type=int, default=2)
    group.add_argument("--batch", type=int, default=16)
    group.add_argument("--steps", type=int, default=2000)
    group.add_argument("--lr", type=float, default=3e-3)
    group = parser.add_argument_group("notes")
    group.add_argument("--base", help="a pretrained base model directory")
    group.add_argument("--cases", type=int, default=40, help="held-out flagged case files")
    group.add_argument("--variant", default="standard", help="the corpus's wording (zaya data sample --variant)")
    args = parser.parse_args(argv)
    if args.probe == "notes" and args.base is None:
        parser.error("notes needs --base")
    if args.distance < MIN_BLOCK:
        parser.error(f"--distance must be at least {MIN_BLOCK}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    environment.use_threads(args.threads)
    report = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python -m benchmarks.copy_probe", *sys.argv[1:]]),
        **{key: value for key, value in vars(args).items() if key != "out"},
        **(induction(args) if args.probe == "induction" else notes(args)),
    }
    environment.publish_report(args.out, report, print_table)


if __name__ == "__main__":
    main()
