"""Who may read and write the shared KV store of a stack started by `epdserve up --kv-store`: a raw ZMQ client
posing as a prefill, as a probe of the store would. Without the stack's secret it gets no handshake, so no
message through; with it (a compromised peer) but another tenant's `cache_salt`, it reads no prompt out of
the store and plants no KV under another tenant's blocks."""
import asyncio
import os
import re
import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch

from epdserve.services.cli.launcher import free_port
from epdserve.shared.block_hash import deployment_key, extend_block_hashes
from epdserve.transport.channel import protocol as p
from epdserve.transport.channel.common import ErrorReply, HandshakeError
from epdserve.transport.kv.checksum import checksum
from epdserve.transport.channel.peer_auth import PeerAuth
from epdserve.transport.channel.request_client import RequestClient
from tests.e2e.test_first_start import Up

BLOCK_SIZE = 16
SECRET = "probe-" + "5" * 40
VICTIM_SALT, OTHER_SALT = "tenant-a", "tenant-b"
# A tenant's prompt: 4 full blocks, sent as token ids.
PROMPT = [(7 + 31 * t) % 1800 + 5 for t in range(4 * BLOCK_SIZE)]
READY = "epdserve is ready: "


@pytest.fixture(scope="module")
def up(tiny_model_paths):
    low = free_port()
    port = free_port()
    while low <= port <= low + 19:
        port = free_port()
    # The stack's secret as an operator would give it (up makes one of its own otherwise): the probe below
    # plays a peer that holds it.
    before, os.environ["EPDSERVE_SECRET"] = os.environ.get("EPDSERVE_SECRET"), SECRET
    try:
        stack = Up([str(Path(sys.executable).with_name("epdserve")), "up", tiny_model_paths["llama"], "--port",
                    str(port), "--internal-ports", f"{low}-{low + 19}", "--kv-store", "0.05", "--block-size",
                    str(BLOCK_SIZE)])
    finally:
        os.environ.pop("EPDSERVE_SECRET")
        if before is not None:
            os.environ["EPDSERVE_SECRET"] = before
    stack.port = port
    try:
        stack.wait_for(READY, 300)
        line = stack.wait_for(r"kvstore kvstore-0 ready: control tcp://", 10)
        stack.store = re.search(r"control (tcp://[^,]+),", line).group(1)
        stack.store_http_port = int(re.search(r"http port (\d+)", line).group(1))
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def layout(tiny_model_paths):
    from epdserve.services.cli.main import engine_config, parse_args
    from epdserve.services.host.engine_worker import kv_layout

    path = tiny_model_paths["llama"]
    return kv_layout(engine_config(parse_args(["serve", "prefill", "--block-size", str(BLOCK_SIZE)]), path))


def complete(up: Up, salt: str) -> list[int]:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{up.port}/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model="llama", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True,
                                                "cache_salt": salt})
    return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]


def probe(up: Up, auth: PeerAuth | None) -> RequestClient:
    return RequestClient(up.store, engine_id="prefill-probe", role=p.Role.PREFILL, timeout=5.0, auth=auth)


def store_metric(up: Up, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{up.store_http_port}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def victim_hashes(salt: str, secret: str | None = SECRET) -> list[bytes]:
    """The prompt's block hashes as the stack's engines make them: keyed with the stack's secret."""
    key = deployment_key(secret.encode()) if secret else None
    return extend_block_hashes([], PROMPT, BLOCK_SIZE, cache_salt=salt, key=key)


def test_a_peer_without_the_stack_secret_gets_no_handshake_and_nothing_through(up):
    complete(up, VICTIM_SALT)
    assert store_metric(up, "epdserve:peer_auth_refused") == 0  # the stack's own services all prove it

    async def main():
        for auth in (None, PeerAuth(b"not-this-stack-" + b"0" * 20)):
            async with probe(up, auth) as client:
                for message in (p.KVEventsRequest(None), p.StatusRequest()):
                    with pytest.raises(HandshakeError, match="unauthenticated"):
                        await client.request(message)

    asyncio.run(main())
    assert store_metric(up, "epdserve:peer_auth_refused") >= 4


def test_a_peer_with_the_secret_but_another_salt_reads_no_prompt_and_plants_no_kv(up, layout):
    first = complete(up, VICTIM_SALT)
    victim = victim_hashes(VICTIM_SALT)

    async def main():
        async with probe(up, PeerAuth(SECRET.encode())) as client:
            # The store's events list every hash it holds (opaque: a hash tells no token)...
            deadline = asyncio.get_running_loop().time() + 10
            while True:
                events = await client.request(p.KVEventsRequest(None), expect=p.KVEvents)
                held = [events.stored[i:i + 16] for i in range(0, len(events.stored), 16)]
                if set(victim) <= set(held):
                    break
                assert asyncio.get_running_loop().time() < deadline, "the victim's blocks never reached the store"
                await asyncio.sleep(0.3)
            # Keyed with the stack's secret: a prompt hashed as the prefix cache's hashes were before names nothing.
            assert not set(victim_hashes(VICTIM_SALT, secret=None)) & set(held)
            # ... but no block leaves the store for a getter that does not show its token ids.
            for block_hash in held:
                got = await client.request(p.KVStoreGet(layout, block_hash, (0,) * BLOCK_SIZE), expect=p.KVStoreBlocks)
                assert got.block_hashes == b"" and not got.blocks
            assert "token_ids" not in p.KVStoreBlocks.__dataclass_fields__  # and none ever carries token ids
            # The prompt itself, under another tenant's salt, hashes to other blocks: nothing of the victim's.
            mine = victim_hashes(OTHER_SALT)
            got = await client.request(p.KVStoreGet(layout, b"".join(mine), tuple(PROMPT)), expect=p.KVStoreBlocks)
            assert got.block_hashes == b""
            # What the victim's own get restores, before the poisoning.
            before = await client.request(p.KVStoreGet(layout, b"".join(victim), tuple(PROMPT)),
                                          expect=p.KVStoreBlocks)
            assert before.block_hashes == b"".join(victim)
            # Poison: random KV with matching checksums under the victim's hashes, with the tokens it guesses.
            shape = (len(victim), layout.num_layers, 2, layout.num_kv_heads, layout.block_size, layout.head_size)
            forged = torch.randn(shape, dtype=getattr(torch, layout.dtype))
            put = p.KVStorePut(layout, b"".join(victim), (1,) * len(PROMPT), tuple(checksum(b) for b in forged),
                               (forged,))
            with pytest.raises(ErrorReply, match="other token ids"):
                await client.request(put, expect=p.Ack)
            # Under its own salt's hashes it may store what it likes: nobody else's prompt hashes there.
            await client.request(p.KVStorePut(layout, b"".join(mine), tuple(PROMPT), put.checksums, (forged,)),
                                 expect=p.Ack)
            after = await client.request(p.KVStoreGet(layout, b"".join(victim), tuple(PROMPT)),
                                         expect=p.KVStoreBlocks)
            assert after.checksums == before.checksums and torch.equal(after.blocks[0], before.blocks[0])

    asyncio.run(main())
    assert complete(up, VICTIM_SALT) == first
