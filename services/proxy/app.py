"""The proxy's HTTP surface: OpenAI routes, tokenizer routes, health, readiness and metrics.

Errors are OpenAI-shaped ({"error": {"message", "type", "param", "code"}}): 400 for bad input, 401 without
the API key (when one is set; /health is open), 404 for an unknown model, 503 when a role has no healthy
instance, 504 on timeout. A client that disconnects aborts its request on every service.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from epdserve.services.proxy.generation import GenerationError
from epdserve.services.proxy.metrics import ProxyMetrics
from epdserve.services.proxy.openai_protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                     TokenizeRequest)
from epdserve.services.proxy.serving import BadRequest, OpenAIServing, new_request_id

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"


def error_body(message: str, error_type: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def error_response(message: str, error_type: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, error_type, status, param), status_code=status)


def build_app(serving: OpenAIServing, metrics: ProxyMetrics, api_key: str | None = None,
              readiness: Callable[[], Awaitable[tuple[bool, dict]]] | None = None) -> FastAPI:
    """`readiness()` -> (ready, details): whether every role has a healthy instance."""
    app = FastAPI(title="epdserve", docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_key and request.url.path != "/health":
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error_response("Invalid or missing API key.", "AuthenticationError", 401)
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return error_response(message, "BadRequestError", 400, where or None)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest):
        return error_response(str(exc), exc.error_type, exc.status, exc.param)

    @app.exception_handler(GenerationError)
    async def generation_failed(request: Request, exc: GenerationError):
        return error_response(str(exc), exc.error_type, exc.status)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok, details = await readiness() if readiness else (True, {})
        return JSONResponse({"ready": ok, **details}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": serving.model_name, "object": "model", "created": 0,
                                            "owned_by": "epdserve", "max_model_len": serving.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest("give exactly one of prompt or messages")
        if body.prompt is not None:
            ids = serving.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            ids, _ = await serving.encode_chat(ChatCompletionRequest(messages=body.messages,
                                                               add_generation_prompt=body.add_generation_prompt))
        return {"tokens": ids, "count": len(ids), "max_model_len": serving.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        serving.check_model(body.model)
        vocab = len(serving.tokenizer.hf)
        if any(not 0 <= t < vocab for t in body.tokens):
            raise BadRequest(f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": serving.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _respond(request, body.stream, lambda rid: serving.completion(body, rid), "cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _respond(request, body.stream, lambda rid: serving.chat(body, rid), "chatcmpl")

    async def _respond(request: Request, stream: bool, run: Callable[[str], Awaitable[Any]], prefix: str) -> Response:
        request_id = request.headers.get(REQUEST_ID_HEADER) or new_request_id(prefix)
        if len(request_id) > 128:
            raise BadRequest(f"{REQUEST_ID_HEADER} is longer than 128 characters")
        headers = {REQUEST_ID_HEADER: request_id}
        if stream:
            # Errors found before the first byte (bad input, no instance) still get a proper status.
            chunks = await run(request_id)
            first = await _first(chunks)
            return StreamingResponse(_with_first(first, chunks), media_type="text/event-stream", headers=headers)
        body = await _until_disconnected(request, run(request_id), serving.request_timeout)
        return JSONResponse(body, headers=headers)

    return app


async def _first(chunks: AsyncIterator[str]) -> str | None:
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None


async def _with_first(first: str | None, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The stream with its already-read first event; a failure after that ends it with an error event."""
    try:
        if first is None:
            return
        yield first
        async for chunk in chunks:
            yield chunk
    except GenerationError as exc:
        yield f"data: {json.dumps(error_body(str(exc), exc.error_type, exc.status))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await chunks.aclose()  # a client that went away aborts the request everywhere


async def _until_disconnected(request: Request, work: Awaitable[Any], timeout: float) -> Any:
    """Run `work`, cancelling it (and so aborting the request) if the client disconnects or time runs out."""
    task = asyncio.ensure_future(work)
    deadline = asyncio.get_running_loop().time() + timeout
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise asyncio.CancelledError("client disconnected")
            if asyncio.get_running_loop().time() > deadline:
                raise GenerationError(f"the request took longer than {timeout:.0f}s", 504, "TimeoutError")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
