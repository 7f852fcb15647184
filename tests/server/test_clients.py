"""Clients nobody on this project wrote, against `zaya serve` on the local engine: EleutherAI's lm-evaluation-harness
(`local-completions` on a multiple-choice task, `local-chat-completions` on a generation task) and guidellm (its
synchronous and concurrent profiles). The vLLM engine's twin: `test_vllm_clients.py`; the checks: `client_helpers`."""

from __future__ import annotations

import pytest
from client_helpers import check_guidellm_profiles, check_lm_eval_generation, check_lm_eval_multiple_choice, serve

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    env = {"ZAYA_ENGINE": "local"}
    with serve(tmp_path_factory.mktemp("clients-local"), env) as served:
        yield served


def test_lm_eval_scores_a_multiple_choice_task_by_loglikelihood(served):
    check_lm_eval_multiple_choice(served)


def test_lm_eval_runs_a_generation_task_through_chat(served):
    check_lm_eval_generation(served)


def test_guidellm_synchronous_and_concurrent_profiles(served):
    check_guidellm_profiles(served)
