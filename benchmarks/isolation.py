"""Isolation under hostile requests: while one request does its worst, does a small one still get served?

A stack of separate services (1 encoder, 1 prefill, 2 decodes and the proxy, each `epdserve serve ...`, so
that one can be killed without stopping the others) on the multimodal demo model. For each probe a
hostile request (or fault) runs for at most --probe-seconds while two canaries loop beside it:

    chat      a 4-token greedy chat completion, one after the other
    models    GET /v1/models every 0.2 s (the proxy's event loop)

and the probe records the hostile request's HTTP status and time, and each canary's worst latency (an
answer still outstanding when the probe ends counts with its time so far) and failures. The probes:

    big_json_schema        response_format json_schema with 20,000 required properties (~0.8 MB)
    big_ebnf               structured_outputs.grammar with 20,000 rules
    vocab_logit_bias_n128  n=128, logit_bias -100 on 49,000 token ids, 16 tokens (one per decode)
    n128_long              n=128, max_tokens 512 (one per decode)
    unsatisfiable_choice   guided_choice with a supplementary-plane character
    schema_over_wire_cap   a json_schema over 1 MiB
    tokenize_huge          POST /tokenize of 5.4 MB of text
    many_tools             500 large tool definitions
    batch_bad_lines        `epdserve run-batch` of a file with bad lines among good ones
    bearer_case            auth: `bearer`, `BEARER`, and two Authorization headers
    kill_encoder           SIGKILL the only encoder; an image request beside the chat canary
    kill_decode            SIGKILL one of the two decodes (the canary must be routed around it)
    prefill_killed_overload the prefill gone, 16 streams of ~2,000-token prompts: time to each first byte

Writes benchmarks/results/isolation.json (and prints a table). Run it on two trees to compare:

    .venv/bin/python benchmarks/isolation.py                        # ~15 minutes on 2 cores
    .venv/bin/python benchmarks/isolation.py --probes n128_long,kill_decode --out /tmp/iso.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from stacks import ROOT, free_port, machine, wait_ready

API_KEY = "isolation-probe-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


class ServiceStack:
    """Every role a process of its own (`epdserve serve`), started and stopped by pid."""

    def __init__(self, model: str, log_dir: Path, encoders: int, prefills: int, decodes: int,
                 engine_args: list[str], proxy_args: list[str]) -> None:
        base = [sys.executable, "-m", "epdserve.services.cli", "serve"]
        self.procs: dict[str, subprocess.Popen] = {}
        self.argv: dict[str, list[str]] = {}
        self.http_ports: dict[str, int] = {}
        targets: dict[str, list[str]] = {}
        for role, count in (("encoder", encoders), ("prefill", prefills), ("decode", decodes)):
            for i in range(count):
                name, port, http_port = f"{role}-{i}", free_port(), free_port()
                self.argv[name] = [*base, role, "--model", model, "--port", str(port), "--data-port",
                                   str(free_port()), "--http-port", str(http_port), "--engine-id", name,
                                   *(["--threads", "1", *engine_args] if role != "encoder" else [])]
                self.http_ports[name] = http_port
                targets.setdefault(role, []).append(f"127.0.0.1:{port}")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv["proxy"] = [*base, "proxy", "--model", model, "--port", str(self.port), "--api-key", API_KEY,
                              "--served-model-name", "demo", *proxy_args,
                              *[arg for role, addrs in targets.items() for arg in (f"--{role}", ",".join(addrs))]]
        self.log_dir = log_dir

    def start(self, timeout: float = 600) -> None:
        for name, argv in self.argv.items():
            self.procs[name] = subprocess.Popen(argv, stdout=(self.log_dir / f"{name}.log").open("wb"),
                                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for name, port in self.http_ports.items():
            wait_ready(f"http://127.0.0.1:{port}/ready", self.procs[name], timeout, name, lambda: self.tail(name))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                r = httpx.get(self.url + "/ready", headers=AUTH, timeout=2)
                if r.status_code == 200 and sum(r.json()["healthy_instances"].values()) == len(self.http_ports):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the proxy never saw every service ready:\n" + self.tail("proxy"))

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def idle(self) -> bool:
        """Every live engine has nothing running or waiting."""
        for name, port in self.http_ports.items():
            if name.startswith("encoder") or not self.alive(name):
                continue
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=AUTH, timeout=5).text
            for line in text.splitlines():
                if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")) and \
                        float(line.rsplit(" ", 1)[1]) > 0:
                    return False
        return True

    def tail(self, name: str, n: int = 2000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Canary:
    """Sends `make()` again and again until stopped; the worst latency and the failures."""

    def __init__(self, name: str, make, pause: float) -> None:
        self.name, self.make, self.pause = name, make, pause
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._current: float | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            self._current = time.monotonic()
            try:
                r = await self.make()
                if r.status_code != 200:
                    self.failures.append(f"{r.status_code}: {r.text[:120]}")
            except httpx.HTTPError as exc:
                self.failures.append(f"{type(exc).__name__}: {exc}")
            self.latencies.append(time.monotonic() - self._current)
            self._current = None
            await asyncio.sleep(self.pause)

    async def stop(self) -> dict:
        outstanding = None if self._current is None else time.monotonic() - self._current
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        worst = max([*self.latencies, *([outstanding] if outstanding is not None else [])], default=0.0)
        return {"answered": len(self.latencies), "worst_s": round(worst, 3),
                "outstanding_at_end": outstanding is not None, "failures": len(self.failures),
                "first_failures": self.failures[:3]}


def chat(text: str, **extra) -> dict:
    return {"model": "demo", "messages": [{"role": "user", "content": text}], **extra}


def huge_schema(num_properties: int) -> dict:
    names = [f"field_{i:05d}" for i in range(num_properties)]
    return {"type": "object", "properties": {n: {"type": "string"} for n in names}, "required": names}


def huge_grammar(num_rules: int) -> str:
    rules = [f'rule{i} ::= "t{i}"' for i in range(num_rules)]
    return "root ::= " + " | ".join(f"rule{i}" for i in range(num_rules)) + "\n" + "\n".join(rules)


async def on_every_decode(send, num_decodes: int = 2, stagger: float = 3.0) -> httpx.Response:
    """`send()` once per decode, `stagger` seconds apart (by then the router sees the first one's load and
    sends the next elsewhere), so that no decode is left free for the canary; the first answer."""
    tasks = []
    for i in range(num_decodes):
        tasks.append(asyncio.create_task(send()))
        if i + 1 < num_decodes:
            await asyncio.sleep(stagger)
    responses = await asyncio.gather(*tasks)
    return responses[0]


async def post(client: httpx.AsyncClient, path: str, body: dict, timeout: float, headers=None) -> httpx.Response:
    return await client.post(path, json=body, timeout=timeout, headers=headers)


def hostile_requests(image_png: bytes):
    """probe name -> async function(client, timeout) -> response (or a dict of results)."""
    import base64

    image_url = "data:image/png;base64," + base64.b64encode(image_png).decode()
    return {
        "big_json_schema": lambda c, t: post(c, "/v1/chat/completions", chat(
            "Fill the form.", max_tokens=8, response_format={"type": "json_schema", "json_schema": {
                "name": "form", "schema": huge_schema(20_000)}}), t),
        "big_ebnf": lambda c, t: post(c, "/v1/completions", {
            "model": "demo", "prompt": "Say a token:", "max_tokens": 4,
            "structured_outputs": {"grammar": huge_grammar(20_000)}}, t),
        "vocab_logit_bias_n128": lambda c, t: on_every_decode(lambda: post(c, "/v1/completions", {
            "model": "demo", "prompt": "Once upon a time", "n": 128, "max_tokens": 16,
            "logit_bias": {str(i): -100 for i in range(49_000)}}, t)),
        "n128_long": lambda c, t: on_every_decode(lambda: post(c, "/v1/completions", {
            "model": "demo", "prompt": "Once upon a time", "n": 128, "max_tokens": 512, "ignore_eos": True}, t)),
        "unsatisfiable_choice": lambda c, t: post(c, "/v1/chat/completions", chat(
            "Pick one.", max_tokens=8, guided_choice=["\U000F5FCB"]), t),
        "schema_over_wire_cap": lambda c, t: post(c, "/v1/chat/completions", chat(
            "Fill the form.", max_tokens=8, response_format={"type": "json_schema", "json_schema": {
                "name": "form", "schema": huge_schema(30_000) | {"description": "x" * (1 << 20)}}}), t),
        "tokenize_huge": lambda c, t: post(c, "/tokenize", {
            "model": "demo", "prompt": "the quick brown fox jumps over the lazy dog " * 120_000}, t),
        "many_tools": lambda c, t: post(c, "/v1/chat/completions", chat("Hello", max_tokens=4, tools=[
            {"type": "function", "function": {"name": f"tool_{i}", "description": "d" * 2000,
                                              "parameters": {"type": "object", "properties": {
                                                  f"arg_{j}": {"type": "string", "description": "a" * 50}
                                                  for j in range(20)}}}} for i in range(500)]), t),
        "image_request": lambda c, t: post(c, "/v1/chat/completions", {
            "model": "demo", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": "What is it?"}]}]},
            t),
    }


async def run_probe(stack: ServiceStack, name: str, hostile, probe_seconds: float) -> dict:
    async with httpx.AsyncClient(base_url=stack.url, headers=AUTH) as client:
        canaries = [
            Canary("chat", lambda: post(client, "/v1/chat/completions", chat("Say hi.", max_tokens=4, temperature=0),
                                        probe_seconds + 60), 0.2),
            Canary("models", lambda: client.get("/v1/models", timeout=probe_seconds + 60), 0.2),
        ]
        for canary in canaries:
            canary.start()
        await asyncio.sleep(1.0)  # the canaries' baseline
        started = time.monotonic()
        task = asyncio.create_task(hostile(client, probe_seconds))
        done, _ = await asyncio.wait({task}, timeout=probe_seconds)
        elapsed = time.monotonic() - started
        if done:
            try:
                response = task.result()
                outcome = response if isinstance(response, dict) else {
                    "status": response.status_code, "body": response.text[:200]}
            except httpx.HTTPError as exc:
                outcome = {"status": None, "error": f"{type(exc).__name__}: {exc}"}
        else:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            outcome = {"status": None, "error": f"still running after {probe_seconds:.0f}s: cancelled"}
        await asyncio.sleep(1.0)  # a canary sent as the hostile request ended still counts
        results = {c.name: await c.stop() for c in canaries}
    return {"probe": name, "hostile": outcome, "hostile_seconds": round(elapsed, 2), "canaries": results}


async def batch_probe(stack: ServiceStack, tmp: Path) -> dict:
    good = {"custom_id": "good-{}", "method": "POST", "url": "/v1/completions",
            "body": {"model": "demo", "prompt": "Hello", "max_tokens": 2, "temperature": 0}}
    lines = [json.dumps(good).replace("{}", "1"),
             '{"custom_id": "nan", "method": "POST", "url": "/v1/completions", '
             '"body": {"model": "demo", "prompt": "Hi", "temperature": NaN}}',
             '{"custom_id": "surrogate", "method": "POST", "url": "/v1/completions", '
             '"body": {"model": "demo", "prompt": "\\ud800"}}',
             "[" * 100_000,
             json.dumps(good).replace("{}", "2")]
    src, out = tmp / "batch.jsonl", tmp / "batch-out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "epdserve.services.cli", "run-batch", "-i", str(src), "-o", str(out), "--base-url",
        stack.url, "--api-key", API_KEY, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    written = out.read_text().splitlines() if out.exists() else []
    return {"probe": "batch_bad_lines", "hostile": {
        "exit_code": proc.returncode, "lines": len(lines), "results_written": len(written),
        "stderr_tail": err.decode(errors="replace")[-300:]}, "hostile_seconds": round(time.monotonic() - started, 2),
        "canaries": {}}


async def auth_probe(stack: ServiceStack) -> dict:
    body = chat("Hi", max_tokens=2, temperature=0)
    statuses = {}
    async with httpx.AsyncClient(base_url=stack.url) as client:
        for label, headers in (("bearer lowercase", [("Authorization", f"bearer {API_KEY}")]),
                               ("BEARER uppercase", [("Authorization", f"BEARER {API_KEY}")]),
                               ("good then bad", [("Authorization", f"Bearer {API_KEY}"),
                                                  ("Authorization", "Bearer wrong")]),
                               ("bad then good", [("Authorization", "Bearer wrong"),
                                                  ("Authorization", f"Bearer {API_KEY}")])):
            r = await client.post("/v1/chat/completions", json=body, headers=httpx.Headers(headers), timeout=60)
            statuses[label] = r.status_code
    return {"probe": "bearer_case", "hostile": statuses, "hostile_seconds": 0, "canaries": {}}


async def overload_probe(stack: ServiceStack, probe_seconds: float) -> dict:
    """The prefill killed; 16 streams of ~2,000-token prompts land on the decodes: seconds to each one's
    first byte (a status line or an SSE event), None if none came within the probe."""
    stack.kill("prefill-0")
    await asyncio.sleep(3)
    firsts: list[float | None] = []
    statuses: list[int | None] = []
    errors: list[str] = []

    async def one(i: int, client: httpx.AsyncClient) -> None:
        started = time.monotonic()
        prompt = f"Document {i}: " + " ".join(f"word{j % 500}" for j in range(1900))
        try:
            async with client.stream("POST", "/v1/completions", json={
                    "model": "demo", "prompt": prompt, "max_tokens": 8, "stream": True}, timeout=probe_seconds) as r:
                statuses.append(r.status_code)
                if r.status_code != 200:
                    errors.append((await r.aread()).decode(errors="replace")[:160])
                async for _ in r.aiter_bytes():
                    firsts.append(time.monotonic() - started)
                    return
        except httpx.HTTPError:
            statuses.append(None)
        firsts.append(None)

    async with httpx.AsyncClient(base_url=stack.url, headers=AUTH) as client:
        tasks = [asyncio.create_task(one(i, client)) for i in range(16)]
        _, pending = await asyncio.wait(tasks, timeout=probe_seconds)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    got = [f for f in firsts if f is not None]
    return {"probe": "prefill_killed_overload", "hostile": {
        "streams": 16, "first_byte_within_probe": len(got), "statuses": statuses, "first_errors": errors[:2],
        "worst_first_byte_s": round(max(got), 2) if got else None}, "hostile_seconds": probe_seconds,
        "canaries": {}}


async def wait_idle(stack: ServiceStack, timeout: float = 180) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if stack.idle():
                return True
        except httpx.HTTPError:
            pass
        await asyncio.sleep(1)
    return False


ORDER = ("big_json_schema", "big_ebnf", "vocab_logit_bias_n128", "n128_long", "unsatisfiable_choice",
         "schema_over_wire_cap", "tokenize_huge", "many_tools", "batch_bad_lines", "bearer_case", "kill_encoder",
         "kill_decode", "prefill_killed_overload")


async def main_async(args, stack: ServiceStack, tmp: Path) -> list[dict]:
    from PIL import Image
    import io

    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buf, format="PNG")
    hostile = hostile_requests(buf.getvalue())
    results = []
    for name in args.probes:
        print(f"probe {name} ...", flush=True)
        if name == "batch_bad_lines":
            result = await batch_probe(stack, tmp)
        elif name == "bearer_case":
            result = await auth_probe(stack)
        elif name == "kill_decode":
            async def kill(client, timeout):
                stack.kill("decode-1")
                await asyncio.sleep(timeout)
                return {"killed": "decode-1"}
            result = await run_probe(stack, name, kill, min(args.probe_seconds, 20))
        elif name == "kill_encoder":
            async def kill_encoder(client, timeout):
                stack.kill("encoder-0")
                started = time.monotonic()
                r = await hostile["image_request"](client, timeout)
                return {"killed": "encoder-0", "image_request_status": r.status_code,
                        "image_request_seconds": round(time.monotonic() - started, 2)}
            result = await run_probe(stack, name, kill_encoder, min(args.probe_seconds, 40))
        elif name == "prefill_killed_overload":
            result = await overload_probe(stack, args.probe_seconds * 2)
        else:
            result = await run_probe(stack, name, hostile[name], args.probe_seconds)
        result["idle_after"] = await wait_idle(stack)
        print(json.dumps(result), flush=True)
        results.append(result)
    return results


def table(results: list[dict]) -> str:
    rows = ["| probe | hostile outcome | chat canary worst s (failed) | /v1/models worst s (failed) |",
            "|---|---|---|---|"]
    for r in results:
        c = r["canaries"]
        cell = lambda k: f"{c[k]['worst_s']:.2f} ({c[k]['failures']})" if k in c else "-"
        rows.append(f"| {r['probe']} | {json.dumps(r['hostile'])[:100]} | {cell('chat')} | {cell('models')} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probes", default=",".join(ORDER), help="comma-separated, in this order")
    parser.add_argument("--probe-seconds", type=float, default=60.0, help="longest a hostile request may run")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "isolation.json"))
    parser.add_argument("--label", default="", help="stored with the results (e.g. the tree measured)")
    parser.add_argument("--proxy-args", default="", help="extra options of the proxy, e.g. limits raised so that "
                                                          "hostile requests reach the engines: "
                                                          "'--max-logit-bias 50000 --max-structured-output-bytes 1048576'")
    args = parser.parse_args()
    args.probes = [p for p in args.probes.split(",") if p]
    unknown = set(args.probes) - set(ORDER)
    if unknown:
        raise SystemExit(f"unknown probes: {sorted(unknown)}; known: {', '.join(ORDER)}")
    from epdserve.services.cli.main import prepare_model

    model = str(prepare_model("llava-demo"))
    with tempfile.TemporaryDirectory(prefix="epdserve-isolation-") as tmp:
        stack = ServiceStack(model, Path(tmp), encoders=1, prefills=1, decodes=2, engine_args=[],
                             proxy_args=args.proxy_args.split())
        try:
            stack.start()
            results = asyncio.run(main_async(args, stack, Path(tmp)))
        finally:
            stack.stop()
    out = {"machine": machine(), "label": args.label, "proxy_args": args.proxy_args,
           "probe_seconds": args.probe_seconds, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(table(results))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
