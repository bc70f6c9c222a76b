"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}} with the HTTP status."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)  # not frozen: Python and the ASGI stack set attributes on exceptions they pass along
class ApiError(Exception):
    status: int  # HTTP status
    message: str
    param: str | None = None  # the request field at fault, as OpenAI spells it
    code: str | None = None
    type: str = "invalid_request_error"
    retry_after_s: int | None = None  # 503: the Retry-After header

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}


def bad_request(param: str | None, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes (the server's --max-body-bytes)", None,
                    "request_too_large")


def unavailable(message: str, retry_after_s: int = 1) -> ApiError:
    return ApiError(503, message, None, "server_busy", "server_error", retry_after_s)
