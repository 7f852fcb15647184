"""Shared test settings and fixtures: tiny random models, never a download."""

import os

# Two busy cores oversubscribed by OpenMP make timings swing wildly; tests stay single-threaded and offline.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

from tiny_models import TINY_ZAYA, randomize_zaya  # noqa: E402


@pytest.fixture
def tiny_config():
    from zaya_model import ZayaConfig

    return ZayaConfig(**TINY_ZAYA)


@pytest.fixture
def tiny_model(tiny_config):
    from zaya_model import ZayaForCausalLM

    torch.manual_seed(0)
    return randomize_zaya(ZayaForCausalLM(tiny_config)).eval()
