"""A service tells the truth about itself: READY while it serves, UNHEALTHY (and exit code 1) once its
engine loop died, DRAINING after SIGTERM; and it refuses messages its peer's role never sends. A real
service on real sockets, in this process so the test can break its engine."""
import asyncio
import sys
from pathlib import Path

import httpx
import pytest

from epdserve.services.cli.launcher import free_port
from epdserve.services.cli.roles import worker_builder
from epdserve.services.runtime.service import Service
from epdserve.transport.channel import protocol as p
from epdserve.shared.config import ServiceConfig, TransportConfig
from epdserve.shared.engine.llm import build_engine_config
from epdserve.shared.engine.sampling_params import SamplingParams
from epdserve.services.host.wire import sampling_params_to_wire
from epdserve.transport.channel.common import ErrorReply
from epdserve.transport.channel.reply_server import PullChannel
from epdserve.transport.channel.request_client import RequestClient

HEALTHCHECK = Path(__file__).parents[2] / "deploy" / "healthcheck.py"



def make_service(model: str, role: str = "unified") -> Service:
    config = ServiceConfig(role, f"{role}-0", port=free_port(), http_port=free_port(),
                           transport=TransportConfig(rpc_timeout=5.0), drain_timeout=30.0)
    return Service(config, worker_builder(config, build_engine_config(model, num_kv_blocks=64), model))


async def started(service: Service) -> asyncio.Task:
    task = asyncio.create_task(service.run())
    await ready(service, task)
    return task


async def ready(service: Service, task: asyncio.Task) -> None:
    for _ in range(600):
        if service.health == p.Health.READY:
            return
        assert not task.done(), task.result()
        await asyncio.sleep(0.05)
    raise AssertionError("the service did not become ready")


def client(service: Service, role: p.Role = p.Role.PROXY) -> RequestClient:
    return RequestClient(service.control_addr, engine_id="tester", role=role, timeout=5.0)


async def management(service: Service, path: str) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.get(f"http://127.0.0.1:{service.http_port}{path}", timeout=5)


async def image_healthcheck(service: Service) -> int:
    """The exit code of the image's HEALTHCHECK against `service` (in a process of its own: the service
    answers on this event loop)."""
    proc = await asyncio.create_subprocess_exec(sys.executable, str(HEALTHCHECK), str(service.http_port),
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    return await proc.wait()


def generate(rid: str, reply_to: str, max_tokens: int = 4) -> p.GenerateRequest:
    params = sampling_params_to_wire(SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return p.GenerateRequest(rid, (1, 2, 3, 4), params, reply_to)


def test_a_dead_engine_makes_the_service_unhealthy_and_exit_nonzero(tiny_model_paths):
    async def main():
        service = make_service(tiny_model_paths["llama"])
        task = await started(service)
        async with client(service) as proxy, PullChannel("proxy-0") as inbox:
            assert (await proxy.request(p.StatusRequest(), expect=p.Status)).health == p.Health.READY
            assert (await management(service, "/ready")).status_code == 200

            def broken_schedule():
                raise RuntimeError("scheduler bug")

            service.worker.llm._engine.scheduler.schedule = broken_schedule  # a bug no request caused
            assert await proxy.request(generate("r1", inbox.address), expect=p.Ack) == p.Ack("r1")
            error = await inbox.recv(timeout=10)
            assert isinstance(error, p.Error) and error.request_id == "r1" and "engine loop failed" in error.message
            status = await proxy.request(p.StatusRequest(), expect=p.Status)
            assert status.health == p.Health.UNHEALTHY
            assert (await management(service, "/health")).status_code == 503
            answer = await management(service, "/ready")
            assert answer.status_code == 503 and answer.json()["status"] == "unhealthy"
            with pytest.raises(ErrorReply, match="unhealthy"):
                await proxy.request(generate("r2", inbox.address))
        assert await asyncio.wait_for(task, 30) == 1

    asyncio.run(main())


def test_draining_finishes_what_it_holds_and_takes_nothing_new(tiny_model_paths):
    async def main():
        service = make_service(tiny_model_paths["llama"])
        task = await started(service)
        async with client(service) as proxy, PullChannel("proxy-0") as inbox:
            await proxy.request(generate("long", inbox.address, max_tokens=200), expect=p.Ack)
            # It runs. Steps that end while the service is busy go out together: count what each message carries.
            tokens = sum(len(delta.token_ids) for delta in (await inbox.recv(timeout=10)).deltas)
            service.stop.set()  # what SIGTERM does
            for _ in range(100):
                if (await proxy.request(p.StatusRequest(), expect=p.Status)).health == p.Health.DRAINING:
                    break
                await asyncio.sleep(0.02)
            assert (await management(service, "/ready")).json()["status"] == "draining"
            with pytest.raises(ErrorReply, match="draining") as refused:
                await proxy.request(generate("new", inbox.address))
            assert refused.value.error.retryable  # the proxy tries another instance
            finish = None
            while finish is None:
                for delta in (await inbox.recv(timeout=30)).deltas:
                    tokens, finish = tokens + len(delta.token_ids), delta.finish_reason
            assert finish == p.FinishReason.LENGTH and tokens == 200
        assert await asyncio.wait_for(task, 30) == 0

    asyncio.run(main())


@pytest.mark.parametrize("role, message", [
    (p.Role.ENCODER, p.Abort("r1")),
    (p.Role.ENCODER, p.GenerateRequest("r1", (1, 2), p.WireSamplingParams(), "tcp://127.0.0.1:9")),
    (p.Role.DECODE, p.GenerateRequest("r1", (1, 2), p.WireSamplingParams(), "tcp://127.0.0.1:9")),
    (p.Role.PREFILL, p.Abort("r1")),
    (p.Role.UNIFIED, p.Release("r1")),
])
def test_a_peer_may_send_only_what_its_role_sends(tiny_model_paths, role, message):
    async def main():
        service = make_service(tiny_model_paths["llama"])
        task = await started(service)
        async with client(service, role) as spoof:
            with pytest.raises(ErrorReply, match=f"{role.value} peers may not send"):
                await spoof.request(message)
        rejected = service.worker.metrics.rejected_frames()
        assert rejected >= 1
        service.stop.set()
        assert await asyncio.wait_for(task, 30) == 0

    asyncio.run(main())


def test_starting_until_the_model_is_loaded(default_model_path):
    """Status and /ready answer from the first moment; nothing is routed to it before READY."""
    async def main():
        service = make_service(default_model_path)
        task = asyncio.create_task(service.run())
        while not service.http_port:
            await asyncio.sleep(0.01)
        answer = await management(service, "/ready")  # SmolLM2 takes seconds to load
        assert answer.status_code == 503 and answer.json()["status"] == "starting"
        assert (await management(service, "/health")).status_code == 200
        assert await image_healthcheck(service) == 1  # the container stays `starting`
        async with client(service) as proxy:
            status = await proxy.request(p.StatusRequest(), expect=p.Status)
            assert status.health in (p.Health.STARTING, p.Health.READY)
            await ready(service, task)
            assert (await proxy.request(p.StatusRequest(), expect=p.Status)).health == p.Health.READY
        assert await image_healthcheck(service) == 0
        service.stop.set()
        assert await asyncio.wait_for(task, 30) == 0

    asyncio.run(main())
