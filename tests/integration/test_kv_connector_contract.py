"""The KV connector contract beyond loads (kv_connector.py): the engine holds every connector in one list - its
own offload tier first, then those added - and asks each, in that order, through the interface only: `expect`
on the engine's thread ahead of the request, `stats` as tiers (fresh when read from `AsyncLLM.stats`, the
engine idle or not), `take_changes`/`hashes` as the KV events' tiers, `shutdown` then `close` when it closes;
a connector with nothing to say inherits the defaults."""
import asyncio
import threading

from epdserve import AsyncLLM, SamplingParams
from epdserve.shared.engine import KVConnector, KVTierStats
from epdserve.shared.engine.llm import build_engine_config
from epdserve.shared.engine.offload_connector import OffloadConnector


class Recording(KVConnector):
    """Logs what it is asked; with `tier`, a KV tier whose counters and block hashes it makes up."""

    def __init__(self, name: str, log: list, tier: bool = False) -> None:
        self.name, self.log, self.tier = name, log, tier
        self.saved = 0
        self.changes: tuple[list[bytes], list[bytes]] = ([bytes([len(name)]) * 16], [])

    def expect(self, request_id, kv_transfer_params) -> None:
        self.log.append((self.name, "expect", request_id, kv_transfer_params, threading.current_thread().name))

    def num_loadable_tokens(self, request, num_local_tokens: int) -> int:
        self.log.append((self.name, "asked", request.request_id))
        return 0

    def stats(self):
        if not self.tier:
            return None
        return KVTierStats(1, 8, 0, 0, 0, self.saved, 0, 0, 0, 0, (0,), 0.0)

    def take_changes(self):
        if not self.tier:
            return None
        changes, self.changes = self.changes, ([], [])
        return changes

    def hashes(self):
        return [bytes([len(self.name)]) * 16] if self.tier else None

    def shutdown(self) -> None:
        self.log.append((self.name, "shutdown"))

    async def close(self) -> None:
        self.log.append((self.name, "close", threading.current_thread().name))


def test_defaults_say_nothing():
    connector = KVConnector()
    assert connector.stats() is None and connector.take_changes() is None and connector.hashes() is None
    connector.expect("r", object())
    connector.shutdown()
    asyncio.run(connector.close())


def test_the_engine_asks_every_connector_in_order_through_the_interface(tiny_model_paths, tmp_path):
    llm = AsyncLLM.from_config(build_engine_config(tiny_model_paths["llama"], num_kv_blocks=64,
                                                   kv_offloading_size=0.01, kv_offloading_path=str(tmp_path)))
    log: list = []
    peer, store = Recording("peer", log), Recording("store", log, tier=True)
    llm.add_connector(peer)
    llm.add_connector(store)

    async def main():
        llm.expect("r", "params")
        async for _ in llm.generate({"prompt_token_ids": list(range(5, 40))}, SamplingParams(max_tokens=2), "r",
                                    kv_transfer_params="params"):
            pass
        # Announced on the engine's thread, in order, before any connector was asked about the request.
        assert log[:3] == [("peer", "expect", "r", "params", "epdserve-engine"),
                           ("store", "expect", "r", "params", "epdserve-engine"), ("peer", "asked", "r")]
        # The tiers' counters by name, the engine's own first; read now, though the engine is idle.
        stats = llm.stats()
        assert list(stats.kv_tiers) == ["local", "store"] and stats.kv_tiers["store"].saved_blocks == 0
        store.saved = 3
        assert llm.stats().kv_tiers["store"].saved_blocks == 3
        # The KV events carry what each tier stored, by name; a connector that publishes none is not named.
        batch = await llm.kv_events(1)
        assert [t.tier for t in batch.tiers] == ["store"] and batch.tiers[0].stored == (b"\x05" * 16,)
        snapshot = await llm.kv_events(None)
        assert {t.tier: t.stored for t in snapshot.tiers} == {"local": (), "store": (b"\x05" * 16,)}
        log.clear()
        tier = llm._engine.connectors[0]
        await llm.close()
        return tier

    tier = asyncio.run(main())
    assert isinstance(tier, OffloadConnector) and not tier._thread.is_alive()  # its `shutdown` came first
    assert log == [("peer", "shutdown"), ("store", "shutdown"), ("peer", "close", "MainThread"),
                   ("store", "close", "MainThread")]
