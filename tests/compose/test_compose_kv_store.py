"""The shared KV store of `docker compose --profile kvstore up`, probed from inside the compose network as
another container would: without the deployment's secret it gets no handshake; with it, it reads no prompt it
cannot show and plants no block over one the store holds. Its stack is its module's alone."""
import json

MODEL_IN_IMAGE = "/models/models/llava-demo"  # the demo model the image bakes in (conftest.py)

PROBE = """
import asyncio, json, os, time
import torch
from epdserve.services.cli.main import engine_config, parse_args
from epdserve.services.host.engine_worker import kv_layout
from epdserve.transport.channel import protocol as p
from epdserve.transport.channel.common import ErrorReply, HandshakeError
from epdserve.transport.kv.checksum import checksum
from epdserve.transport.channel.peer_auth import PeerAuth, load_secret
from epdserve.transport.channel.request_client import RequestClient

ADDRESS = "tcp://kvstore:7000"
layout = kv_layout(engine_config(parse_args(["serve", "prefill"]), MODEL))
found = {}

async def main():
    async with RequestClient(ADDRESS, engine_id="probe", role=p.Role.PREFILL, timeout=10) as stranger:
        try:
            await stranger.request(p.KVEventsRequest(None))
            found["stranger"] = "answered"
        except HandshakeError as e:
            found["stranger"] = str(e)
    secret = load_secret(path=os.environ["EPDSERVE_SECRET_FILE"])
    async with RequestClient(ADDRESS, engine_id="probe", role=p.Role.PREFILL, timeout=10,
                             auth=PeerAuth(secret)) as peer:
        deadline = time.monotonic() + 60
        while not (events := await peer.request(p.KVEventsRequest(None), expect=p.KVEvents)).stored:
            assert time.monotonic() < deadline, "no block reached the store"
            await asyncio.sleep(0.5)
        held = [events.stored[i:i + 16] for i in range(0, len(events.stored), 16)]
        found["held"] = len(held)
        guess = (0,) * layout.block_size
        found["read"] = 0
        for block_hash in held:
            got = await peer.request(p.KVStoreGet(layout, block_hash, guess), expect=p.KVStoreBlocks)
            found["read"] += len(got.blocks)
        shape = (1, layout.num_layers, 2, layout.num_kv_heads, layout.block_size, layout.head_size)
        forged = torch.randn(shape, dtype=getattr(torch, layout.dtype))
        try:
            await peer.request(p.KVStorePut(layout, held[0], guess, (checksum(forged[0]),), (forged,)), expect=p.Ack)
            found["put"] = "acked"
        except ErrorReply as e:
            found["put"] = str(e)

asyncio.run(main())
print(json.dumps(found))
"""


def test_the_store_gives_no_prompt_to_a_peer_and_takes_no_forged_block(store_stack, store_client, docker_cli):
    answer = store_client.chat.completions.create(model="llava-demo", max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": "My card number is 4111 1111 1111 1111 and I live at 1 Main Street. " * 4}])
    assert answer.choices[0].message.content is not None
    (proxy,) = store_stack.containers("proxy")
    done = docker_cli("exec", proxy, "python", "-c", f"MODEL = {MODEL_IN_IMAGE!r}\n" + PROBE, timeout=300,
                  check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert "unauthenticated" in found["stranger"], found
    assert found["held"] > 0 and found["read"] == 0, found
    assert "other token ids" in found["put"], found
