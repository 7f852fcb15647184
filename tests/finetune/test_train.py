"""`run_finetune`: labels, packing, LoRA and full training, outputs, pause/resume, cancel, bad input, stop tokens."""

from __future__ import annotations

import dataclasses
import json
import os

import peft
import pytest
import torch
from compile_helpers import compiled_calls, compiled_graphs, no_cpp_compiler
from finetune_helpers import Recorder, chat, save_tiny_model, spec, write_data
from pydantic import ValidationError

from finetune.auto import resolve_hyperparameters
from finetune.data import IGNORE_INDEX, TokenizedDataset, make_collator, read_examples
from finetune.datasets.rendering import tokenize_example
from finetune.evaluate import evaluate_model
from finetune.run import FinetuneError, check_run, run_finetune
from finetune.settings import BASE_LEARNING_RATE, FineTuneSettings
from zaya_model import ZayaForCausalLM
from zaya_model.pretrain import END_OF_TURN_TOKEN
from zaya_model.pretrain.tokenizer import chat_template_token_ids
from zaya_model.training.callbacks import COMPILING_MESSAGE


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    return save_tiny_model(tmp_path_factory.mktemp("base"), tokenizer)


@pytest.fixture
def data(write_jsonl):
    return write_data(write_jsonl)


def test_labels_are_exactly_the_tokens_tokenize_example_trains(tokenizer, data):
    examples = read_examples(data[0])
    dataset = TokenizedDataset(examples, tokenizer)
    for example, features in zip(examples, dataset, strict=True):
        tokenized = tokenize_example(example, tokenizer)
        assert features["input_ids"] == tokenized.input_ids
        expected = [t if m else IGNORE_INDEX for t, m in zip(tokenized.input_ids, tokenized.trained_mask, strict=True)]
        assert features["labels"] == expected
    assert dataset.n_trained_tokens == sum(tokenize_example(e, tokenizer).n_trained for e in examples)


def test_packed_batch_loss_equals_the_per_example_losses(model_dir, tokenizer, data):
    model = ZayaForCausalLM.from_pretrained(model_dir).eval()
    features = list(TokenizedDataset(read_examples(data[0]), tokenizer))[:5]
    # One example twice as long as the others: two short ones share a row of its length.
    features = features[:3] + [{key: features[3][key] + features[4][key] for key in features[3]}]
    batch = make_collator(tokenizer, packing=True)(features)
    longest = max(len(feature["input_ids"]) for feature in features)
    assert batch["input_ids"].shape == (3, longest)
    assert (batch["position_ids"] == 0).sum() >= len(features)  # every example (and row padding) starts at 0
    with torch.no_grad():
        packed = model(**batch, use_cache=False).loss
        total = n = 0
        for feature in features:
            labels = torch.tensor([feature["labels"]])
            count = int((labels[:, 1:] != IGNORE_INDEX).sum())
            total += model(torch.tensor([feature["input_ids"]]), labels=labels, use_cache=False).loss * count
            n += count
        assert abs(packed - total / n) < 1e-5
        # Without restarting positions the examples would see each other: the check can fail.
        leaked = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss
        assert abs(leaked - total / n) > 1e-4


def test_lora_trains_and_its_adapter_and_merge_reload(model_dir, tokenizer, data, tmp_path, monkeypatch):
    hooks = Recorder()
    # Training steps compute the LM head on trained positions only (`skip_logits`); evaluation still gets logits.
    head_only_losses = []
    loss_at_trained_positions = ZayaForCausalLM._loss_at_trained_positions
    monkeypatch.setattr(
        ZayaForCausalLM,
        "_loss_at_trained_positions",
        lambda *args: head_only_losses.append(1) or loss_at_trained_positions(*args),
    )
    result = run_finetune(
        spec(
            model_dir,
            data[0],
            tmp_path,
            validation_file=data[1],
            max_steps=8,
            eval_every=4,
            learning_rate_multiplier=0.625,
            merge_adapter=True,
        ),
        hooks,
    )
    assert result.status == "succeeded" and result.kind == "full"  # merged
    assert len(head_only_losses) >= 8
    assert sum(list(hooks.losses.values())[-3:]) < sum(list(hooks.losses.values())[:3])
    assert [c["step"] for c in result.checkpoints] == [4, 8] == [step for step, _, _ in hooks.checkpoints]
    for checkpoint in result.checkpoints:
        with open(os.path.join(checkpoint["path"], "metrics.json")) as file:
            on_disk = json.load(file)
        assert on_disk == checkpoint["metrics"]
        assert set(on_disk) == {"step", "train_loss", "valid_loss", "valid_mean_token_accuracy"}
        assert os.path.isfile(os.path.join(checkpoint["path"], "optimizer.pt"))
    assert not [name for name in os.listdir(tmp_path / "out" / "checkpoints") if name.startswith(".")]

    final = tmp_path / "out" / "final"
    valid_ids = torch.tensor([TokenizedDataset(read_examples(data[1]), tokenizer)[0]["input_ids"]])
    with torch.no_grad():
        adapter = peft.PeftModel.from_pretrained(ZayaForCausalLM.from_pretrained(model_dir), final).eval()
        adapter_logits = adapter(valid_ids).logits
        best = result.metrics["best_step"]
        best_dir = tmp_path / "out" / "checkpoints" / f"checkpoint-{best}"
        again = peft.PeftModel.from_pretrained(ZayaForCausalLM.from_pretrained(model_dir), best_dir).eval()
        assert torch.equal(again(valid_ids).logits, adapter_logits)  # the final adapter is the best checkpoint
        merged_logits = ZayaForCausalLM.from_pretrained(result.output_dir).eval()(valid_ids).logits
        assert (merged_logits - adapter_logits).abs().max() < 1e-4
        base_logits = ZayaForCausalLM.from_pretrained(model_dir).eval()(valid_ids).logits
        assert (base_logits - adapter_logits).abs().max() > 1e-3
    # The reloaded adapter scores exactly what the trainer measured in memory.
    scores = evaluate_model(model_dir, data[1], adapter_dir=str(final))
    assert scores["loss"] == pytest.approx(result.metrics["best_valid_loss"], abs=1e-5)
    # The run ended with the task evaluation of its validation file, the one `zaya evaluate` makes, saved beside
    # the model.
    assert result.evaluation == scores["task_evaluation"] and result.evaluation["n_examples"] == 3
    assert result.evaluation["fields"]["Disposition"]["n"] == 3
    for directory in (final, result.output_dir):
        with open(os.path.join(directory, "evaluation.json")) as file:
            assert json.load(file) == result.evaluation
    assert any(message.startswith("task evaluation: exact match") for _, message in hooks.events)


def test_lora_trains_the_chat_templates_token_rows_tied_to_the_lm_head(model_dir, tokenizer, data, tmp_path):
    """Pretraining on plain text never trains `<|im_start|>` / `<|im_end|>`; LoRA trains their embedding rows
    (PEFT `trainable_token_indices`), saves them in the adapter, and merging writes them to the tied LM head too."""
    template_ids = chat_template_token_ids(tokenizer)
    assert template_ids == sorted(tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]))
    result = run_finetune(spec(model_dir, data[0], tmp_path / "rows", max_steps=4))
    with open(os.path.join(result.output_dir, "adapter_config.json")) as file:
        assert json.load(file)["trainable_token_indices"] == {"embed_tokens": template_ids}
    base = ZayaForCausalLM.from_pretrained(model_dir)
    merged = peft.PeftModel.from_pretrained(ZayaForCausalLM.from_pretrained(model_dir), result.output_dir)
    merged = merged.merge_and_unload()
    changed = (merged.model.embed_tokens.weight - base.model.embed_tokens.weight).abs().sum(-1).nonzero().flatten()
    assert changed.tolist() == template_ids
    assert merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()

    off = run_finetune(spec(model_dir, data[0], tmp_path / "off", max_steps=1, lora_train_template_tokens=False))
    with open(os.path.join(off.output_dir, "adapter_config.json")) as file:
        assert json.load(file)["trainable_token_indices"] is None


def test_full_fine_tuning_trains_and_stops_generation_at_end_of_turn(model_dir, tokenizer, write_jsonl, tmp_path):
    train = str(write_jsonl([chat(user=f"Case {i}.", answer="Disposition: SAR") for i in range(4)], "sar.jsonl"))
    hooks = Recorder()
    result = run_finetune(
        spec(
            model_dir,
            train,
            tmp_path,
            method="full",
            max_steps=25,
            batch_size=4,
            eval_every=25,
            learning_rate_multiplier=3.125,
        ),
        hooks,
    )
    assert result.status == "succeeded" and result.kind == "full"
    losses = list(hooks.losses.values())
    assert losses[-1] < 0.5 * losses[0]

    model = ZayaForCausalLM.from_pretrained(result.output_dir).eval()
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKEN)
    assert end_of_turn in model.generation_config.eos_token_id
    prompt = tokenizer.apply_chat_template(
        chat()["messages"][:-1], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    output = model.generate(**prompt, max_new_tokens=30, do_sample=False)[0, prompt["input_ids"].shape[1] :]
    assert output[-1] == end_of_turn and len(output) < 30
    # Before training the model never picks the end-of-turn token within 30 tokens: the stop was learned.
    base = ZayaForCausalLM.from_pretrained(model_dir).eval()
    before = base.generate(**prompt, max_new_tokens=30, do_sample=False, eos_token_id=end_of_turn)
    assert end_of_turn not in before[0, prompt["input_ids"].shape[1] :]


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"n_epochs": 0}, "supervised.hyperparameters.n_epochs"),
        ({"batch_size": "big"}, "supervised.hyperparameters.batch_size"),
        ({"batch_size": True}, "supervised.hyperparameters.batch_size"),
        ({"learning_rate_multiplier": -1.0}, "supervised.hyperparameters.learning_rate_multiplier"),
        ({"learning_rate_multiplier": float("nan")}, "supervised.hyperparameters.learning_rate_multiplier"),
        ({"method": "qlora"}, "supervised.adapter"),
        ({"lora_r": 0}, "supervised.lora.r"),
        ({"lora_dropout": 1.0}, "supervised.lora.dropout"),
        ({"max_steps": 0}, "supervised.hyperparameters.max_steps"),
        ({"method": "full", "merge_adapter": True}, "supervised.merge_adapter"),
        ({"keep_checkpoints": 0}, "supervised.hyperparameters.keep_checkpoints"),
        ({"balancing_bias_lr": -1.0}, "supervised.hyperparameters.balancing_bias_lr"),
    ],
)
def test_bad_setting_is_named_by_the_settings_model(options, field):
    with pytest.raises(ValidationError) as error:
        FineTuneSettings.from_options(**options)
    assert ".".join(map(str, error.value.errors()[0]["loc"])) == field


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_dir": "/nonexistent"}, "model_dir"),
        ({"train_file": "/nonexistent.jsonl"}, "train_file"),
        ({"seed": -1}, "seed"),
        (
            {"settings": FineTuneSettings.from_options(early_stopping_patience=2)},
            "method.supervised.hyperparameters.early_stopping_patience",
        ),
    ],
)
def test_bad_run_input_names_the_field(model_dir, data, tmp_path, change, field):
    with pytest.raises(FinetuneError, match=f"^{field}: ") as error:
        check_run(dataclasses.replace(spec(model_dir, data[0], tmp_path), **change))
    assert error.value.field == field


def test_bad_dataset_lists_the_lines(model_dir, write_jsonl, tmp_path):
    untrained = chat(weight=0)
    train = str(write_jsonl([chat(), untrained, "{oops"], "bad.jsonl"))
    with pytest.raises(FinetuneError, match="^train_file: 2 problem") as error:
        run_finetune(spec(model_dir, train, tmp_path))
    assert "line 2: messages: every assistant message has weight 0" in str(error.value)
    assert "line 3: invalid JSON" in str(error.value)

    only_context = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "weight": 0}]}
    with pytest.raises(FinetuneError, match="line 1: messages: every assistant message has weight 0"):
        run_finetune(spec(model_dir, str(write_jsonl([only_context], "zero.jsonl")), tmp_path))


def test_auto_hyperparameters_follow_the_dataset_size():
    auto = FineTuneSettings()
    small, large = resolve_hyperparameters(auto, 100), resolve_hyperparameters(auto, 100_000)
    assert (small.n_epochs, small.batch_size) == (25, 1)
    assert (large.n_epochs, large.batch_size) == (1, 32)
    assert resolve_hyperparameters(auto, 2_000).n_epochs == 3
    assert small.learning_rate == BASE_LEARNING_RATE["lora"]


def test_unknown_lora_target_module_names_the_field(model_dir, data, tmp_path):
    with pytest.raises(FinetuneError, match="^method.supervised.lora.target_modules: .*nope"):
        run_finetune(spec(model_dir, data[0], tmp_path, lora_target_modules=["nope"]))


@pytest.mark.slow  # compiles graphs
def test_compiled_layers_train_the_same(model_dir, data, tmp_path):
    runs = {}
    for compiled in (False, True):
        calls_before = compiled_calls()
        hooks = Recorder()
        settings = dict(max_steps=3, learning_rate_multiplier=0.625, compile=compiled)
        result = run_finetune(spec(model_dir, data[0], tmp_path / str(compiled), **settings), hooks)
        assert result.status == "succeeded"
        runs[compiled] = (list(hooks.losses.values()), compiled_calls() - calls_before)
        assert (("info", COMPILING_MESSAGE) in hooks.events) is compiled  # the silent first steps are announced
    (eager_losses, eager_calls), (compiled_losses, calls) = runs[False], runs[True]
    assert eager_calls == 0 and calls > 0 and compiled_graphs() > 0  # compiled only when asked to
    assert compiled_losses == pytest.approx(eager_losses, abs=1e-5)


def test_compile_without_a_cpp_compiler_is_a_clear_error(model_dir, data, tmp_path, monkeypatch):
    with no_cpp_compiler(monkeypatch), pytest.raises(FinetuneError, match="compile: .* need a C\\+\\+ compiler"):
        run_finetune(spec(model_dir, data[0], tmp_path / "out", max_steps=2, compile=True))
    assert not (tmp_path / "out").exists()


def test_gradient_checkpointing_recomputes_layers_and_trains_the_same(model_dir, data, tmp_path, monkeypatch):
    from zaya_model.modeling_zaya import ZayaDecoderLayer

    layer_calls = []
    layer_forward = ZayaDecoderLayer.forward
    monkeypatch.setattr(ZayaDecoderLayer, "forward", lambda *a, **k: layer_calls.append(1) or layer_forward(*a, **k))
    runs = {}
    for checkpointing in (False, True):
        layer_calls.clear()
        hooks = Recorder()
        settings = dict(max_steps=3, learning_rate_multiplier=0.625, gradient_checkpointing=checkpointing)
        result = run_finetune(spec(model_dir, data[0], tmp_path / str(checkpointing), **settings), hooks)
        assert result.status == "succeeded"
        runs[checkpointing] = (list(hooks.losses.values()), len(layer_calls))
    (plain_losses, plain_calls), (checkpointed_losses, checkpointed_calls) = runs[False], runs[True]
    assert checkpointed_calls > plain_calls  # each layer ran again in the backward pass
    assert checkpointed_losses == pytest.approx(plain_losses, abs=1e-5)
