"""uvicorn's access log without query strings: a secret sent in a URL (`?api_key=...`, a signed link) never reaches
a log file. Each access line keeps its path and shows `?[redacted]` where a query string was."""

from __future__ import annotations

import logging

ACCESS_LOGGER = "uvicorn.access"
REDACTED_QUERY = "?[redacted]"


class QueryStringRedactor(logging.Filter):
    """Rewrites uvicorn's access records (`'%s - "%s %s HTTP/%s" %d'`: client, method, path with query, HTTP
    version, status) so the path carries no query string."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].partition("?")[0] + REDACTED_QUERY, *args[3:])
        return True


def redact_query_strings() -> None:
    """Add the filter to uvicorn's access logger (once). A logger's filters outlive uvicorn's logging setup, which
    replaces handlers only, so this may run before or after it."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(each, QueryStringRedactor) for each in logger.filters):
        logger.addFilter(QueryStringRedactor())
