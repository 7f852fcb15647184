"""Adapter versions are checked, and merged where needed, when they are registered, not when a request needs them.

- An adapter on the attention projections only is checked against its base (LoRA, targets an engine can apply per
  request, shapes of this base) and served per request (vLLM `LoRARequest`; the local engine merges at load).
- An adapter that trains expert weights (PEFT `target_parameters`) or token embedding rows (PEFT
  `trainable_token_indices`), as fine-tuning's default LoRA does, cannot be applied per request: it is merged into
  its base here, once, into `<adapter dir>/merged/` (written atomically), which engines serve as a full model of its
  own.
Either way a bad adapter (not LoRA, another base, unknown targets) is a 400 naming `path` at registration.
"""

from __future__ import annotations

from pathlib import Path

from server.errors import InvalidRequest


def prepare_adapter(adapter_dir: Path, base_dir: Path) -> None:
    from server.engines.base import write_merged_checkpoint
    from zaya_model.training.adapter_merge import AdapterError
    from zaya_model.vllm_plugin.adapters import check_adapter, served_merged

    try:
        if not served_merged(adapter_dir):
            check_adapter(adapter_dir, base_dir)
            return
        write_merged_checkpoint(adapter_dir, base_dir)
    except AdapterError as error:
        raise InvalidRequest(f"This adapter cannot be served: {error}", param="path") from error
    except OSError as error:
        raise InvalidRequest(f"Cannot write the merged checkpoint of {adapter_dir}: {error}", param="path") from error
