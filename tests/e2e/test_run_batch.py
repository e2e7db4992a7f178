"""`epdserve run-batch` on a 100-line OpenAI batch file with bad lines mixed in, run as a real subprocess:
with a local engine in its process, and against a running stack (--base-url). Every input line gets one
result line, in input order; bad lines become error lines and the run goes on."""
import json
import subprocess
import sys

import pytest

GOOD_PROMPT = "The capital of France is"  # SmolLM2, greedy float32, 2 tokens: " Paris."
BAD_LINES = {
    7: ("{not json", None, "not valid JSON"),
    15: ("[1, 2]", None, "not a JSON object"),
    23: (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), None, "custom_id"),
    31: (json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}}), "bad-url",
         "url must be one of"),
    39: (json.dumps({"custom_id": "bad-method", "method": "GET", "url": "/v1/completions", "body": {}}),
         "bad-method", "method must be POST"),
    47: (json.dumps({"custom_id": "no-body", "method": "POST", "url": "/v1/completions"}), "no-body",
         "body must be a JSON object"),
    55: (json.dumps({"custom_id": "streamed", "method": "POST", "url": "/v1/completions",
                     "body": {"model": "demo", "prompt": "x", "stream": True}}), "streamed", "stream is not supported"),
    # Lines that once ended the whole run: NaN (not JSON: it cannot be sent), a lone surrogate (no text
    # encoding has it), nesting deeper than Python's stack.
    83: ('{"custom_id": "nan", "method": "POST", "url": "/v1/completions", '
         '"body": {"model": "demo", "prompt": "x", "temperature": NaN}}', "nan", "cannot be sent as JSON"),
    91: ('{"custom_id": "surrogate", "method": "POST", "url": "/v1/completions", '
         '"body": {"model": "demo", "prompt": "\\ud800"}}', "surrogate", "valid UTF-8"),
    95: ("[" * 100_000, None, "nests deeper"),
}
API_ERRORS = {  # lines the API itself refuses: (status, param)
    63: ({"model": "demo", "prompt": "x", "temperature": 5}, 400, "temperature"),
    71: ({"model": "demo", "prompt": "x", "suffix": "y"}, 400, "suffix"),
    79: ({"model": "other", "prompt": "x"}, 404, "model"),
}
NUM_LINES = 100
PARALLEL = 88  # a line with n = 3: three sampled choices of one prompt


def good_line(i: int) -> dict:
    if i == PARALLEL:
        return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                "body": {"prompt": GOOD_PROMPT, "max_tokens": 3, "n": 3, "seed": 1}}
    if i % 2:
        return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "demo", "messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": 2}}
    # No model in the body: run-batch fills in the served model.
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": GOOD_PROMPT, "max_tokens": 2, "temperature": 0}}


@pytest.fixture(scope="module")
def batch_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("batch") / "requests.jsonl"
    lines = []
    for i in range(NUM_LINES):
        if i in BAD_LINES:
            lines.append(BAD_LINES[i][0])
        elif i in API_ERRORS:
            lines.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                                     "body": API_ERRORS[i][0]}))
        else:
            lines.append(json.dumps(good_line(i)))
        if i == 50:
            lines.append("")  # blank lines are skipped, not answered
    path.write_text("\n".join(lines) + "\n")
    return path


def run_batch(batch_file, out, *args) -> subprocess.CompletedProcess:
    """At the default log level: what a user sees."""
    cmd = [sys.executable, "-m", "epdserve.services.cli", "run-batch", "-i", str(batch_file), "-o", str(out),
           "--concurrency", "8", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert "HTTP Request" not in done.stderr  # no line per request between the progress bar's updates
    return done


def check_results(out) -> None:
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(results) == NUM_LINES
    for i, result in enumerate(results):
        assert result["id"].startswith("batch_req_")
        if i in BAD_LINES:
            _, custom_id, message = BAD_LINES[i]
            assert result["custom_id"] == custom_id and result["response"] is None
            assert message in result["error"]["message"], result
            continue
        assert result["custom_id"] == f"req-{i}"  # input order
        response = result["response"]
        assert response["request_id"] == result["id"]
        if i in API_ERRORS:
            _, status, param = API_ERRORS[i]
            assert response["status_code"] == status
            assert result["error"] == response["body"]["error"] and result["error"]["param"] == param
            continue
        assert response["status_code"] == 200 and result["error"] is None
        body = response["body"]
        assert body["model"] == "demo" and body["id"] == response["request_id"]
        if i == PARALLEL:
            assert [choice["index"] for choice in body["choices"]] == [0, 1, 2]
            assert body["usage"]["completion_tokens"] == 9
        elif i % 2:
            assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 2
        else:
            assert body["choices"][0]["text"] == " Paris."


def test_run_batch_with_a_local_engine(batch_file, default_model_path, tmp_path):
    out = tmp_path / "results.jsonl"
    done = run_batch(batch_file, out, "--model", default_model_path, "--served-model-name", "demo",
                     "--threads", "1", "--num-kv-blocks", "256")
    assert done.returncode == 0, done.stderr
    assert "C++ CPU kernels: loading" in done.stderr and "loading the weights of" in done.stderr  # not silent
    assert "100/100" in done.stderr  # the progress bar
    assert f"{NUM_LINES - len(BAD_LINES) - len(API_ERRORS)} succeeded, {len(BAD_LINES) + len(API_ERRORS)} failed" \
        in done.stderr
    check_results(out)


def test_run_batch_against_a_running_server(batch_file, default_model_path, start_stack, tmp_path):
    stack = start_stack(default_model_path, unified=1, engine_args=["--num-kv-blocks", "256"])
    out = tmp_path / "results.jsonl"
    done = run_batch(batch_file, out, "--base-url", stack.url + "/v1", "--model", "demo", "--no-progress-bar")
    assert done.returncode == 0, done.stderr
    assert "100/100" not in done.stderr
    check_results(out)
