"""LoRA adapters served by real stacks (unified, and 1 prefill + 1 decode): each adapter's greedy output equals
HF transformers + PEFT token for token with three adapters and the base model in flight at once; unknown
models are a 404; adapters load and unload at run time under traffic, behind the API key, and a bad adapter
is refused at load with the engines' reason."""
from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import pytest
import torch

MAX_TOKENS = 10
KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADAPTERS = ("all", "attn", "mlp-rslora")
PROMPTS = ["The lighthouse keeper climbed the spiral stairs every evening at dusk",
           "In winter the storms arrived without warning. Waves broke over the rocks"]


@pytest.fixture(scope="module")
def tiny(tiny_model_paths):
    return tiny_model_paths["llama"]


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory):
    """The folder runtime loads may name (--lora-root): every test adapter is built inside it."""
    return tmp_path_factory.mktemp("loras")


@pytest.fixture(scope="module")
def lora_paths(tiny, lora_root):
    from epdserve.shared.checkpoints.tiny_lora import build_tiny_lora

    root = lora_root
    variants = (*ADAPTERS, "qk-rank2")
    return {v: str(build_tiny_lora(tiny, root / v, v, seed=i + 1)) for i, v in enumerate(variants)}


@pytest.fixture(scope="module")
def prompt_ids(tiny):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def references(tiny, lora_paths, prompt_ids, hf_greedy):
    """(adapter or None, prompt index) -> HF + PEFT greedy (tokens, logits) in float32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    refs = {}
    for name in (None, *lora_paths):
        model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
        if name is not None:
            model = PeftModel.from_pretrained(model, lora_paths[name]).eval()
        for i, ids in enumerate(prompt_ids):
            refs[name, i] = hf_greedy(model, ids, MAX_TOKENS)
    return refs


def complete(url: str, model: str, ids: list[int], max_tokens: int = MAX_TOKENS, **extra) -> httpx.Response:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
            "return_tokens_as_token_ids": True, **extra}
    return httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=120)


def lora_flags(lora_paths, names=ADAPTERS) -> list[str]:
    return ["--lora-modules", *(f"{n}={lora_paths[n]}" for n in names)]


def check_mixed_batch(url, prompt_ids, references, near_tie_check, ids_of):
    """Every prompt with every adapter and the base, all sent at once: one engine batch mixes them."""
    cases = [(name, i) for i in range(len(prompt_ids)) for name in (None, *ADAPTERS)]
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda c: complete(url, c[0] or "demo", prompt_ids[c[1]]), cases))
    for (name, i), r in zip(cases, answers):
        assert r.status_code == 200, r.text
        assert r.json()["model"] == (name or "demo")
        ours = ids_of(r.json()["choices"][0]["logprobs"]["tokens"])
        near_tie_check(f"{name} prompt {i}", ours, *references[name, i])


LORA_ENGINE = ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "16", "--num-kv-blocks", "256"]


@pytest.fixture(scope="module")
def unified(stack_factory, tiny, lora_paths, lora_root):
    roots = ["--lora-root", str(lora_root)]
    return stack_factory(tiny, unified=1, engine_args=[*LORA_ENGINE, *lora_flags(lora_paths), *roots],
                         proxy_args=[*lora_flags(lora_paths), *roots, "--enable-lora-runtime-updates", "--api-key",
                                     KEY])


def test_models_lists_adapters_with_their_parent(unified, lora_paths):
    data = httpx.get(unified.url + "/v1/models", headers=AUTH).json()["data"]
    assert [m["id"] for m in data] == ["demo", *ADAPTERS]
    assert data[0]["parent"] is None and all(m["parent"] == "demo" for m in data[1:])
    assert {m["id"]: m["root"] for m in data[1:]} == {n: lora_paths[n] for n in ADAPTERS}
    assert httpx.get(unified.url + "/v1/models/attn", headers=AUTH).json()["parent"] == "demo"


def test_unified_mixed_batch_matches_hf_peft(unified, prompt_ids, references, near_tie_check, ids_of):
    check_mixed_batch(unified.url, prompt_ids, references, near_tie_check, ids_of)


def test_unknown_model_is_404(unified, prompt_ids):
    r = complete(unified.url, "no-such-adapter", prompt_ids[0])
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert "no-such-adapter" in r.json()["error"]["message"]
    r = httpx.post(unified.url + "/v1/chat/completions", headers=AUTH,
                   json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404


def test_runtime_updates_need_the_key(unified, lora_paths):
    r = httpx.post(unified.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": lora_paths["attn"]})
    assert r.status_code == 401


def test_bad_adapters_are_refused_at_load(unified, lora_root, lora_paths, tiny_model_paths, prompt_ids):
    from safetensors.torch import load_file, save_file

    from epdserve.shared.checkpoints.tiny_lora import build_tiny_lora

    tmp_path = lora_root / "bad"

    other_base = build_tiny_lora(tiny_model_paths["qwen3"], tmp_path / "qwen3-lora", "attn")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text((tmp_path / "qwen3-lora" / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    big = build_tiny_lora(tiny_model_paths["llama"], tmp_path / "big", "all", r=32)
    nan = build_tiny_lora(tiny_model_paths["llama"], tmp_path / "nan", "attn")
    tensors = load_file(nan / "adapter_model.safetensors")
    tensors[sorted(tensors)[0]][0, 0] = float("nan")
    save_file(tensors, nan / "adapter_model.safetensors")
    for path, message in ((other_base, "another base model"), (corrupt, "is corrupt"),
                          (big, "rank 32, above this server's max_lora_rank 16"),
                          (nan, "holds weights that are not finite numbers (NaN or infinity)")):
        r = httpx.post(unified.url + "/v1/load_lora_adapter", headers=AUTH,
                       json={"lora_name": "bad", "lora_path": str(path)})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert "bad" not in [m["id"] for m in httpx.get(unified.url + "/v1/models", headers=AUTH).json()["data"]]
    r = httpx.post(unified.url + "/v1/load_lora_adapter", headers=AUTH,
                   json={"lora_name": "x", "lora_path": "/p", "surprise": 1})
    assert r.status_code == 400 and "surprise" in r.text
    # The service is undisturbed.
    assert complete(unified.url, "attn", prompt_ids[0], 2).status_code == 200


def test_runtime_loads_stay_inside_the_lora_roots(unified, lora_root, lora_paths, prompt_ids):
    """A load names a folder inside --lora-root, or is refused: `..`, absolute paths elsewhere, links out of the
    root and folders that do not exist all get the same 400 (param lora_path), which says nothing of what
    exists outside; a name that is a path is refused (param lora_name). Nothing refused is offered."""
    from epdserve.shared.models.lora_roots import outside_message

    (lora_root / "to-etc").symlink_to("/etc")
    for path in ("../../etc/passwd", "/etc", "/proc/self/mem", str(lora_root / "to-etc"), "to-etc",
                 str(lora_root / "absent"), "/no/such/folder", f"{lora_root}/../{lora_root.name}-other"):
        r = httpx.post(unified.url + "/v1/load_lora_adapter", headers=AUTH,
                       json={"lora_name": "p", "lora_path": path})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
        assert outside_message(path) in r.json()["error"]["message"], r.text
        assert "/etc" not in r.json()["error"]["message"].replace(path, ""), r.text
    for name in ("../x", "a/b", ".x"):
        r = httpx.post(unified.url + "/v1/load_lora_adapter", headers=AUTH,
                       json={"lora_name": name, "lora_path": lora_paths["attn"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
    models = [m["id"] for m in httpx.get(unified.url + "/v1/models", headers=AUTH).json()["data"]]
    assert "p" not in models and "../x" not in models
    # A folder relative to the root loads, and serves.
    r = httpx.post(unified.url + "/v1/load_lora_adapter", headers=AUTH, json={"lora_name": "rel", "lora_path": "attn"})
    assert r.status_code == 200, r.text
    assert complete(unified.url, "rel", prompt_ids[0], 2).status_code == 200
    r = httpx.post(unified.url + "/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "rel"})
    assert r.status_code == 200, r.text


def test_load_and_unload_under_traffic(unified, lora_paths, prompt_ids, references, near_tie_check, ids_of):
    """Streams of the base model and adapter `all` run while `qk-rank2` is loaded and `all` unloaded: every
    stream finishes exactly; the new adapter then serves HF-exact output; the unloaded one is a 404."""
    long = dict(max_tokens=200, ignore_eos=True)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        traffic = [pool.submit(complete, unified.url, name, prompt_ids[i % 2], **long)
                   for i, name in enumerate(["demo", "all"] * 3)]
        # Every stream running on the engine (or done) before `all` is unloaded under it: a request that reaches
        # the proxy only after the unload is rightly refused.
        deadline = time.monotonic() + 60
        while (sum(f.done() for f in traffic) +
               unified.services["unified-0"].metrics().get("vllm:num_requests_running", 0)) < len(traffic):
            assert time.monotonic() < deadline, "the streams did not all start"
            time.sleep(0.05)
        r = httpx.post(unified.url + "/v1/load_lora_adapter", headers=AUTH,
                       json={"lora_name": "qk", "lora_path": lora_paths["qk-rank2"]})
        assert r.status_code == 200, r.text
        r = httpx.post(unified.url + "/v1/load_lora_adapter", headers=AUTH,
                       json={"lora_name": "qk", "lora_path": lora_paths["qk-rank2"]})
        assert r.status_code == 400 and "already" in r.text
        r = httpx.post(unified.url + "/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "all"})
        assert r.status_code == 200, r.text
        new = complete(unified.url, "qk", prompt_ids[1])
        for future in traffic:
            answer = future.result()
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 200, answer.text
    assert new.status_code == 200, new.text
    near_tie_check("qk", ids_of(new.json()["choices"][0]["logprobs"]["tokens"]), *references["qk-rank2", 1])
    assert complete(unified.url, "all", prompt_ids[0]).status_code == 404
    r = httpx.post(unified.url + "/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "all"})
    assert r.status_code == 404
    models = [m["id"] for m in httpx.get(unified.url + "/v1/models", headers=AUTH).json()["data"]]
    assert models == ["demo", "attn", "mlp-rslora", "qk"]


def test_disaggregated_mixed_batch_matches_hf_peft(start_stack, tiny, lora_paths, prompt_ids, references,
                                                   near_tie_check, ids_of):
    """1 prefill + 1 decode: the adapter travels with the request; both engines apply it."""
    stack = start_stack(tiny, prefills=1, decodes=1, engine_args=[*LORA_ENGINE, *lora_flags(lora_paths)],
                        proxy_args=[*lora_flags(lora_paths), "--api-key", KEY, "--routing-policy", "load"])
    check_mixed_batch(stack.url, prompt_ids, references, near_tie_check, ids_of)
    # The runtime routes are off without --enable-lora-runtime-updates.
    r = httpx.post(stack.url + "/v1/load_lora_adapter", headers=AUTH, json={"lora_name": "x", "lora_path": "/p"})
    assert r.status_code == 404


def test_an_instance_without_room_refuses_retryably(start_stack, tiny, lora_paths, prompt_ids):
    """One adapter slot, busy with `all`'s stream: a request for `attn` is refused (503, Retry-After) by the
    only instance, and served once the slot is free."""
    stack = start_stack(tiny, unified=1, engine_args=["--enable-lora", "--max-loras", "1", "--num-kv-blocks", "256",
                                                      *lora_flags(lora_paths, ("all", "attn"))],
                        proxy_args=[*lora_flags(lora_paths, ("all", "attn")), "--api-key", KEY])
    started = threading.Event()

    def hold_the_slot() -> int:
        body = {"model": "all", "prompt": prompt_ids[0], "max_tokens": 1800, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", stack.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            for _ in r.iter_lines():
                started.set()  # its first token is out: the adapter holds the slot
        return r.status_code

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        busy = pool.submit(hold_the_slot)
        assert started.wait(60)
        refused = complete(stack.url, "attn", prompt_ids[1], 2)
        assert not busy.done(), "the stream ended before the probe: make it longer"
        assert refused.status_code == 503 and "no room for LoRA adapter 'attn'" in refused.text, refused.text
        assert "retry-after" in refused.headers
        assert busy.result() == 200
    assert complete(stack.url, "attn", prompt_ids[1], 2).status_code == 200
    # Both adapters asked for at once: requests that pass the engine's first look at the slots race for the
    # one slot; whichever loses is refused retryably too, never an internal error.
    cases = ["all", "attn"] * 8
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda name: complete(stack.url, name, prompt_ids[0], 200, ignore_eos=True), cases))
    assert {r.status_code for r in answers} <= {200, 503}, [r.text for r in answers if r.status_code != 200]
    assert all("retry-after" in r.headers for r in answers if r.status_code == 503)
    assert any(r.status_code == 200 for r in answers)
