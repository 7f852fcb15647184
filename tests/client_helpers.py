"""Shared by the real-client tests (`tests/server/test_clients.py` on the local engine, `test_vllm_clients.py` on
vLLM): one `zaya serve` process per module on `make run`'s own model (the `bootstrap` preset, briefly trained), its
tokenizer fetched through the API as docs/clients.md says, and EleutherAI's lm-evaluation-harness and guidellm run
as their users run them (their command-line tools), offline: small task files and datasets written here, no hub.

Every result is checked against a reference, not only for having run: lm-eval's loglikelihoods against the model's
own `forward()`, its generations against the same request sent with the `openai` client, guidellm's token counts
against what it asked for.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch
import yaml

from benchmarks.load_test.stack import MODEL_NAME, Stack

CLIENT_TIMEOUT_S = 900
BOOTSTRAP_STEPS = 60  # enough for answers that read like a bank's ("Disposition: ..."), in seconds
MULTIPLE_CHOICE = [
    {
        "question": "Case 1: a salary of 2,100 EUR arrived as every month.",
        "choices": ["close", "escalate"],
        "answer": 0,
    },
    {"question": "Case 2: 40 cash deposits of 9,900 EUR in a week.", "choices": ["close", "escalate"], "answer": 1},
    {
        "question": "Case 3: a card payment abroad, customer confirmed.",
        "choices": ["close", "freeze", "refer"],
        "answer": 0,
    },
    {"question": "Case 4: transfers to a sanctioned bank.", "choices": ["close", "escalate", "refer"], "answer": 1},
]
GENERATION = [
    {"question": "Summarise case 7: a transfer of 400 EUR was flagged.", "answer": "close"},
    {"question": "Recommend a disposition for case 8.", "answer": "escalate"},
    {"question": "What should the analyst check first in case 9?", "answer": "the account"},
]
GENERATION_MAX_TOKENS = 8
GENERATION_STOP = ["\n"]
# A continuation's summed log-probability, fp32 on both engines (vLLM's tokens agree with `forward()` within 1e-4).
LOGLIKELIHOOD_TOLERANCE = 1e-3


@dataclass
class Served:
    """A `zaya serve` process (`stack`) on the bootstrap model in `model_dir`, and its tokenizer in `tokenizer_dir`."""

    stack: Stack
    model_dir: Path
    tokenizer_dir: Path
    workdir: Path

    @property
    def key(self) -> str:
        return self.stack.keys["analyst"]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.stack.url}/v1", api_key=self.key, max_retries=0, timeout=300)

    def client_env(self) -> dict[str, str]:
        """What a client process runs with: the key, and no network for models or datasets."""
        return {
            **os.environ,
            "OPENAI_API_KEY": self.key,
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "HF_HOME": str(self.workdir / "hf-home"),  # nothing read from, or left in, the machine's cache
            "TOKENIZERS_PARALLELISM": "false",
        }


@contextmanager
def serve(workdir: Path, env: dict[str, str]) -> Iterator[Served]:
    """`zaya serve` with `env` (the engine's settings) on a freshly trained bootstrap model."""
    from finetune.bootstrap import build_tiny_model

    model_dir = build_tiny_model(workdir / "model", train_steps=BOOTSTRAP_STEPS)
    with Stack(workdir / "var", env=env) as stack:
        stack.prepare(model_dir)
        stack.start_server()
        yield Served(
            stack, model_dir, fetch_tokenizer(stack.url, stack.keys["analyst"], workdir / "tokenizer"), workdir
        )


def fetch_tokenizer(url: str, key: str, directory: Path) -> Path:
    """The served model's tokenizer files, from `GET /v1/models/{model}/tokenizer` (docs/clients.md)."""
    response = httpx.get(
        f"{url}/v1/models/{MODEL_NAME}/tokenizer", headers={"Authorization": f"Bearer {key}"}, timeout=120
    )
    response.raise_for_status()
    with zipfile.ZipFile(io.BytesIO(response.content)) as archive:
        archive.extractall(directory)
    return directory


# --- lm-evaluation-harness ----------------------------------------------------------------------------------------


def write_tasks(directory: Path) -> Path:
    """Two lm-eval tasks on JSONL files in `directory`: multiple choice (loglikelihood) and generation."""
    directory.mkdir(parents=True, exist_ok=True)
    common = {"dataset_path": "json", "test_split": "test"}
    tasks = {
        "bank_disposition_mc": (
            MULTIPLE_CHOICE,
            {
                "output_type": "multiple_choice",
                "doc_to_text": "{{question}}\nDisposition:",
                "doc_to_choice": "{{choices}}",
                "doc_to_target": "{{answer}}",
                "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
            },
        ),
        "bank_disposition_gen": (
            GENERATION,
            {
                "output_type": "generate_until",
                "doc_to_text": "{{question}}",
                "doc_to_target": "{{answer}}",
                "generation_kwargs": {
                    "until": GENERATION_STOP,
                    "max_gen_toks": GENERATION_MAX_TOKENS,
                    "do_sample": False,
                    "temperature": 0,
                },
                "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
            },
        ),
    }
    for name, (rows, spec) in tasks.items():
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        task = {"task": name, **common, "dataset_kwargs": {"data_files": {"test": str(data)}}, **spec}
        (directory / f"{name}.yaml").write_text(yaml.safe_dump(task, sort_keys=False))
    return directory


def run_lm_eval(served: Served, model: str, model_args: dict[str, str | int], task: str, *extra: str) -> list[dict]:
    """`lm_eval --model <model> ... --tasks <task> --log_samples` against the server; the samples it logged."""
    tasks = write_tasks(served.workdir / "lm-eval-tasks")
    output = served.workdir / "lm-eval-output" / task
    arguments = ",".join(f"{name}={value}" for name, value in {"model": MODEL_NAME, **model_args}.items())
    command = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", arguments, "--tasks", task]
    command += ["--include_path", str(tasks), "--output_path", str(output), "--log_samples", *extra]
    run = subprocess.run(
        command, env=served.client_env(), capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S, check=False
    )
    assert run.returncode == 0, run.stderr[-6000:]
    [samples] = output.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in samples.read_text().splitlines()]


def continuation_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context) from the model's own forward(), split into tokens as lm-eval splits them: the
    context's tokens, then the rest of the whole text's."""
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
    return sum(float(logprobs[position - 1, whole[position]]) for position in range(len(context_ids), len(whole)))


# --- guidellm -----------------------------------------------------------------------------------------------------


def run_guidellm(served: Served, profile: str, requests: int, *, prompt_tokens: int, output_tokens: int) -> dict:
    """`guidellm run` with `profile` (e.g. `kind=synchronous`) for `requests` synthetic chat requests; its report."""
    report = served.workdir / f"guidellm-{profile.replace('=', '-').replace(',', '-')}.json"
    backend = f"kind=openai_http,target={served.stack.url},model={MODEL_NAME},api_key={served.key}"
    command = [sys.executable, "-m", "guidellm", "run", "--backend", backend, "--profile", profile]
    command += ["--constraint", f"kind=max_requests,count={requests}"]
    command += ["--tokenizer", f"kind=huggingface_auto,model={served.tokenizer_dir}"]
    command += ["--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}"]
    command += ["--output", f"kind=json,path={report}", "--disable-console-interactive"]
    benchmark = _guidellm_benchmark(command, served, report)
    # guidellm 0.8 may end a run while a request it sent is still in flight (seen on a loaded machine: 2 created,
    # 1 processed, 1 processing, the run over 0.1 s after the first answer): its scheduler stopped early, not our
    # server, which would leave guidellm waiting instead. Such a run is discarded and run once more.
    if benchmark["scheduler_state"]["processing_requests"]:
        benchmark = _guidellm_benchmark(command, served, report)
    return benchmark


def _guidellm_benchmark(command: list[str], served: Served, report: Path) -> dict:
    run = subprocess.run(
        command, env=served.client_env(), capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S, check=False
    )
    assert run.returncode == 0, (run.stdout[-4000:], run.stderr[-4000:])
    [benchmark] = json.loads(report.read_text())["benchmarks"]
    return benchmark


# --- the checks both engines' modules run ---------------------------------------------------------------------------


def check_lm_eval_multiple_choice(served: Served) -> None:
    """`local-completions` (token-id prompts, echo and prompt logprobs, two prompts a request) scores a multiple-choice
    task: every choice's loglikelihood equals the model's own, and so does the accuracy."""
    from transformers import AutoTokenizer

    from zaya_model import ZayaForCausalLM

    model_args = {
        "base_url": f"{served.stack.url}/v1/completions",
        "tokenizer_backend": "huggingface",
        "tokenizer": str(served.tokenizer_dir),
        "max_retries": 1,
    }
    samples = run_lm_eval(served, "local-completions", model_args, "bank_disposition_mc", "--batch_size", "2")
    assert len(samples) == len(MULTIPLE_CHOICE)
    model = ZayaForCausalLM.from_pretrained(served.model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(served.tokenizer_dir)
    for sample in sorted(samples, key=lambda sample: sample["doc_id"]):
        arguments = [sample["arguments"][f"gen_args_{index}"] for index in range(len(sample["doc"]["choices"]))]
        expected = [continuation_loglikelihood(model, tokenizer, args["arg_0"], args["arg_1"]) for args in arguments]
        scored = [float(response[0][0]) for response in sample["resps"]]
        assert scored == pytest.approx(expected, abs=LOGLIKELIHOOD_TOLERANCE), (sample["doc"], scored, expected)
        best = max(range(len(expected)), key=expected.__getitem__)
        assert float(sample["acc"]) == float(best == sample["doc"]["answer"])


def check_lm_eval_generation(served: Served) -> None:
    """`local-chat-completions` runs a generation task: each logged answer is what the same chat request answers."""
    model_args = {"base_url": f"{served.stack.url}/v1/chat/completions", "max_retries": 1}
    samples = run_lm_eval(served, "local-chat-completions", model_args, "bank_disposition_gen", "--apply_chat_template")
    assert len(samples) == len(GENERATION)
    client = served.client()
    answered = 0
    for sample in samples:
        answer = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": sample["doc"]["question"]}],
            max_tokens=GENERATION_MAX_TOKENS,
            stop=GENERATION_STOP,
            temperature=0,
        )
        assert sample["resps"] == [[answer.choices[0].message.content]]
        answered += bool(answer.choices[0].message.content)
    assert answered  # not only empty answers: the comparison says something


def check_guidellm_profiles(served: Served) -> None:
    """guidellm's synchronous and concurrent profiles complete every request, each exactly as long as it asked
    (`ignore_eos` and `max_completion_tokens` honoured) and counted as the server counts (`usage`)."""
    for profile, requests, concurrency in (("kind=synchronous", 2, 1), ("kind=concurrent,streams=2", 4, 2)):
        benchmark = run_guidellm(served, profile, requests, prompt_tokens=16, output_tokens=6)
        made = benchmark["scheduler_metrics"]["requests_made"]
        assert (made["successful"], made["errored"], made["incomplete"]) == (requests, 0, 0), made
        assert benchmark["config"]["strategy"]["max_concurrency"] == concurrency
        for request in benchmark["requests"]["successful"]:
            assert request["output_metrics"]["text_tokens"] == 6, request["output_metrics"]
            assert request["input_metrics"]["text_tokens"] >= 16
