"""The OpenAI batch file format, one JSON object a line, as `vllm run-batch` and the OpenAI Batch API use it.

Input:  {"custom_id": str, "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body": {...}}
Output: {"id": str, "custom_id": str | null, "response": {"status_code", "request_id", "body"} | null,
         "error": {"code", "message"} | null}

A line the API answered carries its response, and, when the status is not 2xx, the error object of its body
too. A line that never reached the API (not JSON, an unknown url, a wrong method) has no response; one that
cannot even be read has `custom_id` null.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, NamedTuple

from epdserve.services.proxy.openai_protocol import first_unencodable

URLS = ("/v1/chat/completions", "/v1/completions")


class BatchLine(NamedTuple):
    custom_id: str
    url: str
    body: dict


class BadLine(Exception):
    """The line cannot be sent: `custom_id` (when it could be read) and why."""

    def __init__(self, custom_id: str | None, message: str) -> None:
        super().__init__(message)
        self.custom_id = custom_id


def parse_line(text: str, model: str | None = None) -> BatchLine:
    """The request of one input line; `model` fills in a body without one. Raises BadLine."""
    try:
        item = json.loads(text)  # NaN in a body goes through: the API refuses it for its field
    except json.JSONDecodeError as exc:
        raise BadLine(None, f"the line is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadLine(None, "the line is not valid JSON: it nests deeper than this reader follows") from None
    if not isinstance(item, dict):
        raise BadLine(None, "the line is not a JSON object")
    unencodable = first_unencodable(item)
    if unencodable is not None:
        custom_id = item.get("custom_id") if unencodable[:1] != ("custom_id",) else None
        raise BadLine(custom_id if isinstance(custom_id, str) else None,
                      f"{'.'.join(map(str, unencodable)) or 'the line'}: text must be valid UTF-8 "
                      "(found an unpaired surrogate)")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BadLine(None, "custom_id must be a non-empty string")
    if item.get("method", "POST") != "POST":
        raise BadLine(custom_id, f"method must be POST, not {item.get('method')!r}")
    url = item.get("url")
    if url not in URLS:
        raise BadLine(custom_id, f"url must be one of {', '.join(URLS)}, not {url!r}")
    body = item.get("body")
    if not isinstance(body, dict):
        raise BadLine(custom_id, "body must be a JSON object")
    if body.get("stream"):
        raise BadLine(custom_id, "stream is not supported in a batch: each line gets one whole response")
    if model is not None and "model" not in body:
        body = {**body, "model": model}
    return BatchLine(custom_id, url, body)


def response_line(custom_id: str, status_code: int, request_id: str, body: Any) -> dict:
    """The result of a line the API answered; `request_id` is also the line's id."""
    error = body.get("error") if status_code // 100 != 2 and isinstance(body, dict) else None
    if status_code // 100 != 2 and error is None:
        error = {"code": status_code, "message": str(body)}
    return {"id": request_id, "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body}, "error": error}


def error_line(custom_id: str | None, message: str, code: str = "invalid_request", line_id: str | None = None) -> dict:
    return {"id": line_id or new_id(), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def new_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"
