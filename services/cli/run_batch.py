"""`epdserve run-batch`: an OpenAI batch file through a local engine, or through a running server.

    epdserve run-batch -i requests.jsonl -o results.jsonl --model PATH          # an engine in this process
    epdserve run-batch -i requests.jsonl -o results.jsonl --base-url URL [--api-key KEY]

Lines are answered by the proxy's own OpenAI layer either way: in-process, its app runs over a local
engine (text models; image inputs need the encoder of a deployment). Results come in input order, one per
non-blank input line; a bad line gets an error line, and the run goes on.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Callable

import httpx


def add_run_batch_parser(subparsers, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Adds `run-batch` to the `epdserve` command's subparsers; `add_engine_args`: the engine's options."""
    p = subparsers.add_parser("run-batch", help="run an OpenAI batch file (JSONL) through a local engine or a server",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-i", "--input-file", required=True, help="JSONL: one {custom_id, method, url, body} per line")
    p.add_argument("-o", "--output-file", required=True, help="JSONL results, in input order")
    p.add_argument("--model", help="model folder for the local engine; with --base-url, the model of lines "
                                   "whose body names none")
    p.add_argument("--served-model-name", help="the name lines' bodies use for the local engine's model "
                                               "(default: the model folder's name)")
    p.add_argument("--base-url", help="send the lines to this running server instead (e.g. http://127.0.0.1:8000)")
    p.add_argument("--api-key", help="with --base-url: the server's API key")
    p.add_argument("--concurrency", type=int, default=16, help="lines in flight at once (default: %(default)s)")
    p.add_argument("--no-progress-bar", action="store_true")
    add_engine_args(p)
    p.set_defaults(func=_run_batch_command)


def _run_batch_command(args: argparse.Namespace) -> int:
    if args.concurrency < 1:
        raise SystemExit("epdserve: error: --concurrency must be at least 1")
    if not Path(args.input_file).is_file():
        raise SystemExit(f"epdserve: error: --input-file {args.input_file}: no such file")
    counts = asyncio.run(run_batch(args))
    print(f"run-batch: {counts['ok']} succeeded, {counts['failed']} failed; results in {args.output_file}",
          file=sys.stderr)
    return 0


async def run_batch(args: argparse.Namespace) -> dict[str, int]:
    from tqdm import tqdm

    from epdserve.services.batch.runner import BatchRunner

    with open(args.input_file, encoding="utf-8") as f:
        total = sum(1 for line in f if line.strip())
    async with AsyncExitStack() as stack:
        if args.base_url:
            client, model = _server_client(args), args.model
        else:
            client, model = await _local_client(args, stack), None
        await stack.enter_async_context(client)
        bar = stack.enter_context(tqdm(total=total, unit="req", desc="run-batch", disable=args.no_progress_bar))
        runner = BatchRunner(client, args.concurrency, model, on_done=bar.update)
        with open(args.input_file, encoding="utf-8") as lines, open(args.output_file, "w", encoding="utf-8") as out:
            return await runner.run(lines, out)


def _server_client(args: argparse.Namespace) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url.rstrip("/").removesuffix("/v1")  # lines' urls start with /v1
    return httpx.AsyncClient(base_url=base, headers=headers, timeout=None)


async def _local_client(args: argparse.Namespace, stack: AsyncExitStack) -> httpx.AsyncClient:
    """A client of the proxy's app over an engine in this process (shut down with `stack`)."""
    from epdserve.services.batch.engine_backend import EngineBackend
    from epdserve.services.cli.main import engine_config, model_folder
    from epdserve.services.proxy.app import build_app
    from epdserve.services.proxy.metrics import ProxyMetrics
    from epdserve.services.proxy.serving import OpenAIServing
    from epdserve.shared.engine import AsyncLLM
    from epdserve.shared.processing.tokenizer import load_tokenizer

    model = model_folder(args)
    config = engine_config(args, model)
    llm = await asyncio.to_thread(AsyncLLM.from_config, config, detokenize=False, num_threads=args.threads)
    stack.callback(llm.shutdown)
    name = args.served_model_name or Path(model).name
    metrics = ProxyMetrics(name)
    serving = OpenAIServing(name, load_tokenizer(model), EngineBackend(llm), config.model.max_model_len,
                            config.model.vocab_size, metrics)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(serving, metrics)),
                             base_url="http://run-batch", timeout=None)
