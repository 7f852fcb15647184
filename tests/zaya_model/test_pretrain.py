"""`zaya pretrain` end to end on a micro model: exact resume, SIGTERM, rollback, checkpoint retention, balancing."""

import contextlib
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from compile_helpers import no_cpp_compiler
from pretrain_helpers import MICRO, metrics, step_losses, straight_and_resumed, train_rank
from safetensors.torch import load_file

from zaya_cli.main import main
from zaya_model import ZayaForCausalLM
from zaya_model.cpu.compiled_layers import compiled_layers_enabled
from zaya_model.pretrain.plot import read_losses
from zaya_model.pretrain.settings import model_shape
from zaya_model.pretrain.tokenizer import train_tokenizer
from zaya_model.pretrain.train import Pretrainer, PretrainError, clip_gradients
from zaya_model.training.callbacks import TrainingHooks
from zaya_model.training.checkpoint_dirs import latest_checkpoint
from zaya_model.training.checkpointer import Checkpointer, load_training_state


@pytest.mark.parametrize("sharding", ["none", "fsdp"])  # save_pretrained + torch.save, or DCP checkpoints
def test_interrupted_and_resumed_run_matches_an_uninterrupted_one(corpus, tokenizer_dir, tmp_path, sharding):
    # Stopped at step 4, between checkpoints (every 3).
    straight, second = straight_and_resumed(corpus, tokenizer_dir, tmp_path, MICRO, MICRO.replace(sharding=sharding))
    expected, got = step_losses(tmp_path / "straight"), step_losses(tmp_path / "resumed")
    assert sorted(got) == list(range(1, 7))
    for step in expected:
        assert abs(expected[step] - got[step]) <= 1e-6, step
    for (name, a), b in zip(straight.model.state_dict().items(), second.model.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), name


def test_cli_trains_a_loadable_model_and_rerun_resumes(corpus, tmp_path):
    output = tmp_path / "run"
    common = [
        "pretrain",
        "--data",
        str(corpus),
        "--output",
        str(output),
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--vocab-size",
        "320",
        "--dtype",
        "fp32",
        "--save-every",
        "2",
        "--eval-every",
        "2",
        "--no-progress",
    ]
    assert main([*common, "--max-steps", "2"]) == 0
    assert main([*common, "--max-steps", "4"]) == 0
    events = metrics(output)
    assert any(e.get("event") == "resumed" and e["step"] == 2 for e in events)
    assert sorted(step_losses(output)) == [1, 2, 3, 4]

    ours = ZayaForCausalLM.from_pretrained(output).eval()
    stock = transformers.ZayaForCausalLM.from_pretrained(output).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(output)
    ids = tokenizer("Customer: Omar Tanaka, student", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.allclose(ours(ids).logits, stock(ids).logits, atol=1e-5)
    trained = load_training_state(output / "checkpoints" / "checkpoint-4")
    assert trained["trainer"]["step"] == 4
    assert (output / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the loss curve, redrawn per checkpoint
    train_losses, val_losses = read_losses(output / "metrics.jsonl")
    assert sorted(train_losses) == [1, 2, 3, 4] and sorted(val_losses) == [2, 4]
    assert ours.config.vocab_size >= len(tokenizer)
    assert tokenizer.chat_template


def test_init_from_goes_on_training_a_saved_model_with_its_tokenizer(corpus, tmp_path, capfd):
    common = ["pretrain", "--data", str(corpus), "--seq-len", "32", "--batch-size", "2", "--dtype", "fp32"]
    common += ["--save-every", "2", "--eval-every", "2", "--no-progress", "--preset", "tiny"]
    first = tmp_path / "first"
    assert main([*common, "--output", str(first), "--vocab-size", "320", "--max-steps", "2"]) == 0
    saved = ZayaForCausalLM.from_pretrained(first)

    # Step 0 of the new run is the saved model, tokenizer included; the settings carry its shape.
    shape = model_shape(saved.config)
    trainer = Pretrainer(corpus, tmp_path / "direct", MICRO.replace(model=shape), init_from=first)
    for (name, ours), theirs in zip(trainer.model.state_dict().items(), saved.state_dict().values(), strict=True):
        assert torch.equal(ours, theirs), name
    assert trainer.tokenizer.get_vocab() == transformers.AutoTokenizer.from_pretrained(first).get_vocab()
    with pytest.raises(PretrainError, match="model shape is not the shape of"):
        Pretrainer(corpus, tmp_path / "other", MICRO, init_from=first)
    with pytest.raises(PretrainError, match="brings its own tokenizer"):
        Pretrainer(corpus, tmp_path / "other", MICRO.replace(model=shape), init_from=first, tokenizer_path=first)
    assert not (tmp_path / "other").exists()

    # The command: it trains on from there, resumes when rerun, and a rerun naming another start is refused.
    second = tmp_path / "second"
    continued = [*common, "--output", str(second), "--init-from", str(first)]
    assert main([*continued, "--max-steps", "2"]) == 0
    assert main([*continued, "--max-steps", "4"]) == 0
    assert sorted(step_losses(second)) == [1, 2, 3, 4]
    assert step_losses(second)[1] < step_losses(first)[1]  # it starts where the first run ended, not from scratch
    assert json.loads((second / "run.json").read_text())["init_from"] == str(first.resolve())
    capfd.readouterr()
    assert main([*common, "--output", str(second), "--max-steps", "6"]) == 1
    assert "init_from); use a new --output" in capfd.readouterr().err

    # Options the saved model makes moot, and a directory without a model, are refused before anything is written.
    refused = tmp_path / "refused"
    for extra, message in [
        (["--init-from", str(first), "--vocab-size", "512"], "--vocab-size: the model of --init-from brings its own"),
        (["--init-from", str(first), "--tokenizer", str(first)], "--tokenizer: the model of --init-from brings its"),
        (["--init-from", str(tmp_path / "nothing")], "--init-from: cannot start from"),
    ]:
        assert main([*common, "--output", str(refused), *extra]) == 1
        assert message in capfd.readouterr().err
    assert not refused.exists()


def _run_cli(argv, stdout_path):
    with open(stdout_path, "w") as stdout, contextlib.redirect_stdout(stdout):
        code = main(argv)
    sys.exit(code)


def test_sigterm_saves_a_checkpoint_and_exits_for_a_restart(corpus, tokenizer_dir, tmp_path):
    import multiprocessing

    output = tmp_path / "run"
    argv = [
        "pretrain",
        "--data",
        str(corpus),
        "--output",
        str(output),
        "--tokenizer",
        str(tokenizer_dir),
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--dtype",
        "fp32",
        "--max-steps",
        "100000",
        "--save-every",
        "100000",
        "--no-progress",
    ]
    # A forked child runs the real command (a fresh interpreter would spend most of the test importing torch).
    process = multiprocessing.get_context("fork").Process(target=_run_cli, args=(argv, tmp_path / "stdout"))
    process.start()
    try:
        deadline = time.monotonic() + 60
        while not ((output / "metrics.jsonl").is_file() and step_losses(output)):
            assert process.is_alive(), f"training exited early with status {process.exitcode}"
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.1)
        os.kill(process.pid, signal.SIGTERM)
        process.join(timeout=60)
    finally:
        process.kill()
    assert process.exitcode == 143
    assert "rerun the same command to resume" in (tmp_path / "stdout").read_text()
    last_step = max(step_losses(output))
    saved = latest_checkpoint(output / "checkpoints")
    assert saved.name == f"checkpoint-{last_step}"
    assert load_training_state(saved)["trainer"]["step"] == last_step
    assert any(e.get("event") == "stopped" and e["reason"] == "sigterm" for e in metrics(output))


class PauseAt(TrainingHooks):
    def __init__(self, step):
        self.pause_step, self.metric_steps, self.checkpoint_steps, self.events = step, [], [], []

    def on_metrics(self, step, metrics):
        self.metric_steps.append(step)

    def on_checkpoint(self, step, path, metrics):
        self.checkpoint_steps.append(step)
        assert Path(path).is_dir() and metrics["save_pretrained_s"] > 0

    def on_event(self, level, message, data=None):
        self.events.append(message)

    def should_stop(self):
        return "pause" if self.metric_steps[-1] >= self.pause_step else None


def test_hooks_see_metrics_and_checkpoints_and_can_pause_the_run(corpus, tokenizer_dir, tmp_path):
    hooks = PauseAt(2)
    trainer = Pretrainer(corpus, tmp_path / "run", MICRO, tokenizer_path=tokenizer_dir, hooks=hooks)
    result = trainer.train()
    assert (result.status, result.step) == ("interrupted", 2)
    assert hooks.metric_steps == [1, 2] and hooks.checkpoint_steps == [0, 2]
    assert any("pause" in event for event in hooks.events)
    assert Pretrainer(corpus, tmp_path / "run", MICRO, tokenizer_path=tokenizer_dir).step == 2


class NaNOnForward:
    """A forward hook that turns the embeddings into NaN on chosen training forwards (counted from 1)."""

    def __init__(self, model, poisoned_calls):
        self.calls = 0
        self.poisoned_calls = poisoned_calls
        model.model.embed_tokens.register_forward_hook(self)

    def __call__(self, module, inputs, output):
        if not module.training:
            return None
        self.calls += 1
        return output * float("nan") if self.calls in self.poisoned_calls else None


@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_non_finite_step_rolls_back_and_skips_the_batch(corpus, tokenizer_dir, tmp_path, sharding):
    settings = MICRO.replace(save_every=2, eval_every=2, sharding=sharding)
    trainer = Pretrainer(corpus, tmp_path / "run", settings, tokenizer_path=tokenizer_dir)
    NaNOnForward(trainer.model, poisoned_calls={4})  # step 4: after the checkpoint at step 2
    assert trainer.train().step == 6

    events = metrics(tmp_path / "run")
    rollback = next(e for e in events if e.get("event") == "rollback")
    assert rollback["failed_step"] == 4 and rollback["batch"] == 3
    assert rollback["checkpoint"] == "checkpoint-2" and rollback["resumed_step"] == 2
    assert any(e.get("event") == "skipped_batch" and e["batch"] == 3 for e in events)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    # Step 3 is redone from the checkpoint on the same batch: same loss as before the rollback.
    step3 = [m["loss"] for m in events if m.get("step") == 3 and "loss" in m]
    assert len(step3) == 2 and abs(step3[0] - step3[1]) <= 1e-6
    assert load_training_state(tmp_path / "run" / "checkpoints" / "checkpoint-6")["trainer"]["skipped_batches"] == [3]


def test_repeated_failures_stop_the_run(corpus, tokenizer_dir, tmp_path):
    settings = MICRO.replace(max_rollbacks=2)
    trainer = Pretrainer(corpus, tmp_path / "run", settings, tokenizer_path=tokenizer_dir)
    NaNOnForward(trainer.model, poisoned_calls=set(range(2, 100)))
    with pytest.raises(PretrainError, match="non-finite steps since the last checkpoint"):
        trainer.train()
    assert sum(e.get("event") == "rollback" for e in metrics(tmp_path / "run")) == 2


class Value:
    """A minimal `Stateful`: one value, anything `torch.save` holds."""

    def __init__(self, value=None):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def _tokenizer():
    return train_tokenizer(["a few words to learn merges from"] * 4, vocab_size=300)


def test_keeps_the_last_k_and_the_best_checkpoint(tiny_model, tmp_path):
    counter, tokenizer = Value(), _tokenizer()
    checkpointer = Checkpointer(tmp_path, tiny_model, [], {"counter": counter}, tokenizer, keep_last=2)
    for step, val_loss in zip(range(1, 6), [3.0, 1.0, 2.0, 4.0, None], strict=True):
        counter.value = step
        checkpointer.save(step, val_loss=val_loss)
    checkpointer.wait()
    assert checkpointer.steps() == [2, 4, 5]
    assert checkpointer.best().name == "checkpoint-2"
    assert not list(tmp_path.glob(".tmp-*"))
    reopened = Checkpointer(tmp_path, tiny_model, [], {"counter": counter}, tokenizer, keep_last=2)
    assert reopened.best().name == "checkpoint-2" and reopened.latest().name == "checkpoint-5"
    reopened.load(reopened.best())
    assert counter.value == 2
    assert ZayaForCausalLM.from_pretrained(checkpointer.path(2)).config.hidden_size == tiny_model.config.hidden_size
    timings = checkpointer.completed_writes
    assert len(timings) == 5 and all(t["stall_s"] >= 0 and t["save_pretrained_s"] > 0 for t in timings)


def test_checkpointer_refuses_a_state_named_like_the_optimizers_entry(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="'optimizers' names"):
        Checkpointer(tmp_path, tiny_model, [], {"optimizers": Value()}, _tokenizer(), keep_last=1)


def test_loading_a_checkpoint_without_a_state_names_it(tiny_model, tmp_path):
    tokenizer = _tokenizer()
    writer = Checkpointer(tmp_path, tiny_model, [], {"counter": Value(1)}, tokenizer, keep_last=1)
    writer.save(1, block=True)
    reader = Checkpointer(tmp_path, tiny_model, [], {"counter": Value(), "data": Value()}, tokenizer, keep_last=1)
    with pytest.raises(ValueError, match=r"holds no state for \['data'\]"):
        reader.load(reader.latest())


def test_each_checkpoint_holds_its_own_step_though_the_cpu_copy_is_refilled(tiny_model, tmp_path):
    tokenizer = _tokenizer()
    optimizer = torch.optim.AdamW(tiny_model.parameters(), lr=1e-2)
    moments = Value()
    checkpointer = Checkpointer(tmp_path, tiny_model, [optimizer], {"moments": moments}, tokenizer, keep_last=3)
    expected = {}
    for step in (1, 2, 3):
        tiny_model(input_ids=torch.tensor([[3, 4, 5, 6]]), labels=torch.tensor([[3, 4, 5, 6]])).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        moments.value = {"exp_avg": torch.full((4,), float(step))}
        checkpointer.save(step)
        expected[step] = {name: value.clone() for name, value in tiny_model.state_dict().items()}
        # Changed at once, while the writer has barely started: a write reading live state would show it.
        with torch.no_grad():
            for parameter in tiny_model.parameters():
                parameter.add_(100.0)
            moments.value["exp_avg"].add_(100.0)
        if step == 2:
            checkpointer.release()  # as training's end does: the next save copies into new memory
    checkpointer.wait()
    for step, state in expected.items():
        loaded = ZayaForCausalLM.from_pretrained(checkpointer.path(step)).state_dict()
        for name, value in state.items():
            assert torch.equal(loaded[name], value), (step, name)
        checkpointer.load(checkpointer.path(step))  # model, optimizer and states, in place
        assert torch.equal(moments.value["exp_avg"], torch.full((4,), float(step)))
        assert float(optimizer.state_dict()["state"][0]["step"]) == step
        for name, value in tiny_model.state_dict().items():
            assert torch.equal(value, state[name]), (step, name)


def test_cpu_copy_refills_an_earlier_copy_where_shapes_match():
    from zaya_model.training.staging import cpu_copy

    state = {"a": torch.ones(3), "nested": [torch.zeros(2, 2), 7], "step": 1}
    first = cpu_copy(state)
    state["a"].add_(1.0)
    state["nested"][0] = torch.zeros(5)  # a new shape cannot reuse the old buffer
    second = cpu_copy(state, reuse=first)
    assert second["a"].data_ptr() == first["a"].data_ptr() != state["a"].data_ptr()
    assert torch.equal(second["a"], torch.full((3,), 2.0))
    assert second["nested"][0].shape == (5,) and second["nested"][1] == 7 and second["step"] == 1


def test_balancing_stats_are_logged_and_biases_move(corpus, tokenizer_dir, tmp_path):
    trainer = Pretrainer(corpus, tmp_path / "run", MICRO.replace(max_steps=3), tokenizer_path=tokenizer_dir)
    initial = [layer.mlp.gate.balancing_biases.clone() for layer in trainer.model.model.layers]
    trainer.train()
    steps = [m for m in metrics(tmp_path / "run") if "loss" in m]
    for record in steps:
        assert len(record["load_imbalance"]) == len(record["skip_rate"]) == MICRO.model["num_hidden_layers"]
        for load, skip in zip(record["expert_load"], record["skip_rate"], strict=True):
            assert len(load) == MICRO.model["num_experts"]
            assert sum(load) + skip == pytest.approx(1.0)
        assert record["max_load_imbalance"] == max(record["load_imbalance"]) >= 1.0
    moved = [layer.mlp.gate.balancing_biases for layer in trainer.model.model.layers]
    assert any(not torch.equal(a, b) for a, b in zip(initial, moved, strict=True))


def _native_bf16() -> bool:
    if hasattr(torch.cpu, "_init_amx"):
        torch.cpu._init_amx()
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.parametrize("scale", [0.01, 10.0])  # a norm within max_norm (left alone), and one clipped
def test_clip_gradients_matches_torch_clip_grad_norm_bit_for_bit(scale):
    generator = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32,), (8, 4, 16)]
    grads = [torch.randn(shape, generator=generator) * scale for shape in shapes]
    ours = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    reference = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    for parameter, other, grad in zip(ours, reference, grads, strict=True):
        parameter.grad, other.grad = grad.clone(), grad.clone()
    ours.append(torch.nn.Parameter(torch.zeros(3)))  # without a gradient: skipped, as torch skips it

    norm = clip_gradients(ours, 1.0)

    expected = torch.nn.utils.clip_grad_norm_(reference, 1.0)
    assert torch.equal(norm, expected) and (norm > 1.0) == (scale > 1.0)
    for parameter, other in zip(ours, reference, strict=False):
        assert torch.equal(parameter.grad, other.grad)
    assert ours[-1].grad is None


@pytest.mark.skipif(not _native_bf16(), reason="needs a CPU with native bf16 (AVX512-BF16 or AMX), as CI's has")
def test_bf16_autocast_trains_close_to_fp32_with_fp32_master_weights(corpus, tokenizer_dir, tmp_path):
    settings = MICRO.replace(max_steps=3)
    Pretrainer(corpus, tmp_path / "fp32", settings, tokenizer_path=tokenizer_dir).train()
    trainer = Pretrainer(corpus, tmp_path / "bf16", settings.replace(dtype="bf16"), tokenizer_path=tokenizer_dir)
    assert trainer.autocast is torch.bfloat16
    result = trainer.train()

    expected, got = step_losses(tmp_path / "fp32"), step_losses(tmp_path / "bf16")
    assert sorted(got) == [1, 2, 3] and math.isfinite(result.val_loss)
    # bf16 keeps 8 significant bits, but the loss averages 128 tokens' errors: 2e-4 apart was seen. 1e-2 is far
    # below the loss's drop per step (~0.15), so an update lost or applied twice would show.
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, abs=1e-2), step
    assert got != expected  # the matmuls really ran in bf16
    # Autocast computes in bf16 but the weights, optimizer moments and checkpoints stay fp32 (master weights).
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert {v.dtype for s in trainer.optimizers[0].state.values() for v in s.values() if v.ndim} == {torch.float32}
    saved = load_file(tmp_path / "bf16" / "checkpoints" / "checkpoint-3" / "model.safetensors")
    assert {tensor.dtype for tensor in saved.values()} == {torch.float32}


@pytest.mark.slow  # compiles graphs
def test_compiled_layers_train_like_eager_and_may_be_toggled_on_resume(corpus, tokenizer_dir, tmp_path):
    settings = MICRO.replace(max_steps=4)
    Pretrainer(corpus, tmp_path / "eager", settings, tokenizer_path=tokenizer_dir).train()
    compiled = Pretrainer(corpus, tmp_path / "run", settings.replace(compile=True), tokenizer_path=tokenizer_dir)
    assert compiled_layers_enabled(compiled.model)
    compiled.train(until_step=2)
    # `compile` is no part of a run's identity: the run resumes without it.
    resumed = Pretrainer(corpus, tmp_path / "run", settings, tokenizer_path=tokenizer_dir)
    assert resumed.step == 2 and not compiled_layers_enabled(resumed.model)
    resumed.train()
    expected, got = step_losses(tmp_path / "eager"), step_losses(tmp_path / "run")
    assert sorted(got) == [1, 2, 3, 4]
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, abs=1e-5), step


def test_compile_without_a_cpp_compiler_fails_before_anything_is_written(corpus, tmp_path, monkeypatch, capsys):
    output = tmp_path / "run"
    with no_cpp_compiler(monkeypatch):
        assert main(["pretrain", "--data", str(corpus), "--output", str(output), "--compile", "--no-progress"]) == 1
    assert "--compile: compiled layers on CPU need a C++ compiler" in capsys.readouterr().err
    assert not output.exists()


def test_grad_accumulation_matches_one_larger_batch(corpus, tokenizer_dir, tmp_path):
    one = Pretrainer(corpus, tmp_path / "one", MICRO.replace(max_steps=2, batch_size=2), tokenizer_path=tokenizer_dir)
    one.train()
    accumulated = MICRO.replace(max_steps=2, batch_size=1, grad_accum=2)
    two = Pretrainer(corpus, tmp_path / "two", accumulated, tokenizer_path=tokenizer_dir)
    two.train()
    for step, loss in step_losses(tmp_path / "one").items():
        assert step_losses(tmp_path / "two")[step] == pytest.approx(loss, abs=1e-5)


def test_muon_trains_two_dimensional_weights(corpus, tokenizer_dir, tmp_path):
    trainer = Pretrainer(
        corpus, tmp_path / "run", MICRO.replace(max_steps=2, optimizer="muon"), tokenizer_path=tokenizer_dir
    )
    assert [type(o).__name__ for o in trainer.optimizers] == ["AdamW", "Muon"]
    assert all(p.ndim == 2 for group in trainer.optimizers[1].param_groups for p in group["params"])
    trainer.train()
    assert all(torch.isfinite(torch.tensor(loss)) for loss in step_losses(tmp_path / "run").values())


def test_bad_input_fails_before_training_and_keeps_checkpoints(corpus, tokenizer_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        MICRO.replace(seq_len=512)
    assert main(["pretrain", "--data", str(corpus), "--output", str(tmp_path / "long"), "--seq-len", "4096"]) == 1
    assert "exceeds the model's max_position_embeddings (1024)" in capsys.readouterr().err
    assert not (tmp_path / "long").exists()

    output = tmp_path / "run"
    Pretrainer(corpus, output, MICRO.replace(max_steps=3), tokenizer_path=tokenizer_dir).train()
    before = sorted(p.name for p in (output / "checkpoints").iterdir())
    with pytest.raises(PretrainError, match="different settings \\(model\\)"):
        Pretrainer(corpus, output, MICRO.replace(model={**MICRO.model, "hidden_size": 64}))
    assert sorted(p.name for p in (output / "checkpoints").iterdir()) == before

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main(["pretrain", "--data", str(corpus), "--output", str(blocker / "out"), "--no-progress"]) == 1
    assert "not writable" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["pretrain", "--data", str(empty), "--output", str(tmp_path / "x"), "--no-progress"]) == 1
    assert "no training documents" in capsys.readouterr().err


# With copying rows each rank takes its share of the copying start's rows and of each batch's copying rows.
@pytest.mark.parametrize("copying", [{}, {"copy_start_steps": 2, "copy_rows": 1}], ids=["corpus", "copying"])
def test_two_processes_match_one_with_twice_the_batch_and_resume_on_one(corpus, tokenizer_dir, tmp_path, copying):
    import multiprocessing

    per_rank = MICRO.replace(max_steps=4, batch_size=2, **copying)
    settings = per_rank.replace(batch_size=4, copy_rows=2 * per_rank.copy_rows)
    Pretrainer(corpus, tmp_path / "one", settings, tokenizer_path=tokenizer_dir).train()

    # Two gloo ranks with half the batch each (forked: no second interpreter start-up), stopped after step 2...
    context = multiprocessing.get_context("fork")
    args = (tmp_path / "init", corpus, tmp_path / "two", per_rank, tokenizer_dir, 2)
    ranks = [context.Process(target=train_rank, args=(rank, 2, *args)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    errors = "".join(path.read_text() for path in tmp_path.glob("init.rank*.error"))
    assert [process.exitcode for process in ranks] == [0, 0], errors
    # ...then resumed by a single process with the same global batch.
    resumed = Pretrainer(corpus, tmp_path / "two", settings, tokenizer_path=tokenizer_dir)
    assert resumed.step == 2
    resumed.train()

    expected, got = step_losses(tmp_path / "one"), step_losses(tmp_path / "two")
    assert sorted(got) == [1, 2, 3, 4]
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, abs=1e-5), step


def _stall_second_step(corpus, output, settings, tokenizer_dir, stderr_path):
    trainer = Pretrainer(corpus, output, settings, tokenizer_path=tokenizer_dir)
    calls = []

    def stall(module, inputs, output):
        if module.training:
            calls.append(1)
            if len(calls) == 2:
                time.sleep(30)

    trainer.model.model.embed_tokens.register_forward_hook(stall)
    # faulthandler writes the stacks to sys.stderr's file descriptor.
    with open(stderr_path, "w") as sys.stderr:
        trainer.train()


def test_a_stalled_step_dumps_stacks_and_exits_non_zero(corpus, tokenizer_dir, tmp_path):
    import multiprocessing

    settings = MICRO.replace(step_timeout_s=1.0)
    args = (corpus, tmp_path / "run", settings, tokenizer_dir, tmp_path / "stderr")
    process = multiprocessing.get_context("fork").Process(target=_stall_second_step, args=args)
    process.start()
    process.join(timeout=25)
    process.kill()
    assert process.exitcode == 1
    dump = (tmp_path / "stderr").read_text()
    assert "Timeout" in dump and "in train_step" in dump and "in stall" in dump
    assert sorted(step_losses(tmp_path / "run")) == [1]
