"""Errors that become OpenAI-style bodies: `{"error": {"message", "type", "param", "code"}}`.

Services raise these; the handlers in `server.api.errors` turn them (and every other failure) into responses.
"""

from __future__ import annotations

CLOSE_CONNECTION = {"Connection": "close"}


class APIError(Exception):
    status_code = 400
    type = "invalid_request_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


class InvalidRequest(APIError):
    status_code = 400


class LineTooLong(InvalidRequest):
    """An upload's line is over `Settings.max_upload_line_bytes`: refused while the body is still arriving."""

    def __init__(self, line_number: int, max_line_bytes: int) -> None:
        super().__init__(
            f"Line {line_number} of the file is longer than the limit of {max_line_bytes} bytes per line.",
            param="file",
            code="line_too_long",
            # The rest of the body is not read (beyond a short drain): close the connection after the answer.
            headers=dict(CLOSE_CONNECTION),
        )
        self.line_number = line_number


class Unauthorized(APIError):
    status_code = 401
    type = "authentication_error"


class Forbidden(APIError):
    status_code = 403
    type = "permission_error"


class NotFound(APIError):
    status_code = 404


class Conflict(APIError):
    status_code = 409


class PayloadTooLarge(APIError):
    status_code = 413

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        # The rest of the body is never read: close the connection rather than let the server take it all in.
        super().__init__(message, param=param, code=code, headers=dict(CLOSE_CONNECTION))


class TooManyRequests(APIError):
    status_code = 429
    type = "rate_limit_error"


class QuotaExceeded(TooManyRequests):
    """A project or key is at one of its quotas (`Settings`): nothing was stored or started. The code names the
    quota."""

    type = "insufficient_quota"


class RateLimited(TooManyRequests):
    """A key used up its requests or tokens for the current window: retry after `retry_after_s` seconds."""

    def __init__(self, message: str, *, retry_after_s: int | None, param: str | None = None) -> None:
        headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
        super().__init__(message, param=param, code="rate_limit_exceeded", headers=headers)


class GenerationFailed(APIError):
    status_code = 500
    type = "server_error"


class ServiceUnavailable(APIError):
    status_code = 503
    type = "server_error"


class InsufficientStorage(APIError):
    """The server's disk is full: nothing was stored; the request can be retried once space is freed."""

    status_code = 507
    type = "server_error"
