"""`/v1/completions` as evaluation harnesses use it, over real HTTP on the local engine: prompts as token ids and as
lists, `echo` with each prompt token's logprob (the first null), `max_tokens` 0, and `top_logprobs` that agree with
`token_logprobs`. A continuation's loglikelihood through the API equals the model's own (`forward()`)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from server.db.models import ModelVersion
from zaya_model import ZayaForCausalLM

CONTEXTS = ["Case CASE-7 Customer: Maria wired", "Disposition:"]
CONTINUATIONS = [" funds to an account abroad", " SAR"]


@pytest.fixture
def model_name(sessions, tiny_model_dir) -> str:
    with sessions() as session:
        session.add(ModelVersion(name="tiny", version=1, kind="full", path=str(tiny_model_dir)))
        session.commit()
    return "tiny"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return ZayaForCausalLM.from_pretrained(tiny_model_dir).eval()


def model_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log p(token | the tokens before it) for every token but the first, from one forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(token_ids[1:])[:, None])[:, 0]


def assert_top_logprobs_hold_the_token(logprobs: dict, alternatives: int) -> None:
    """Each scored position's alternatives include its own token with exactly its logprob (OpenAI's and vLLM's
    legacy shape: up to `alternatives` + 1 entries)."""
    entries = zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True)
    for token, logprob, top in entries:
        if logprob is not None:
            assert top[token] == logprob and len(top) <= alternatives + 1


def complete(live_server, auth, **body) -> dict:
    response = httpx.post(f"{live_server}/v1/completions", json=body, headers=auth("analyst"), timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture
def pairs(tokenizer) -> list[tuple[list[int], list[int]]]:
    return [
        (tokenizer.encode(context, add_special_tokens=False), tokenizer.encode(continuation, add_special_tokens=False))
        for context, continuation in zip(CONTEXTS, CONTINUATIONS, strict=True)
    ]


def test_lm_evals_loglikelihood_request_scores_continuations_as_the_model_does(
    live_server, auth, model_name, pairs, model, tokenizer
):
    """The exact request lm-evaluation-harness's `local-completions` sends, and the sums it computes from it."""
    prompts = [context + continuation for context, continuation in pairs]
    answer = complete(
        live_server,
        auth,
        model=model_name,
        prompt=prompts,
        temperature=0,
        max_tokens=1,
        logprobs=1,
        seed=1234,
        echo=True,
    )
    choices = sorted(answer["choices"], key=lambda choice: choice["index"])
    assert [choice["index"] for choice in choices] == [0, 1]
    assert answer["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert answer["usage"]["completion_tokens"] == 2
    for choice, prompt, (context, _) in zip(choices, prompts, pairs, strict=True):
        logprobs = choice["logprobs"]
        assert choice["text"].startswith(tokenizer.decode(prompt))
        assert len(logprobs["tokens"]) == len(prompt) + 1  # the prompt, then the generated token
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        expected = model_logprobs(model, prompt)
        assert logprobs["token_logprobs"][1 : len(prompt)] == pytest.approx(expected.tolist(), abs=1e-4)
        # lm-eval's own arithmetic: the continuation's sum, and whether each of its tokens was the most likely.
        continuation = slice(len(context), -1)
        assert sum(logprobs["token_logprobs"][continuation]) == pytest.approx(
            float(expected[len(context) - 1 :].sum()), abs=1e-3
        )
        with torch.no_grad():
            predicted = model(torch.tensor([prompt])).logits[0, :-1].argmax(-1)
        greedy = all(
            token == max(top.values())
            for token, top in zip(
                logprobs["token_logprobs"][continuation], logprobs["top_logprobs"][continuation], strict=True
            )
        )
        assert greedy == bool((predicted[len(context) - 1 :] == torch.tensor(prompt[len(context) :])).all())
        assert_top_logprobs_hold_the_token(logprobs, alternatives=1)


def test_echo_with_max_tokens_0_scores_the_prompt_only(live_server, auth, model_name, pairs, model, tokenizer):
    prompt = pairs[0][0] + pairs[0][1]
    answer = complete(live_server, auth, model=model_name, prompt=prompt, max_tokens=0, logprobs=0, echo=True)
    [choice] = answer["choices"]
    assert choice["text"] == tokenizer.decode(prompt) and choice["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 0
    token_logprobs = choice["logprobs"]["token_logprobs"]
    assert len(token_logprobs) == len(prompt) and token_logprobs[0] is None
    assert token_logprobs[1:] == pytest.approx(model_logprobs(model, prompt).tolist(), abs=1e-4)
    assert [len(top) for top in choice["logprobs"]["top_logprobs"][1:]] == [1] * (len(prompt) - 1)
    refused = httpx.post(
        f"{live_server}/v1/completions",
        json={"model": model_name, "prompt": prompt, "max_tokens": 0},
        headers=auth("analyst"),
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_lists_of_prompts_get_n_choices_each_in_order_whole_and_streamed(live_server, auth, model_name):
    prompts = ["Case CASE-1 Customer:", "Disposition: SAR\nReason:", "Summarise"]
    body = {"model": model_name, "prompt": prompts, "n": 2, "max_tokens": 5, "echo": True, "logprobs": 2, "seed": 3}
    answer = complete(live_server, auth, **body)
    assert [choice["index"] for choice in answer["choices"]] == list(range(6))
    for choice in answer["choices"]:
        prompt = prompts[choice["index"] // 2]
        assert choice["text"].startswith(prompt)
        logprobs = choice["logprobs"]
        assert "".join(logprobs["tokens"]) == choice["text"]
        assert logprobs["text_offset"] == [
            sum(map(len, logprobs["tokens"][:i])) for i in range(len(logprobs["tokens"]))
        ]
        assert_top_logprobs_hold_the_token(logprobs, alternatives=2)

    with httpx.stream(
        "POST", f"{live_server}/v1/completions", json={**body, "stream": True}, headers=auth("analyst"), timeout=120
    ) as response:
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    for whole in answer["choices"]:
        parts = [choice for event in events for choice in event["choices"] if choice["index"] == whole["index"]]
        assert "".join(part["text"] for part in parts) == whole["text"]
        offsets = [offset for part in parts for offset in part["logprobs"]["text_offset"]]
        assert offsets == whole["logprobs"]["text_offset"]


def test_the_openai_client_reads_echoed_prompt_logprobs(live_server, keys, model_name, pairs):
    client = openai.OpenAI(base_url=f"{live_server}/v1", api_key=keys["analyst"], max_retries=0, timeout=60)
    prompt = pairs[1][0] + pairs[1][1]
    completion = client.completions.create(model=model_name, prompt=prompt, max_tokens=2, logprobs=1, echo=True)
    logprobs = completion.choices[0].logprobs
    assert logprobs.token_logprobs[0] is None and len(logprobs.tokens) == len(prompt) + 2
