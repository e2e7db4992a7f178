"""What a user sees from `epdserve up`, and what the stack it starts says about itself.

The installed `epdserve` command starts 1 prefill + 1 decode + the proxy on a tiny model from a saved
`vllm serve` command line (the model first, vLLM's flags, two served names), plus --internal-ports and
--request-trace, its output read line by line as it comes: every step that may take long is announced (with
its rough duration) before it runs, no URL shows before the stack serves, every vLLM flag took effect, and
the API, every service's metrics and the traces all give the model one name.
"""
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epdserve.services.cli.launcher import free_port

NAME = "smol"
ALIAS = "smol-2"
# A chat template given with --chat-template, instead of the model folder's.
CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
READY = "epdserve is ready: "
ENGINES = {"prefill-0": "prefill", "decode-0": "decode"}
STATS_LINE = re.compile(r"decode decode-0: Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: "
                        r"[\d.]+ tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [\d.]+%, "
                        r"Prefix cache hit rate: [\d.]+%")


class Up:
    """`epdserve up` running, its output (stdout and stderr, in order) collected as it comes."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[tuple[float, str]] = []  # (seconds since the start, line)
        self._started = time.monotonic()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic() - self._started, line.rstrip("\n")))

    def text(self) -> list[str]:
        return [line for _, line in self.lines]

    def wait_for(self, pattern: re.Pattern | str, timeout: float) -> str:
        """The first line matching `pattern`, once it came."""
        deadline = time.monotonic() + timeout
        while (found := next((line for line in self.text() if re.search(pattern, line)), None)) is None:
            assert time.monotonic() < deadline, f"no line matching {pattern!r} came:\n" + self.report()
            assert self.proc.poll() is None, "epdserve up exited:\n" + self.report()
            time.sleep(0.2)
        return found

    def report(self) -> str:
        """The output with each line's time and the silence before it, for a failure's message."""
        out, last = [], 0.0
        for at, line in self.lines:
            out.append(f"{at:7.1f}s (+{at - last:5.1f}s) {line}")
            last = at
        return "\n".join(out)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)  # as Ctrl-C
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def up(tiny_model_paths, tmp_path_factory):
    low = free_port()
    port = free_port()
    while low <= port <= low + 19:
        port = free_port()
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    # As a saved `vllm serve` command line: the model first, then vLLM's flags, up's own, and -- still passes
    # options on to the engines as given.
    stack = Up([str(Path(sys.executable).with_name("epdserve")), "up", tiny_model_paths["llama"],
                "--port", str(port), "--host", "127.0.0.1", "--served-model-name", NAME, ALIAS,
                "--max-model-len", "1024", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                "--block-size", "32", "--dtype", "auto", "--seed", "7", "--enable-prefix-caching",
                "--enable-chunked-prefill", "--gpu-memory-utilization", "0.02", "--tensor-parallel-size", "1",
                "--kv-cache-dtype", "fp8", "--trust-remote-code", "--enforce-eager", "--disable-log-requests",
                "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                "--limit-mm-per-prompt",
                '{"image": 0}', "--chat-template", str(template),
                "--internal-ports", f"{low}-{low + 19}", "--request-trace", "--", "--log-stats-interval", "1"])
    stack.port, stack.internal_ports = port, range(low, low + 20)
    try:
        stack.wait_for(READY, 300)
        yield stack
    finally:
        stack.stop()
    # Ctrl-C: every service stopped, said in a last line.
    assert re.fullmatch(r"epdserve up: stopped 3 services in [\d.]+s", stack.text()[-1]), stack.report()


def until_ready(up: Up) -> list[str]:
    lines = up.text()
    return lines[:next(i for i, line in enumerate(lines) if line.startswith(READY)) + 1]


def positions(lines: list[str], fragment: str) -> list[int]:
    return [i for i, line in enumerate(lines) if fragment in line]


def test_every_step_is_announced_before_it_runs_and_no_url_shows_before_the_stack_serves(up):
    lines, report = until_ready(up), up.report()
    url = f"http://127.0.0.1:{up.port}/v1"
    # The first line says what starts and what takes time; the URL comes with the ready lines only.
    assert lines[0].startswith(f"epdserve up: starting {NAME}: prefill-0, decode-0, proxy; ") and \
        "a minute or two more on a first start where the install has no C++ kernels" in lines[0], report
    (first_url,) = positions(lines, f"proxy for {NAME} ready: {url}")
    assert positions(lines, "http://") == [first_url, len(lines) - 1], report
    assert lines[-1] == f"{READY}{url} (model {NAME}); Ctrl-C stops it", report
    # Each engine's steps, announced before they run: its start, the engine's, the kernels (with how long a
    # first start's compile takes) before the weights, then ready.
    for engine, role in ENGINES.items():
        (starting,) = positions(lines, f"{engine}: starting on ")
        (ready,) = positions(lines, f"{role} {engine} ready: ")
        assert starting < ready, report
    for step in ("engine for ", "KV cache: ", "C++ CPU kernels: loading them (prebuilt at install; where those "
                 "cannot serve, compiled here on a first start: about half a minute per kernel, once)",
                 "loading the weights of llama: ", "engine ready: "):
        assert len(positions(lines, step)) == len(ENGINES), (step, report)
    kernels, weights = positions(lines, "C++ CPU kernels: loading"), positions(lines, "loading the weights of")
    assert all(k < w for k, w in zip(kernels, weights)) and "(a few seconds per GB)" in lines[weights[0]], report
    # The proxy says it waits, then that it serves.
    (proxy_starting,) = positions(lines, "proxy: starting on ")
    (waiting,) = positions(lines, f"proxy for {NAME} starting: the API answers 503 until every role has a ready "
                                  "instance")
    assert proxy_starting < waiting < first_url, report


def test_the_api_every_services_metrics_and_the_traces_give_the_model_one_name(up, tiny_model_paths):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{up.port}/v1", api_key="unused", max_retries=0)
    assert [model.id for model in client.models.list()] == [NAME]
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
                                          temperature=0)
    assert chat.model == NAME
    assert [trace["model"] for trace in chat.model_extra["epdserve_trace"]] == [NAME]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=Path(tiny_model_paths["llama"]).name, max_tokens=4,
                                       messages=[{"role": "user", "content": "Hello"}])
    for name, port in [("proxy", up.port), *((engine, http_port(up, engine)) for engine in ENGINES)]:
        names = {sample.labels["model_name"] for family in text_string_to_metric_families(metrics(port))
                 for sample in family.samples if "model_name" in sample.labels}
        assert names == {NAME}, name


def test_every_vllm_flag_took_effect(up):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{up.port}/v1", api_key="unused", max_retries=0)
    # The engines' settings, as each says when ready: --dtype auto is float32 here, --block-size,
    # --max-num-batched-tokens and --enable-chunked-prefill (the shared budget), --max-num-seqs,
    # --max-model-len, --enable-prefix-caching and --seed.
    ready = [line for line in up.text() if "engine ready: " in line]
    assert len(ready) == len(ENGINES) and all(
        "(torch.float32), " in line and " KV blocks of 32 tokens, " in line and "step budget 512 (shared), at most 8 sequences of 1024 tokens, "
        "prefix caching on, seed 7" in line for line in ready), up.report()
    # --gpu-memory-utilization: the KV pool's share of the memory available after the weights.
    sized = [line for line in up.text() if "KV cache: " in line]
    assert len(sized) == len(ENGINES) and all("auto: 0.02 x (" in line for line in sized), up.report()
    # --kv-cache-dtype fp8: both engines store float8 e4m3, and the prefill hands its blocks to the decode as stored.
    assert all(" tokens) in float8_e4m3fn, " in line for line in sized), up.report()
    # --max-model-len: reported by the API, and enforced.
    (card,) = client.models.list().data
    assert card.model_extra["max_model_len"] == 1024
    tokenized = httpx.post(f"http://127.0.0.1:{up.port}/tokenize", json={"prompt": "Hello"}, timeout=10).json()
    assert tokenized["max_model_len"] == 1024
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024 tokens"):
        client.completions.create(model=NAME, prompt="Hello", max_tokens=1100)
    # --served-model-name NAME ALIAS: both accepted, the first answers.
    assert client.completions.create(model=ALIAS, prompt="Hello", max_tokens=2).model == NAME
    # --chat-template: the prompt is the given template's.
    ids = httpx.post(f"http://127.0.0.1:{up.port}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]},
                     timeout=10).json()["tokens"]
    text = httpx.post(f"http://127.0.0.1:{up.port}/detokenize", json={"tokens": ids}, timeout=10).json()["prompt"]
    assert text.endswith("[user] Hi\n[assistant] ")
    # --limit-mm-per-prompt '{"image": 0}'.
    with pytest.raises(openai.BadRequestError, match="At most 0 image"):
        client.chat.completions.create(model=NAME, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    # --reasoning-parser qwen3: an answer with no </think> yet is all reasoning.
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content is None and chat.choices[0].message.model_extra["reasoning_content"]
    # /version, as vLLM's.
    from epdserve import __version__
    assert httpx.get(f"http://127.0.0.1:{up.port}/version", timeout=10).json() == {"version": __version__}


def test_every_service_listens_within_the_internal_ports(up):
    for engine, role in ENGINES.items():
        ready = up.wait_for(f"{role} {engine} ready: ", 0)
        ports = [int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", ready)] + [http_port(up, engine)]
        assert ports and all(port in up.internal_ports for port in ports), ready


def test_probes_and_scrapes_are_not_counted_as_api_traffic(up):
    before = responses(up.port)
    for path in ("/health", "/ready", "/metrics") * 3:
        assert httpx.get(f"http://127.0.0.1:{up.port}{path}", timeout=10).status_code == 200
    assert responses(up.port) == before
    # Nor were `up`'s own readiness polls while the engines loaded.
    assert "503" not in before


def test_the_decode_engine_logs_its_stats_while_it_works(up):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{up.port}/v1", api_key="unused", max_retries=0)
    client.completions.create(model=NAME, prompt="Count:", max_tokens=32, extra_body={"ignore_eos": True})
    up.wait_for(STATS_LINE, 60)


def metrics(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text


def http_port(up: Up, engine: str) -> int:
    return int(re.search(r"http port (\d+)", up.wait_for(f"{ENGINES[engine]} {engine} ready: ", 0))[1])


def responses(port: int) -> dict[str, float]:
    """The proxy's http_responses_total, by status."""
    return {sample.labels["status"]: sample.value for family in text_string_to_metric_families(metrics(port))
            for sample in family.samples if sample.name == "epdserve:http_responses_total"}


def test_an_fp8_kv_cache_crosses_from_prefill_to_decode_as_stored(up, tiny_model_paths):
    """--kv-cache-dtype fp8 through real services: the decode pulls the prompt's blocks in float8 (a byte an
    element), and answers as an offline engine with the same KV cache, token for token."""
    from epdserve import LLM, SamplingParams
    from epdserve.shared.config import ModelConfig

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{up.port}/v1", api_key="unused", max_retries=0)
    prompt = "Keepers walked up the stairs of the lighthouse, counting every step aloud, " * 3
    done = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    (trace,) = done.model_extra["epdserve_trace"]
    (transfer,) = [s for s in trace["spans"] if s["name"] == "kv.transfer"]
    model = ModelConfig.from_pretrained(tiny_model_paths["llama"])
    assert transfer["num_bytes"] == transfer["num_blocks"] * 2 * model.num_layers * model.num_kv_heads * \
        model.head_size * 32 * 1 > 0  # blocks of 32 tokens, one byte an element
    llm = LLM(model=str(tiny_model_paths["llama"]), kv_cache_dtype="fp8", block_size=32, num_kv_blocks=32)
    offline = llm.generate([{"prompt_token_ids": llm.get_tokenizer().encode(prompt)}],
                           SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert done.choices[0].text == offline[0].outputs[0].text
