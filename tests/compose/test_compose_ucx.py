"""`docker compose -f compose.yaml -f compose.ucx.yaml up`: the same image, every engine on UCX between
containers, answers as the ZMQ stack and HF transformers do, the image's KV pulled from prefill rather
than recomputed. The stack is this module's own (conftest.py's `ucx_stack`); the tests run in this order."""
from __future__ import annotations

import base64

from prometheus_client.parser import text_string_to_metric_families


def counter(stack, container: str, name: str) -> float:
    status, body = stack.http_get(container, "/metrics")
    assert status == 200, container
    return sum(s.value for family in text_string_to_metric_families(body) for s in family.samples if s.name == name)


def greedy(references) -> dict:
    return dict(temperature=0, max_tokens=references.max_tokens, logprobs=True,
                extra_body={"return_tokens_as_token_ids": True})


def ids_of(reply) -> list[int]:
    return [int(c.token.removeprefix("token_id:")) for c in reply.choices[0].logprobs.content]


def test_text_chat_equals_the_local_engine(ucx_client, references):
    reply = ucx_client.chat.completions.create(model="llava-demo", messages=references.text_messages,
                                               **greedy(references))
    assert ids_of(reply) == references.text_ids


def test_image_chat_is_pulled_over_ucx_and_equals_hf_transformers(ucx_stack, ucx_client, references,
                                                                  near_tie_check):
    (decode,) = ucx_stack.containers("decode")
    pulled, recomputed = "epdserve:remote_kv_requests_total", "epdserve:local_prefills_total"
    before = {name: counter(ucx_stack, decode, name) for name in (pulled, recomputed)}
    url = "data:image/png;base64," + base64.b64encode(references.picture_png()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": references.image_question}]}]
    reply = ucx_client.chat.completions.create(model="llava-demo", messages=messages, **greedy(references))
    near_tie_check("image chat over UCX", ids_of(reply), references.image_ids, references.image_logits)
    assert reply.usage.prompt_tokens == references.image_prompt_tokens
    # More uncached tokens than a decode prefills itself: prefill computed it (on the encoder's embeddings,
    # pulled over UCX) and decode pulled its KV over UCX.
    assert counter(ucx_stack, decode, pulled) == before[pulled] + 1
    assert counter(ucx_stack, decode, recomputed) == before[recomputed]


def test_the_engines_and_only_they_load_ucx(ucx_stack, docker_cli):
    def maps_ucx(container: str) -> bool:
        # PID 1 is the service itself (the image has no init); grep -c exits 1 when it counts none.
        done = docker_cli("exec", container, "grep", "-c", "libucp", "/proc/1/maps", check=False)
        return done.returncode == 0 and int(done.stdout) > 0

    for container in ucx_stack.engine_containers():
        assert maps_ucx(container), f"{container} has not loaded UCX:\n{ucx_stack.logs(container)[-2000:]}"
    assert not any(maps_ucx(c) for c in ucx_stack.containers("proxy")), "the proxy moves no KV"
