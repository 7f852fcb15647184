"""What the dataset page shows about a stored file: the fine-tuning validator's report, the PII scan and the
template-aware preview of one line with its trained tokens, all from `finetune.datasets` (as `zaya data` uses)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session

from finetune.datasets.pii import PiiReport, scan_file
from finetune.datasets.preview import Preview, preview_line
from finetune.datasets.validation import DEFAULT_MAX_PROBLEMS, ValidationReport, validate_dataset
from server.db.models import File
from server.errors import APIError
from server.services import dataset_reports
from server.services.access import Scope
from server.services.model_resolution import resolve

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class DatasetReport:
    validation: ValidationReport
    pii: PiiReport
    preview: Preview | None
    preview_error: str | None
    tokenizer_error: str | None


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str) -> PreTrainedTokenizerBase:
    # Slow to import, so only when a page needs it; from its own module, because the lazy `transformers` package
    # is not safe to import from two threads at once (the inference engine may be importing it too).
    from transformers.models.auto.tokenization_auto import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _tokenizer_for(session: Session, scope: Scope, model: str) -> tuple[PreTrainedTokenizerBase, tuple[str, str]]:
    """The tokenizer and the (model version id, path) of the checkpoint it comes from."""
    # The base checkpoint holds the tokenizer, also for adapter versions (as the engines load it).
    base = resolve(session, scope, model).base
    return _tokenizer(str(base.path)), (base.version_id, str(base.path))


def inspect(session: Session, scope: Scope, file: File, path: Path, *, model: str | None, line: int) -> DatasetReport:
    """The report of `file` (content at `path`), its preview tokenized for `model` as `scope` may use it. The
    validation and PII reports are computed on the first view and stored (`server.services.dataset_reports`)."""
    tokenizer, tokenizer_ref, tokenizer_error = None, None, None
    if model is not None:
        try:
            tokenizer, tokenizer_ref = _tokenizer_for(session, scope, model)
        except (APIError, OSError, ValueError) as error:
            tokenizer_error = f"No tokenizer for {model!r}: {getattr(error, 'message', error)}"
    preview, preview_error = None, None
    if tokenizer is not None:
        try:
            preview = preview_line(path, line, tokenizer)
        except ValueError as error:  # a line past the end, or one that is not an example
            preview_error = str(error).replace(str(path), "the file")
    parameters = dataset_reports.validation_parameters(
        tokenizer=tokenizer_ref, max_seq_len=None, other=None, max_problems=DEFAULT_MAX_PROBLEMS
    )
    validation, _ = dataset_reports.stored_report(
        session,
        file,
        dataset_reports.VALIDATION,
        parameters,
        lambda: validate_dataset(path, tokenizer, max_problems=DEFAULT_MAX_PROBLEMS).to_dict(),
    )
    pii, _ = dataset_reports.stored_report(
        session, file, dataset_reports.PII, dataset_reports.PII_PARAMETERS, lambda: scan_file(path).to_dict()
    )
    return DatasetReport(
        validation=ValidationReport.from_dict(validation, path),
        pii=PiiReport.from_dict(pii, path),
        preview=preview,
        preview_error=preview_error,
        tokenizer_error=tokenizer_error,
    )
