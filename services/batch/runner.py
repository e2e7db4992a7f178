"""Runs a batch file's lines through an OpenAI API, a few at a time, and writes one result per line in
input order. The API is any httpx client: a running proxy over HTTP, or the proxy's app in this process
over a local engine (so requests are validated and answered by the very code the server runs)."""
from __future__ import annotations

import asyncio
import json
from typing import Callable, Iterable, TextIO

import httpx

from epdserve.services.batch.lines import BadLine, error_line, new_id, parse_line, response_line

REQUEST_ID_HEADER = "X-Request-Id"


class BatchRunner:
    """`concurrency`: lines in flight at once; `on_done()` is called as each line finishes (a progress bar)."""

    def __init__(self, client: httpx.AsyncClient, concurrency: int = 16, model: str | None = None,
                 on_done: Callable[[], None] = lambda: None) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self.client, self.concurrency, self.model, self.on_done = client, concurrency, model, on_done

    async def run(self, lines: Iterable[str], out: TextIO) -> dict[str, int]:
        """Write a result line to `out` for each non-blank input line, in order; count them by outcome."""
        counts = {"ok": 0, "failed": 0}
        slots = asyncio.Semaphore(self.concurrency)
        pending: list[asyncio.Task] = []  # in input order; the head is written as soon as it is done

        async def one(text: str) -> dict:
            try:
                return await self._process(text)
            except Exception as exc:  # whatever one line does, the others are written
                return error_line(None, f"the line could not be processed: {type(exc).__name__}: {exc}",
                                  "internal_error")
            finally:
                slots.release()
                self.on_done()

        def write(result: dict) -> None:
            counts["ok" if result["error"] is None else "failed"] += 1
            out.write(json.dumps(result, ensure_ascii=False) + "\n")

        for text in lines:
            if not text.strip():
                continue
            await slots.acquire()
            pending.append(asyncio.create_task(one(text)))
            while pending and pending[0].done():
                write(pending.pop(0).result())
        for task in pending:
            write(await task)
        return counts

    async def _process(self, text: str) -> dict:
        try:
            line = parse_line(text, self.model)
        except BadLine as exc:
            return error_line(exc.custom_id, str(exc))
        # The line's id is the request's id on the server too (its logs, its response's id), refusals included.
        line_id = new_id()
        try:
            response = await self.client.post(line.url, json=line.body, headers={REQUEST_ID_HEADER: line_id})
        except ValueError as exc:  # NaN or Infinity in the body: not JSON, so it cannot be sent
            return error_line(line.custom_id, f"the body cannot be sent as JSON: {exc}", "invalid_request", line_id)
        except httpx.HTTPError as exc:
            return error_line(line.custom_id, f"the request failed: {type(exc).__name__}: {exc}", "request_failed",
                              line_id)
        try:
            body = response.json()
        except ValueError:
            body = response.text
        return response_line(line.custom_id, response.status_code, line_id, body)
