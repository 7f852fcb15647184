"""`prepare_training_process`: freed memory kept and subnormal floats flushed to zero, in every compute thread."""

from __future__ import annotations

import subprocess
import sys

# A subnormal times 0.5, elementwise over a tensor large enough that both of torch's threads compute a part of it.
PROBE = """
import sys, torch
torch.set_num_threads(2)
from zaya_model.training.runtime import prepare_training_process
applied = prepare_training_process() if sys.argv[1] == "prepare" else {}
product = torch.full((1 << 20,), 1e-39) * 0.5
print(applied.get("flushes_subnormals"), int((product == 0).sum()), product.numel())
"""


def probe(mode: str) -> tuple[str, int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True).stdout
    applied, zeros, total = out.split()
    return applied, int(zeros), int(total)


def test_subnormals_are_flushed_in_every_thread_after_preparing():
    _, zeros_by_default, _ = probe("default")
    applied, zeros, total = probe("prepare")
    assert zeros_by_default == 0  # by default a subnormal product stays subnormal
    assert applied == "True" and zeros == total
