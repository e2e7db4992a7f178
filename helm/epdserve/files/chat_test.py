"""`helm test`: one chat completion through the proxy, sent the way a client sends it.

Waits (bounded) for the proxy's /ready - every role has a healthy instance - then asks one question
and fails unless the answer has text. Environment: EPDSERVE_URL (the proxy), EPDSERVE_API_KEY (if the
API has one), EPDSERVE_TEST_TIMEOUT (seconds to wait for the stack).
"""
import json
import os
import sys
import time
import urllib.error
import urllib.request

URL = os.environ["EPDSERVE_URL"].rstrip("/")
HEADERS = {"Content-Type": "application/json"}
if os.environ.get("EPDSERVE_API_KEY"):
    HEADERS["Authorization"] = "Bearer " + os.environ["EPDSERVE_API_KEY"]


def call(path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(URL + path, data=data, headers=HEADERS)
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)


deadline = time.monotonic() + float(os.environ.get("EPDSERVE_TEST_TIMEOUT", "600"))
while True:
    try:
        call("/ready")
        break
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            sys.exit(f"{URL}/ready refused the API key: {exc}")
        error = exc
    except OSError as exc:
        error = exc
    if time.monotonic() > deadline:
        sys.exit(f"{URL} was not ready in time: {error}")
    time.sleep(3)

model = call("/v1/models")["data"][0]["id"]
reply = call("/v1/chat/completions", {
    "model": model, "max_tokens": 16, "temperature": 0,
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
})
text = reply["choices"][0]["message"]["content"]
if not text or not text.strip():
    sys.exit(f"the answer has no text: {reply}")
print(f"{model} answered: {text!r}")
