"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine import SamplingParamError
from server.async_engine import EngineDeadError
from server.request_handle import RequestFailedError, RequestTimeoutError

logger = logging.getLogger(__name__)

INTERNAL_MESSAGE = "internal server error; the server log has the details"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        # ASCII-escaped: a message that quotes the request (a lone surrogate in it) must not fail to encode.
        return Response(json.dumps(self.body()), status_code=self.status, headers=self.headers,
                        media_type="application/json")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def internal_error() -> APIError:
    return APIError(500, INTERNAL_MESSAGE, type="server_error", code="internal_error")


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="service_unavailable")


def timed_out(message: str) -> APIError:
    """--request-timeout expired: the server gave up on the request (504, as a gateway that timed out would)."""
    return APIError(504, f"{message} (--request-timeout); it was aborted", type="server_error", code="request_timeout")


def too_large(limit: int) -> APIError:
    return APIError(
        413, f"the request body is larger than this server's limit of {limit} bytes (--max-body-bytes)",
        code="request_too_large",
    )


def from_exception(exc: BaseException) -> APIError:
    """Map any exception to the error a client should see; unexpected ones are logged, never echoed."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, SamplingParamError):
        return bad_request(str(exc), param=exc.param)
    if isinstance(exc, EngineDeadError):
        return APIError(500, str(exc), type="server_error", code="engine_dead")
    if isinstance(exc, RequestTimeoutError):
        return timed_out(str(exc))
    if isinstance(exc, RequestFailedError):  # the engine has logged why
        return internal_error()
    logger.error("internal error", exc_info=exc)
    return internal_error()


def _validation_param(errors: list[dict]) -> str | None:
    """OpenAI names the field as "messages.0.role". Pydantic's locations start with "body" and, for a
    union, end with the member tried ("prompt", "list[int]", 0): the locations' common prefix drops those."""
    locs = [tuple(e.get("loc", ()))[1:] if tuple(e.get("loc", ()))[:1] == ("body",) else tuple(e.get("loc", ()))
            for e in errors]
    if not locs:
        return None
    prefix = locs[0]
    for loc in locs[1:]:
        n = 0
        while n < min(len(prefix), len(loc)) and prefix[n] == loc[n]:
            n += 1
        prefix = prefix[:n]
    if not prefix:  # several unrelated fields: name the first
        prefix = locs[0][:1]
    return ".".join(str(p) for p in prefix) or None


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        errors = list(exc.errors())
        if errors and errors[0].get("type") == "json_invalid":
            reason = (errors[0].get("ctx") or {}).get("error", "")
            message = f"the request body is not valid JSON: {reason}".rstrip(": ")
            return bad_request(message, code="invalid_json").response()
        param = _validation_param(errors)
        msg = errors[0].get("msg", "invalid request") if errors else "invalid request"
        message = f"{param}: {msg}" if param else msg
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more errors)"
        return bad_request(message, param=param, code="invalid_value").response()

    @app.exception_handler(SamplingParamError)
    async def _sampling(_: Request, exc: SamplingParamError) -> Response:
        return bad_request(str(exc), param=exc.param).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        return from_exception(exc).response()  # logs it; the body never carries the details

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers).response()
