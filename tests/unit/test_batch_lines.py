"""The OpenAI batch line format of `epdserve run-batch`: what a line may hold, and the result lines."""
import json

import pytest

from epdserve.services.batch.lines import BadLine, error_line, parse_line, response_line


def line(**fields) -> str:
    return json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"},
                       **fields})


def test_a_good_line_gets_the_default_model_only_when_its_body_has_none():
    assert parse_line(line(), "m").body == {"prompt": "x", "model": "m"}
    assert parse_line(line(body={"prompt": "x", "model": "own"}), "m").body["model"] == "own"
    assert parse_line(line(url="/v1/chat/completions")).url == "/v1/chat/completions"


@pytest.mark.parametrize("text, custom_id, message", [
    ("{", None, "not valid JSON"), ('"a string"', None, "not a JSON object"),
    (line(custom_id=""), None, "custom_id"), (line(custom_id=7), None, "custom_id"),
    (line(method="GET"), "a", "method must be POST"), (line(url="/v1/embeddings"), "a", "url must be one of"),
    (line(body=[1]), "a", "body must be a JSON object"),
    (line(body={"prompt": "x", "stream": True}), "a", "stream is not supported"),
    (line(body={"prompt": "\ud800"}), "a", "body.prompt: text must be valid UTF-8"),
    (line(custom_id="\ud800"), None, "custom_id: text must be valid UTF-8"),
    ("[" * 100_000, None, "nests deeper"),
])
def test_a_bad_line_names_its_fault_and_its_custom_id_when_readable(text, custom_id, message):
    with pytest.raises(BadLine, match=message) as err:
        parse_line(text)
    assert err.value.custom_id == custom_id


def test_result_lines():
    ok = response_line("a", 200, "batch_req_1", {"id": "batch_req_1"})
    assert ok == {"id": "batch_req_1", "custom_id": "a", "error": None,
                  "response": {"status_code": 200, "request_id": "batch_req_1", "body": {"id": "batch_req_1"}}}
    refused = response_line("a", 400, "batch_req_2", {"error": {"message": "m", "param": "p"}})
    assert refused["error"] == {"message": "m", "param": "p"}
    assert response_line("a", 502, "batch_req_3", "Bad Gateway")["error"] == {"code": 502, "message": "Bad Gateway"}
    bad = error_line(None, "the line is not valid JSON")
    assert bad["response"] is None and bad["custom_id"] is None and bad["id"].startswith("batch_req_")
