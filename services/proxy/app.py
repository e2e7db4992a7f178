"""The proxy's HTTP surface: OpenAI routes, tokenizer routes, health, readiness and metrics.

Errors are OpenAI-shaped ({"error": {"message", "type", "param", "code"}}): 400 for bad input (a body that is
not valid JSON or not a JSON object included; `param` names the field), 401 without the API key (when one is
set; /health is open, and so is /metrics, as vLLM's, unless --metrics-require-api-key puts it behind the key),
404 for an unknown model or route, 405 for a wrong method, 413 for a body over the size limit, 415 for a body
that is declared as something other than JSON, 503 while the proxy starts (until every role has a ready
instance) or when a role has no healthy instance, 504 on timeout. A client that disconnects, before its first
token or after, aborts its request on every service.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from epdserve.services.proxy.generation import GenerationError
from epdserve.services.proxy.lora_modules import LoRAUpdateError
from epdserve.services.proxy.metrics import ProxyMetrics
from epdserve.services.proxy.openai_protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                     ErrorResponse, LoadLoRAAdapterRequest, TokenizeRequest,
                                                     UnloadLoRAAdapterRequest)
from epdserve.services.proxy.serving import BadRequest, OpenAIServing, new_request_id

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
# What the OpenAPI schema says bad input gets (FastAPI's default would be a 422 with its own body).
BAD_INPUT = {400: {"model": ErrorResponse, "description": "Bad input"}}
HTTP_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                    405: "MethodNotAllowedError", 413: "RequestTooLargeError", 415: "UnsupportedMediaTypeError"}
# The default limit on a request body: room for a few base64 images of the default maximum image size.
MAX_BODY_BYTES = 64 << 20
# Probes and scrapers' routes, not the API: they answer whatever the proxy's state, and their traffic is
# not counted among the API's responses (a launcher polls /ready twice a second while engines load).
MANAGEMENT_PATHS = ("/health", "/ready", "/metrics", "/version")


def error_body(message: str, error_type: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


class _AsciiJSONResponse(JSONResponse):
    """An error can quote the client's input; escaped to ASCII, text that is not valid UTF-8 cannot fail it."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def error_response(message: str, error_type: str, status: int, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return _AsciiJSONResponse(error_body(message, error_type, status, param), status_code=status, headers=headers)


class _RequireApiKey:
    """Every route but the `open_paths` needs `Authorization: Bearer <key>`, the scheme in any case (RFC 7235),
    in exactly one header: with two, a check of the first and a use of the second could disagree. Plain ASGI:
    the receive wrapper of an @app.middleware("http") hides a client's disconnect from
    request.is_disconnected()."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: tuple[str, ...]) -> None:
        self.app, self.expected, self.open_paths = app, api_key.encode(), open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = Headers(scope=scope).getlist("authorization")
            if len(given) > 1:
                response = error_response("send one Authorization header, not several", "BadRequestError", 400)
                return await response(scope, receive, send)
            scheme, _, key = (given[0] if given else "").strip().partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.expected):
                response = error_response("Invalid or missing API key.", "AuthenticationError", 401)
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class _WhileStarting:
    """Until the proxy serves, every API route answers 503 saying why (`waiting_for()`: the reason, None
    once it serves); the management routes answer throughout. Plain ASGI, like _RequireApiKey."""

    def __init__(self, app: ASGIApp, waiting_for: Callable[[], str | None]) -> None:
        self.app, self.waiting_for = app, waiting_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in MANAGEMENT_PATHS:
            reason = self.waiting_for()
            if reason is not None:
                response = error_response(reason, "ServiceUnavailableError", 503, headers={"Retry-After": "5"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class _CheckBody:
    """A request body must be JSON (when its type is declared at all: FastAPI reads an undeclared body as
    JSON) and at most `max_bytes` long, whether it declares its length or streams in chunks. Plain ASGI,
    like _RequireApiKey."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        media_type = headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type and media_type != "application/json" and not media_type.endswith("+json"):
            response = error_response(f"the body must be JSON (Content-Type: application/json), not {media_type}",
                                      "UnsupportedMediaTypeError", 415)
            return await response(scope, receive, send)
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:  # raised where the route reads the body: FastAPI answers it
                raise HTTPException(413, self._too_large_message)
            return message

        await self.app(scope, counting_receive, send)

    @property
    def _too_large_message(self) -> str:
        return f"the request body is larger than the limit of {self.max_bytes} bytes"

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await error_response(self._too_large_message, "RequestTooLargeError", 413)(scope, receive, send)


class _CountResponses:
    """Every API response counted by status, a 401 from the API key check and an unhandled error's 500
    included; the management routes' are not. Plain ASGI, like _RequireApiKey."""

    def __init__(self, app: ASGIApp, metrics: ProxyMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in MANAGEMENT_PATHS:
            return await self.app(scope, receive, send)
        started = False

        async def counting_send(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.responded(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:
                self.metrics.responded(500)  # Starlette's outermost handler answers it
            raise


def build_app(serving: OpenAIServing, metrics: ProxyMetrics, api_key: str | None = None,
              readiness: Callable[[], Awaitable[tuple[bool, dict]]] | None = None,
              max_body_bytes: int = MAX_BODY_BYTES, waiting_for: Callable[[], str | None] | None = None,
              metrics_require_api_key: bool = False) -> FastAPI:
    """`readiness()` -> (ready, details): whether every role has a healthy instance. `max_body_bytes`: the
    largest request body taken (413 beyond). `waiting_for()`: why the API is not served yet (503), None once
    it is (startup.py); None: served from the start. `api_key`: the key every route but /health and /metrics
    needs (/metrics too with `metrics_require_api_key`)."""
    app = FastAPI(title="epdserve", docs_url=None, redoc_url=None)
    app.add_middleware(_CheckBody, max_bytes=max_body_bytes)  # inside the key check: strangers get a 401
    if api_key:
        # /metrics is open as vLLM's is (scrapers and vLLM's dashboards expect it), unless asked otherwise.
        app.add_middleware(_RequireApiKey, api_key=api_key,
                           open_paths=("/health",) if metrics_require_api_key else ("/health", "/metrics"))
    if waiting_for is not None:
        app.add_middleware(_WhileStarting, waiting_for=waiting_for)
    app.add_middleware(_CountResponses, metrics=metrics)  # added last: outermost, it sees the key check's 401s
    _install_openapi(app)
    _install_error_handlers(app)
    _add_management_routes(app, metrics, readiness)
    _add_model_and_tokenizer_routes(app, serving)
    _add_generation_routes(app, serving, metrics)
    return app


def _install_openapi(app: FastAPI) -> None:
    """The schema without FastAPI's 422 validation responses: bad input is a 400 here."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operation in (op for path in schema["paths"].values() for op in path.values()):
                operation["responses"].pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _install_error_handlers(app: FastAPI) -> None:
    """Every error, whatever raised it, as an OpenAI-shaped body."""

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        # The deepest error is the most telling: a union reports a shallow type mismatch for each other member.
        error = max(exc.errors(), key=lambda e: len(e.get("loc", ())), default={})
        if error.get("type") == "json_invalid":  # its loc is a character offset, not a field
            return error_response(f"the body is not valid JSON: {error.get('ctx', {}).get('error')}",
                                  "BadRequestError", 400)
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body" and not _is_union_member(p))
        message = f"{where or 'body'}: {error.get('msg', 'invalid request')}"
        return error_response(message, "BadRequestError", 400, where or None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":  # the router's: no such route
            message = f"there is no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        return error_response(message, HTTP_ERROR_TYPES.get(exc.status_code, "HTTPError"), exc.status_code,
                              headers=exc.headers)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest):
        return error_response(str(exc), exc.error_type, exc.status, exc.param)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):  # a bug: Starlette still logs its traceback
        return error_response("internal server error", "InternalServerError", 500)

    @app.exception_handler(_ClientGone)
    async def client_gone(request: Request, exc: _ClientGone):
        return Response(status_code=499)  # never sent: the client has gone (nginx's "client closed request")

    @app.exception_handler(GenerationError)
    async def generation_failed(request: Request, exc: GenerationError):
        headers = {"Retry-After": str(math.ceil(exc.retry_after))} if exc.retry_after else None
        return error_response(str(exc), exc.error_type, exc.status, headers=headers)


def _add_management_routes(app: FastAPI, metrics: ProxyMetrics,
                           readiness: Callable[[], Awaitable[tuple[bool, dict]]] | None) -> None:
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        from epdserve import __version__

        return {"version": __version__}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok, details = await readiness() if readiness else (True, {})
        return JSONResponse({"ready": ok, **details}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)


def _add_model_and_tokenizer_routes(app: FastAPI, serving: OpenAIServing) -> None:
    def model_card(name: str | None = None) -> dict:
        """The base model's card, or (as vLLM lists them) a LoRA adapter's, with the base as its parent."""
        lora = serving.loras.get(name) if name is not None else None
        card = {"id": serving.model_name, "object": "model", "created": 0, "owned_by": "epdserve",
                "root": serving.model_name, "parent": None, "max_model_len": serving.max_model_len}
        return card if lora is None else card | {"id": lora.name, "root": lora.path, "parent": serving.model_name}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(), *(model_card(name) for name in serving.loras.paths)]}

    @app.get("/v1/models/{model_id:path}", responses={404: {"model": ErrorResponse, "description": "Unknown model"}})
    async def model(model_id: str) -> dict:
        lora = serving.check_model(model_id)
        return model_card(lora.name if lora else None)

    if serving.loras.runtime_updates:
        _add_lora_update_routes(app, serving)

    @app.post("/tokenize", responses=BAD_INPUT)
    async def tokenize(body: TokenizeRequest) -> dict:
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest("give exactly one of prompt or messages")
        if body.prompt is not None:  # off the event loop: megabytes of text take seconds
            ids = await asyncio.to_thread(serving.tokenizer.encode, body.prompt, body.add_special_tokens)
        else:
            ids, _ = await serving.encode_chat(ChatCompletionRequest(messages=body.messages,
                                                               add_generation_prompt=body.add_generation_prompt))
        return {"tokens": ids, "count": len(ids), "max_model_len": serving.max_model_len}

    @app.post("/detokenize", responses=BAD_INPUT)
    async def detokenize(body: DetokenizeRequest) -> dict:
        serving.check_model(body.model)
        serving.check_token_ids(body.tokens, "tokens")
        return {"prompt": await asyncio.to_thread(serving.tokenizer.decode, body.tokens, False)}


def _add_lora_update_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """vLLM's routes for adapters loaded and unloaded at run time (only with --enable-lora-runtime-updates)."""

    async def update(change) -> Response:
        try:
            return Response(await change(), media_type="text/plain")
        except LoRAUpdateError as exc:
            return error_response(str(exc), HTTP_ERROR_TYPES.get(exc.status, "BadRequestError"), exc.status,
                                  exc.param or "lora_name")

    @app.post("/v1/load_lora_adapter", responses=BAD_INPUT)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        return await update(lambda: serving.loras.load(body.lora_name, body.lora_path))

    @app.post("/v1/unload_lora_adapter", responses=BAD_INPUT)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        return await update(lambda: serving.loras.unload(body.lora_name))


def _add_generation_routes(app: FastAPI, serving: OpenAIServing, metrics: ProxyMetrics) -> None:
    @app.post("/v1/completions", responses=BAD_INPUT)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _respond(request, body.stream, lambda rid: serving.completion(body, rid), "cmpl")

    @app.post("/v1/chat/completions", responses=BAD_INPUT)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _respond(request, body.stream, lambda rid: serving.chat(body, rid), "chatcmpl")

    async def _respond(request: Request, stream: bool, run: Callable[[str], Awaitable[Any]], prefix: str) -> Response:
        request_id = request.headers.get(REQUEST_ID_HEADER) or new_request_id(prefix)
        if len(request_id) > 128:
            raise BadRequest(f"{REQUEST_ID_HEADER} is longer than 128 characters")
        headers = {REQUEST_ID_HEADER: request_id}
        if stream:
            # Errors found before the first byte (bad input, no instance) still get a proper status.
            chunks, first = await _until_disconnected(request, _open(run, request_id), serving.response_timeout,
                                                      metrics)
            return StreamingResponse(_with_first(first, chunks, metrics), media_type="text/event-stream",
                                     headers=headers)
        body = await _until_disconnected(request, run(request_id), serving.response_timeout, metrics)
        return JSONResponse(body, headers=headers)


class _ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def _is_union_member(loc_part: Any) -> bool:
    """Whether a pydantic error location part names a member of a union ("str", "list[int]"), not a field."""
    return isinstance(loc_part, str) and ("[" in loc_part or loc_part in ("str", "int", "float", "bool"))


async def _open(run: Callable[[str], Awaitable[AsyncIterator[str]]],
                request_id: str) -> tuple[AsyncIterator[str], str | None]:
    """The stream and its first event (None if it has none)."""
    chunks = await run(request_id)
    try:
        return chunks, await chunks.__anext__()
    except StopAsyncIteration:
        return chunks, None


async def _with_first(first: str | None, chunks: AsyncIterator[str], metrics: ProxyMetrics) -> AsyncIterator[str]:
    """The stream with its already-read first event; a failure after that ends it with an error event."""
    try:
        if first is None:
            return
        yield first
        async for chunk in chunks:
            yield chunk
    except (asyncio.CancelledError, GeneratorExit):  # the client went away mid-stream
        metrics.aborted("client_disconnect")
        raise
    except GenerationError as exc:
        yield f"data: {json.dumps(error_body(str(exc), exc.error_type, exc.status))}\n\n"
        yield "data: [DONE]\n\n"
    except Exception as exc:  # a fault of ours: the stream still ends as the API says, not cut mid-response
        logger.exception("a stream failed")
        metrics.failed(500)
        yield f"data: {json.dumps(error_body(f'internal error: {type(exc).__name__}', 'InternalServerError', 500))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await chunks.aclose()  # a client that went away aborts the request everywhere


async def _until_disconnected(request: Request, work: Awaitable[Any], timeout: float, metrics: ProxyMetrics) -> Any:
    """Run `work`, cancelling it (and so aborting the request) if the client disconnects or time runs out."""
    task = asyncio.ensure_future(work)
    deadline = asyncio.get_running_loop().time() + timeout
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                metrics.aborted("client_disconnect")
                raise _ClientGone
            if asyncio.get_running_loop().time() > deadline:
                raise GenerationError(f"the request took longer than {timeout:.0f}s", 504, "TimeoutError")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
