"""The proxy's drain in-process, through its ASGI gate: requests in flight are counted and waited for,
new ones refused with an OpenAI-shaped 503 once draining, probes left alone; the cut comes at the end of
the grace (or at once when asked) and reaches whoever registered for it."""
import asyncio
import json

from epdserve.services.proxy.drain import Drain, DrainGate


class App:
    """An ASGI app whose API requests answer only once `release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = 0

    async def __call__(self, scope, receive, send) -> None:
        self.started += 1
        if scope["path"].startswith("/v1/"):
            await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def call(app, path: str) -> tuple[int, dict, bytes]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await app({"type": "http", "path": path, "method": "POST", "headers": []}, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body


def test_a_drain_waits_for_requests_in_flight_and_refuses_new_ones():
    async def main():
        inner, drain, refused = App(), Drain(timeout=30), []
        gate = DrainGate(inner, drain, refused.append)
        cuts = []
        drain.on_cut(cuts.append)
        first = asyncio.create_task(call(gate, "/v1/completions"))
        await asyncio.sleep(0.01)
        assert drain.num_inflight == 1
        draining = asyncio.create_task(drain.run())
        await asyncio.sleep(0.05)
        assert drain.draining and not draining.done()
        status, headers, body = await call(gate, "/v1/chat/completions")
        error = json.loads(body)["error"]
        assert status == 503 and headers["connection"] == "close" and refused == [503]
        assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
        for probe in ("/health", "/ready", "/metrics"):
            assert (await call(gate, probe))[0] == 200  # probes and scrapers still answered
        inner.release.set()
        assert (await first)[0] == 200
        await asyncio.wait_for(draining, 5)  # over as soon as nothing is in flight, long before 30 s
        assert drain.num_inflight == 0 and drain.is_cut and len(cuts) == 1  # the cut finds nothing left

    asyncio.run(main())


def test_the_cut_comes_at_the_end_of_the_grace_or_at_once_when_asked():
    async def main():
        inner = App()
        drain = Drain(timeout=0.2)
        gate = DrainGate(inner, drain)
        cuts = []

        def cut(error):  # as the backend does: the stuck request ends at the cut
            cuts.append(error)
            inner.release.set()

        drain.on_cut(cut)
        stuck = asyncio.create_task(call(gate, "/v1/completions"))
        await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        began = loop.time()
        await asyncio.wait_for(drain.run(), 5)
        assert 0.2 <= loop.time() - began < 2
        (error,) = cuts
        assert error.status == 503 and "0.2s drain grace" in str(error)
        await stuck

        hurried = Drain(timeout=60)
        hurried_cuts = []
        hurried.on_cut(hurried_cuts.append)
        hurried.enter()  # a request that never ends by itself
        running = asyncio.create_task(hurried.run())
        await asyncio.sleep(0.05)
        hurried.cut()  # a second signal
        await asyncio.sleep(0.05)
        assert len(hurried_cuts) == 1 and not running.done()  # its request gets a moment to write its end
        hurried.leave()
        await asyncio.wait_for(running, 5)

    asyncio.run(main())
