"""Fine-tuning datasets: formats, validation, preview of the loss mask, PII scanning, synthetic bank cases."""

from .formats import DatasetFormat, Example, parse_record
from .preview import Preview, preview_example, preview_line
from .rendering import TemplateError, TokenizedExample, tokenize_example
from .validation import Problem, ValidationReport, validate_dataset

__all__ = [
    "DatasetFormat",
    "Example",
    "Preview",
    "Problem",
    "TemplateError",
    "TokenizedExample",
    "ValidationReport",
    "parse_record",
    "preview_example",
    "preview_line",
    "tokenize_example",
    "validate_dataset",
]
