"""The OpenAI surface around generation, on real stacks (unified, and 1 prefill + 1 decode) driven by the
official openai client: echo with the prompt's logprobs (equal to HF's log_softmax of the prompt logits,
greedy float32), vLLM's prompt_logprobs, logprobs up to 20, fields refused with a 400 that names them,
OpenAI-shaped errors for every status the proxy answers (raw httpx for those), and GET /v1/models/{id}."""
import json

import httpx
import openai
import pytest
import torch

from epdserve.shared.engine.sampling_params import MAX_LOGPROBS

PROMPT = "The lighthouse keeper climbed the spiral stairs every evening at dusk"
TIE_GAP = 1e-4  # as tests/conftest.py: HF logits closer than this may come out in either order
LOGPROB_TOLERANCE = 2e-4  # float32, differently batched: absolute, on logprobs of magnitude < 20
MAX_BODY = 64 << 10
IDS = {"return_tokens_as_token_ids": True}


@pytest.fixture(scope="module", params=["unified", "1p1d"])
def stack(request, default_model_path, stack_factory):
    roles = {"unified": 1} if request.param == "unified" else {"prefills": 1, "decodes": 1}
    stack = stack_factory(default_model_path, engine_args=["--num-kv-blocks", "256"],
                          proxy_args=["--max-request-body-bytes", str(MAX_BODY)], **roles)
    yield stack
    stack.stop()  # before the next kind starts: one stack at a time


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def prompt_ids(default_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path).encode(PROMPT)


@pytest.fixture(scope="module")
def hf_logprobs(default_model_path, hf_causal_lm, prompt_ids):
    """[len(prompt), vocab]: row p is HF's log_softmax predicting prompt token p + 1."""
    model = hf_causal_lm(default_model_path)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def token_id(label: str) -> int:
    return int(label.removeprefix("token_id:"))


def check_prompt_position(pos, logprob, top: dict[int, float], prompt_ids, hf, k):
    """Prompt token `pos` (>= 1): its logprob and its top k equal HF's, top ids up to near-ties."""
    ref = hf[pos - 1]
    assert logprob == pytest.approx(float(ref[prompt_ids[pos]]), abs=LOGPROB_TOLERANCE), pos
    ref_top = ref.topk(k)
    ours = sorted(top.items(), key=lambda kv: -kv[1])
    assert len(ours) == k
    for (tid, lp), ref_id, ref_lp in zip(ours, ref_top.indices.tolist(), ref_top.values.tolist()):
        assert lp == pytest.approx(ref_lp, abs=LOGPROB_TOLERANCE), pos
        assert tid == ref_id or abs(float(ref[tid]) - ref_lp) < TIE_GAP, (pos, tid, ref_id)


def check_echoed_logprobs(logprobs, prompt_ids, hf, k):
    n = len(prompt_ids)
    assert [token_id(t) for t in logprobs.tokens[:n]] == prompt_ids
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing predicts it
    assert logprobs.text_offset[0] == 0
    for pos in range(1, n):
        top = {token_id(t): v for t, v in logprobs.top_logprobs[pos].items()}
        check_prompt_position(pos, logprobs.token_logprobs[pos], top, prompt_ids, hf, k)


def test_echo_returns_the_prompt_and_its_logprobs_first(client, prompt_ids, hf_logprobs):
    resp = client.completions.create(model="demo", prompt=PROMPT, echo=True, logprobs=3, max_tokens=4,
                                     temperature=0, extra_body=IDS)
    choice = resp.choices[0]
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    check_echoed_logprobs(choice.logprobs, prompt_ids, hf_logprobs, 3)
    generated = choice.logprobs.token_logprobs[len(prompt_ids):]
    assert len(generated) == resp.usage.completion_tokens == 4 and all(v is not None for v in generated)
    assert choice.logprobs.text_offset[len(prompt_ids)] == len(PROMPT)
    # A prompt given as token ids is echoed the same way.
    by_ids = client.completions.create(model="demo", prompt=prompt_ids, echo=True, logprobs=3, max_tokens=4,
                                       temperature=0, extra_body=IDS)
    assert by_ids.choices[0].logprobs.token_logprobs == choice.logprobs.token_logprobs


def test_echo_streams_the_prompt_with_its_logprobs_in_the_first_chunk(client, prompt_ids, hf_logprobs):
    chunks = list(client.completions.create(model="demo", prompt=PROMPT, echo=True, logprobs=2, max_tokens=3,
                                            temperature=0, stream=True, extra_body=IDS))
    first = chunks[0].choices[0]
    assert first.text == PROMPT and first.finish_reason is None
    check_echoed_logprobs(first.logprobs, prompt_ids, hf_logprobs, 2)
    rest = [c.choices[0] for c in chunks[1:] if c.choices]
    assert sum(len(c.logprobs.tokens) for c in rest) == 3 and rest[-1].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_answers_the_prompt_alone(client, prompt_ids, hf_logprobs, stream):
    kwargs = dict(model="demo", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0, extra_body=IDS)
    if stream:
        chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        choices = [c.choices[0] for c in chunks if c.choices]
        text, logprobs, usage = "".join(c.text for c in choices), choices[0].logprobs, chunks[-1].usage
        finish = choices[-1].finish_reason
    else:
        resp = client.completions.create(**kwargs)
        text, logprobs, usage, finish = (resp.choices[0].text, resp.choices[0].logprobs, resp.usage,
                                         resp.choices[0].finish_reason)
    assert text == PROMPT and finish == "length"
    assert len(logprobs.tokens) == len(prompt_ids)
    check_echoed_logprobs(logprobs, prompt_ids, hf_logprobs, 1)
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), 0)


def test_max_tokens_0_without_echo_is_refused(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=0)
    assert err.value.body["param"] == "max_tokens"


def test_vllm_prompt_logprobs_on_completions_and_chat(client, prompt_ids, hf_logprobs):
    resp = client.completions.create(model="demo", prompt=PROMPT, max_tokens=2, temperature=0,
                                     extra_body={"prompt_logprobs": 4})
    # Twice: a prompt whose blocks are cached is scored all the same (such a request takes no cache hits).
    again = client.completions.create(model="demo", prompt=PROMPT, max_tokens=2, temperature=0,
                                      extra_body={"prompt_logprobs": 4})
    for r in (resp, again):
        entries = r.choices[0].model_extra["prompt_logprobs"]
        assert len(entries) == len(prompt_ids) and entries[0] is None
        for pos in range(1, len(prompt_ids)):
            entry = {int(t): v for t, v in entries[pos].items()}
            own = entry[prompt_ids[pos]]
            top = {t: v["logprob"] for t, v in entry.items() if v["rank"] <= 4}
            assert own["rank"] >= 1 and isinstance(own["decoded_token"], str)
            check_prompt_position(pos, own["logprob"], top, prompt_ids, hf_logprobs, 4)
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    entries = chat.model_extra["prompt_logprobs"]
    assert entries[0] is None and all(len(e) == 1 for e in entries[1:])  # the token itself only
    assert len(entries) == chat.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="demo", prompt=PROMPT, stream=True, extra_body={"prompt_logprobs": 1})
    assert err.value.body["param"] == "prompt_logprobs"


def test_logprobs_go_up_to_20(client):
    resp = client.completions.create(model="demo", prompt=PROMPT, max_tokens=2, logprobs=MAX_LOGPROBS)
    assert all(len(top) == MAX_LOGPROBS for top in resp.choices[0].logprobs.top_logprobs)
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          logprobs=True, top_logprobs=MAX_LOGPROBS)
    assert all(len(c.top_logprobs) == MAX_LOGPROBS for c in chat.choices[0].logprobs.content)
    for call, field in ((lambda: client.completions.create(model="demo", prompt=PROMPT, logprobs=21), "logprobs"),
                        (lambda: client.chat.completions.create(model="demo", messages=[{"role": "user",
                                                                                          "content": "Hi"}],
                                                                logprobs=True, top_logprobs=21), "top_logprobs")):
        with pytest.raises(openai.BadRequestError) as err:
            call()
        assert err.value.body["param"] == field


@pytest.mark.parametrize("field, value", [("suffix", " and then?"), ("audio", {"voice": "alloy", "format": "wav"}),
                                          ("reasoning_effort", "low"), ("store", True), ("prediction", {"x": 1}),
                                          ("modalities", ["text", "audio"]), ("service_tier", "flex"),
                                          ("top_logprobs", 3)])
def test_fields_we_do_not_implement_are_a_400_naming_them(client, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        if field == "suffix":
            client.completions.create(model="demo", prompt=PROMPT, suffix=value)
        else:
            client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}],
                                           extra_body={field: value})
    assert err.value.body["param"].split(".")[0] == field and err.value.body["type"] == "BadRequestError"


def test_fields_outside_the_reference_are_ignored_and_logged(stack, client):
    resp = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                          extra_body={"not_an_openai_field": 1}, store=False, modalities=["text"])
    assert resp.choices[0].finish_reason == "length"
    assert "ignoring fields outside the API: not_an_openai_field" in stack.services["proxy"].log.read_text()


@pytest.mark.parametrize("kind, part", [("input_audio", {"input_audio": {"data": "AAAA", "format": "wav"}}),
                                        ("file", {"file": {"file_id": "f"}}),
                                        ("video_url", {"video_url": {"url": "http://x/v.mp4"}})])
def test_unsupported_content_parts_are_named(client, kind, part):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": kind, **part}]}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=messages)
    assert err.value.body["param"] == "messages.0.content"
    assert f"content part 1 is of type {kind}, which is not supported" in err.value.body["message"]


def test_get_model_by_id(client, stack):
    model = client.models.retrieve("demo")
    assert (model.id, model.object) == ("demo", "model")
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.body["param"] == "model" and err.value.body["code"] == 404
    assert httpx.get(stack.url + "/v1/models/org/no-such-model").status_code == 404  # ids with a slash


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status and body["error"]["message"]
    return body["error"]


def test_every_error_status_is_openai_shaped(stack):
    url = stack.url
    chat = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    assert "/v1/nothing" in error_of(httpx.post(url + "/v1/nothing", json=chat), 404)["message"]
    error_of(httpx.get(url + "/nothing"), 404)
    wrong = httpx.get(url + "/v1/chat/completions")
    assert error_of(wrong, 405)["type"] == "MethodNotAllowedError" and "POST" in wrong.headers["allow"]
    big = {**chat, "messages": [{"role": "user", "content": "x" * MAX_BODY}]}
    assert error_of(httpx.post(url + "/v1/chat/completions", json=big), 413)["type"] == "RequestTooLargeError"
    chunked = (piece for piece in [json.dumps(big).encode()[i:i + 4096] for i in range(0, MAX_BODY + 8192, 4096)])
    error_of(httpx.post(url + "/v1/chat/completions", content=chunked,
                        headers={"Content-Type": "application/json"}), 413)
    as_text = httpx.post(url + "/v1/chat/completions", content=json.dumps(chat), headers={"Content-Type": "text/plain"})
    assert error_of(as_text, 415)["type"] == "UnsupportedMediaTypeError"
    form = httpx.post(url + "/v1/completions", data={"prompt": "x"})
    error_of(form, 415)
    broken = httpx.post(url + "/v1/chat/completions", content=b'{"model": "demo",',
                        headers={"Content-Type": "application/json"})
    assert "not valid JSON" in error_of(broken, 400)["message"]
    assert error_of(httpx.post(url + "/v1/chat/completions", json={**chat, "temperature": 5}), 400)["param"] == \
        "temperature"
    assert error_of(httpx.post(url + "/v1/chat/completions", json=[chat]), 400)["param"] is None
    # Within the limit, a JSON body with a charset is fine.
    ok = httpx.post(url + "/v1/chat/completions", content=json.dumps(chat),
                    headers={"Content-Type": "application/json; charset=utf-8"}, timeout=60)
    assert ok.status_code == 200, ok.text
