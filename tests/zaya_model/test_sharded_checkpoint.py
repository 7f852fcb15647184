"""FSDP2 pretraining on 2 gloo CPU processes with per-rank `torch.distributed.checkpoint` shards, resharded on resume.

Tolerance: all runs are fp32 and see the same global batches; they differ only in how gradients are summed (FSDP
reduce-scatters per-rank partial sums, one process sums in a single backward), which moves the loss by float32
rounding (~1e-7 relative per step). Over 4 steps at lr 1e-2 that stays far below 1e-5, while a wrong shard, a lost
optimizer moment or a misplaced data position changes the loss by 1e-3 or more (see the resume test in
test_pretrain.py, which uses the same micro model).
"""

import json
import multiprocessing

import pytest
import torch
from pretrain_helpers import MICRO as PRETRAIN_MICRO
from pretrain_helpers import step_losses, train_rank

from zaya_cli.main import main
from zaya_model import ZayaForCausalLM
from zaya_model.pretrain.train import Pretrainer, PretrainError

MICRO = PRETRAIN_MICRO.replace(batch_size=4, max_steps=4)


def run_two_ranks(tmp_path, name, corpus, output, settings, tokenizer_dir, until_step=None):
    """Two forked gloo ranks (forked: no second interpreter start-up); fails with the ranks' tracebacks."""
    context = multiprocessing.get_context("fork")
    init = tmp_path / f"init-{name}"
    args = (init, corpus, output, settings, tokenizer_dir, until_step)
    ranks = [context.Process(target=train_rank, args=(rank, 2, *args)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
        process.kill()
    errors = "".join(path.read_text() for path in tmp_path.glob(f"init-{name}.rank*.error"))
    assert [process.exitcode for process in ranks] == [0, 0], errors


@pytest.mark.slow
def test_fsdp_shards_resume_on_one_process_and_back_on_two(corpus, tokenizer_dir, tmp_path):
    reference = tmp_path / "reference"
    Pretrainer(corpus, reference, MICRO, tokenizer_path=tokenizer_dir).train()

    sharded, output = MICRO.replace(sharding="fsdp"), tmp_path / "sharded"
    # 2 ranks x batch 2, steps 1-2: each rank writes its own shard file of the step-2 checkpoint.
    run_two_ranks(tmp_path, "a", corpus, output, sharded.replace(batch_size=2), tokenizer_dir, until_step=2)
    shards = output / "checkpoints" / "checkpoint-2" / "distributed"
    assert sorted(p.name for p in shards.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (output / "checkpoints" / "checkpoint-2" / "model.safetensors").exists()

    # 1 process x batch 4 resumes the 2-rank checkpoint (DCP reshards into whole tensors), step 3...
    single = Pretrainer(corpus, output, sharded, tokenizer_path=tokenizer_dir)
    assert single.step == 2
    single.train(until_step=3)
    assert sorted(p.name for p in (output / "checkpoints" / "checkpoint-3" / "distributed").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
    ]
    # ...and 2 ranks resume the 1-process checkpoint (split into shards again) for step 4, then export.
    run_two_ranks(tmp_path, "b", corpus, output, sharded.replace(batch_size=2), tokenizer_dir)

    expected, got = step_losses(reference), step_losses(output)
    assert sorted(got) == [1, 2, 3, 4]
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, abs=1e-5), step
    # The exported model is the ranks' final state, gathered from their shards into one ordinary `save_pretrained`
    # checkpoint. (Compared with the shards, not with the one-process run: AdamW's first steps move a weight by about
    # the learning rate whatever its gradient's size, so where a gradient is near zero the summation order shows.)
    exported = ZayaForCausalLM.from_pretrained(output)
    assert json.loads((output / "config.json").read_text())["architectures"] == ["ZayaForCausalLM"]  # for vLLM
    final = Pretrainer(corpus, output, sharded, tokenizer_path=tokenizer_dir)  # resumes the step-4 shards
    assert final.step == 4
    for (name, a), b in zip(final.model.state_dict().items(), exported.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert (output / "loss.png").stat().st_size > 0
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    written = [r for r in records if r.get("event") == "checkpoint_written"]
    assert [r["step"] for r in written] == [0, 2, 3, 4]  # each with the stall next to the background write time
    assert all(0 <= r["wait_s"] <= r["stall_s"] and r["shards_s"] > 0 for r in written)


def test_sharded_runs_reject_muon_and_resuming_unsharded_checkpoints(corpus, tokenizer_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match="fsdp needs optimizer adamw \\(Muon needs whole matrices\\)"):
        MICRO.replace(sharding="fsdp", optimizer="muon")
    argv = [
        "pretrain",
        "--data",
        str(corpus),
        "--output",
        str(tmp_path / "x"),
        "--sharding",
        "fsdp",
        "--optimizer",
        "muon",
        "--no-progress",
    ]
    assert main(argv) == 1
    assert "Muon needs whole matrices" in capsys.readouterr().err
    Pretrainer(corpus, tmp_path / "run", MICRO.replace(max_steps=1), tokenizer_path=tokenizer_dir).train()
    with pytest.raises(PretrainError, match="different settings \\(sharding\\)"):
        Pretrainer(corpus, tmp_path / "run", MICRO.replace(sharding="fsdp"), tokenizer_path=tokenizer_dir)


def _train_step(model, optimizer, seed: int) -> None:
    ids = torch.randint(3, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _snapshot(model, optimizer) -> list[torch.Tensor]:
    moments = [optimizer.state[p][key] for p in model.parameters() for key in ("exp_avg", "exp_avg_sq")]
    return [t.detach().clone() for t in (*model.state_dict().values(), *moments)]


def test_each_sharded_save_holds_its_own_step_though_the_staging_copy_is_reused(tokenizer_dir, tmp_path):
    from tiny_models import TINY_ZAYA
    from transformers import AutoTokenizer

    from zaya_model import ZayaConfig
    from zaya_model.training.checkpointer import Checkpointer

    def build():
        torch.manual_seed(0)
        model = ZayaForCausalLM(ZayaConfig(**TINY_ZAYA))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, optimizer = build()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    manager = Checkpointer(tmp_path, model, [optimizer], {}, tokenizer, keep_last=3, sharded=True)
    expected = {}
    for step in (1, 2, 3):
        _train_step(model, optimizer, seed=step)
        manager.save(step)
        expected[step] = _snapshot(model, optimizer)
        # Training goes on while the shards are written: the write must hold the values at the save. (Changing
        # every weight and moment at once, while the writer has barely started, shows a write reading live state.)
        with torch.no_grad():
            for tensor in (*model.parameters(), *(s[k] for s in optimizer.state.values() for k in ("exp_avg",))):
                tensor.add_(1e-3)
        _train_step(model, optimizer, seed=10 + step)
        if step == 2:
            manager.release()  # as training's end does: the next save stages into a new copy
    manager.wait()
    for step, values in expected.items():
        loaded, loaded_optimizer = build()
        _train_step(loaded, loaded_optimizer, seed=99)  # moments to load into
        reader = Checkpointer(tmp_path, loaded, [loaded_optimizer], {}, tokenizer, keep_last=3, sharded=True)
        reader.load(manager.path(step))
        for got, want in zip(_snapshot(loaded, loaded_optimizer), values, strict=True):
            assert torch.equal(got, want), step
