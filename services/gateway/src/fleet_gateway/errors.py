"""Error bodies in each client's own shape, chosen by the request's path.

- OpenAI (everything by default): {"error": {"message", "type", "param", "code"}}
- Anthropic (/v1/messages...): {"type": "error", "error": {"type", "message"}}
- Ollama (/api/..., /ollama/api/...): {"error": "message"}

Handlers raise ApiError; `error_middleware` turns it (and aiohttp's own HTTP errors, and crashes)
into the body the client's SDK parses.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from fleet_bus import BusUnavailable

log = logging.getLogger("fleet_gateway.errors")
# What a 503 for an unreachable message bus tells clients to wait before retrying (NATS restarts fast).
BUS_RETRY_AFTER_S = 5

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable",
    504: "timeout",
}


def error_type_for(status: int) -> str:
    """The OpenAI error `type` that goes with an HTTP status."""
    if status in _TYPE_BY_STATUS:
        return _TYPE_BY_STATUS[status]
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(
    status: int, message: str, type: str | None = None, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": type or error_type_for(status),
            "param": param,
            "code": code,
        }
    }


_ANTHROPIC_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
OPENAI, ANTHROPIC, OLLAMA = "openai", "anthropic", "ollama"


def anthropic_error_type(status: int) -> str:
    if status in _ANTHROPIC_TYPE_BY_STATUS:
        return _ANTHROPIC_TYPE_BY_STATUS[status]
    return "invalid_request_error" if status < 500 else "api_error"


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


def error_shape(path: str) -> str:
    """Which client family a path serves, for the shape of its errors."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return ANTHROPIC
    if path.startswith(("/api/", "/ollama/api/")):
        return OLLAMA
    return OPENAI


def api_error(
    status: int,
    message: str,
    type: str | None = None,
    param: str | None = None,
    code: str | None = None,
    shape: str = OPENAI,
) -> web.Response:
    """A JSON error response in the client's shape; the OpenAI `type` defaults from the status."""
    if shape == ANTHROPIC:
        body = anthropic_error_body(status, message)
    elif shape == OLLAMA:
        body = {"error": message}
    else:
        body = error_body(status, message, type, param, code)
    return web.Response(status=status, body=msgspec.json.encode(body), content_type="application/json")


class ApiError(Exception):
    """Raised by handlers and adapters; rendered by `error_middleware` (or `.response()`)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or error_type_for(status)
        self.param = param
        self.code = code
        self.headers = headers or {}  # e.g. WWW-Authenticate on a 401, Retry-After on a 429

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.type, self.param, self.code)

    def response(self, shape: str = OPENAI) -> web.Response:
        response = api_error(self.status, self.message, self.type, self.param, self.code, shape)
        response.headers.update(self.headers)
        return response

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r}, type={self.type!r}, param={self.param!r})"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """ApiError and aiohttp HTTP errors (404, 405, 413...) become error bodies in the shape of the
    path's clients; BusUnavailable (a command or task NATS did not take) a 503; crashes a 500."""
    shape = error_shape(request.path)
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response(shape)
    except BusUnavailable as exc:  # NATS is down: its message says the command/task was not accepted
        log.warning("%s %s: %s", request.method, request.path, exc)
        response = api_error(503, str(exc), code="bus_unavailable", shape=shape)
        response.headers["Retry-After"] = str(BUS_RETRY_AFTER_S)
        return response
    except ConnectionResetError:  # the client hung up while a stream was written: nobody to answer
        log.debug("%s %s: the client went away mid-response", request.method, request.path)
        raise
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = api_error(exc.status, exc.text or exc.reason, shape=shape)
        if "Allow" in exc.headers:  # 405 says which methods the route takes
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return api_error(500, "internal server error", shape=shape)


T = TypeVar("T")
_AT_PATH = re.compile(r"^(?P<message>.*?) - at `(?P<path>\$[^`]*)`$", re.DOTALL)
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]+)`$")


def _param_from_path(path: str) -> str | None:
    """msgspec's `$.messages[0].role` -> OpenAI's `messages[0].role`; `$` -> None."""
    rest = path[1:]
    return rest.removeprefix(".") or None


def _validation_error(exc: msgspec.ValidationError) -> ApiError:
    text = str(exc)
    path = "$"
    matched = _AT_PATH.match(text)
    if matched:
        text, path = matched["message"], matched["path"]
    param = _param_from_path(path)
    missing = _MISSING.match(text)
    if missing:
        field = missing["field"]
        param = f"{param}.{field}" if param else field
        return ApiError(400, f"Missing required parameter: '{param}'.", param=param)
    unknown = _UNKNOWN.match(text)
    if unknown:
        field = unknown["field"]
        param = f"{param}.{field}" if param else field
        return ApiError(400, f"Unrecognized request argument supplied: {param}", param=param)
    if param is None:
        return ApiError(400, f"Invalid request body: {text}.")
    return ApiError(400, f"Invalid type or value for '{param}': {text}.", param=param)


def decode_json_body(body: bytes, body_type: type[T]) -> T:
    """Decode a JSON request body into `body_type`; ApiError(400) naming the field when it is wrong."""
    if not body.strip():
        raise ApiError(400, "The request body is empty; expected a JSON object.")
    try:
        return msgspec.json.decode(body, type=body_type)
    except msgspec.ValidationError as exc:
        raise _validation_error(exc) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"We could not parse the JSON body of your request: {exc}.") from None
    except UnicodeDecodeError as exc:  # a string that is not UTF-8 (msgspec decodes strings lazily)
        raise ApiError(
            400, f"The request body is not valid UTF-8: {exc.reason} at byte {exc.start}."
        ) from None
