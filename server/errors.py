"""Errors that become OpenAI-style bodies: `{"error": {"message", "type", "param", "code"}}`.

Services raise these; the handlers in `server.api.errors` turn them (and every other failure) into responses.
"""

from __future__ import annotations


class APIError(Exception):
    status_code = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequest(APIError):
    status_code = 400


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


class TooManyRequests(APIError):
    status_code = 429
    type = "rate_limit_error"


class GenerationFailed(APIError):
    status_code = 500
    type = "server_error"


class ServiceUnavailable(APIError):
    status_code = 503
    type = "server_error"
