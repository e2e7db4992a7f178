"""The OpenAI layer with n > 1 over real HTTP (official `openai` client), a SmolLM2 engine in the same
process: a stop string ends its own choice only, the other choices run on to their ends unchanged."""
import socket
import threading
import time

import openai
import pytest
import uvicorn

from epdserve import AsyncLLM
from epdserve.services.proxy.app import build_app
from epdserve.services.batch.engine_backend import EngineBackend
from epdserve.services.proxy.metrics import ProxyMetrics
from epdserve.services.proxy.serving import OpenAIServing

MODEL = "smollm2"
PARAMS = dict(model=MODEL, prompt="My favourite animals are", n=3, max_tokens=16, temperature=1.0, seed=5,
              extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def client(default_model_path):
    from epdserve.shared.engine.llm import build_engine_config
    from epdserve.shared.engine.llm_engine import LLMEngine

    engine = LLMEngine(build_engine_config(str(default_model_path), num_kv_blocks=128), detokenize=False)
    llm = AsyncLLM(engine)
    metrics = ProxyMetrics(MODEL)
    serving = OpenAIServing(MODEL, engine.tokenizer, EngineBackend(llm), engine.model_config.max_model_len,
                            engine.model_config.vocab_size, metrics)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(serving, metrics), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    server.should_exit = True
    thread.join(10)
    llm.shutdown()
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def unique_stop(texts: list[str], index: int) -> str:
    """A 3-character piece of texts[index], past its start, that no other text contains."""
    text = texts[index]
    for start in range(2, len(text) - 3):
        piece = text[start:start + 3]
        if piece.strip() and all(piece not in t for i, t in enumerate(texts) if i != index):
            return piece
    raise AssertionError(f"no stop string tells choice {index} apart: {texts}")


def test_a_stop_string_ends_only_its_own_choice(client):
    free = [c.text for c in client.completions.create(**PARAMS).choices]
    assert len(set(free)) == 3
    stop = unique_stop(free, 1)
    cut = client.completions.create(stop=[stop], **PARAMS)
    assert [c.index for c in cut.choices] == [0, 1, 2]
    assert cut.choices[1].text == free[1][:free[1].index(stop)]
    assert cut.choices[1].finish_reason == "stop" and cut.choices[1].stop_reason == stop
    assert [cut.choices[i].text for i in (0, 2)] == [free[0], free[2]]
    assert [cut.choices[i].finish_reason for i in (0, 2)] == ["length", "length"]

    parts = {}
    for chunk in client.completions.create(stop=[stop], stream=True, **PARAMS):
        for choice in chunk.choices:
            parts[choice.index] = parts.get(choice.index, "") + choice.text
    assert [parts[i] for i in range(3)] == [c.text for c in cut.choices]
