"""A model's tokenizer as a zip of the files `AutoTokenizer.from_pretrained` reads (never weights), for clients that
count tokens themselves: lm-evaluation-harness (`tokenizer=`), guidellm (`--tokenizer`)."""

from __future__ import annotations

import io
import re
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def tokenizer_archive(tokenizer: PreTrainedTokenizerBase) -> bytes:
    """The tokenizer saved by `save_pretrained` (its vocabulary, special tokens and chat template), zipped flat."""
    buffer = io.BytesIO()
    with tempfile.TemporaryDirectory(prefix="zaya-tokenizer-") as directory:
        tokenizer.save_pretrained(directory)
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            for path in sorted(Path(directory).iterdir()):
                archive.write(path, path.name)
    return buffer.getvalue()


def archive_name(model: str) -> str:
    """A file name for `model`'s tokenizer archive (model names hold ':' and '@')."""
    return f"{re.sub(r'[^A-Za-z0-9._-]+', '_', model)}-tokenizer.zip"
