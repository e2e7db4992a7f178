"""Which instance of each role serves a request, and which instances are alive.

Each role is given as targets `host:port`; a host name is re-resolved periodically, so a compose service
name or a Kubernetes headless Service (both resolve to every replica) discovers replicas as they come
and go. A discovery file (discovery.py), which `epdserve up --planner` rewrites as it scales, lists them too. Every instance is polled for its Status over its control channel; one that reports anything but
READY (starting, draining, unhealthy), misses `max_misses` polls in a row, or misses one after its
connection dropped, is dropped from routing until it answers READY again.

Routing and liveness are two things: a DRAINING instance takes no new request but is alive, and the
streams it holds go on until it finishes them. An instance that DNS stops naming (a pod that turned
unready, a container that stopped) is likewise kept - polled, never routed to - for as long as this
proxy has requests there, so those streams end with its answers or, if it went away, with an error
once its polls fail, never with a wait on an address nobody watches.

Choices (`Route`): with KV-aware routing, prefill, decode and unified by the prompt blocks each instance
holds - what its KV events reported, kept in the prefix index - weighed against its load (kv_routing.py);
otherwise prefill (and unified) by prefix affinity - rendezvous hashing of the prompt's first blocks,
unless that instance is much busier than the least busy one - and decode by free KV blocks and load.
Encoders always by `mm_hash` affinity, so an image is encoded once.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
import time
from array import array
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

from epdserve.services.runtime.network import split_target
from epdserve.services.proxy import kv_routing
from epdserve.services.proxy.discovery import Discovery
from epdserve.services.proxy.prefix_index import STORE, PrefixIndex
from epdserve.transport.channel.protocol import Health, KVEvents, KVEventsRequest, Role, Status, StatusRequest
from epdserve.transport.channel.common import ChannelError, ErrorReply
from epdserve.transport.channel.request_client import RequestClient
from epdserve.transport.channel.security import bracketed

logger = logging.getLogger(__name__)

ClientFactory = Callable[[str, Role], RequestClient]
HASH_BYTES = 16  # a block hash (shared/engine/block_hash.py)


@dataclass(eq=False)
class Instance:
    role: Role
    address: str  # tcp://ip:port of its control channel
    client: RequestClient
    status: Status | None = None
    misses: int = 0
    alive: bool = False  # answers its polls (ready, starting or draining): what it holds goes on
    draining: bool = False  # reported STARTING or DRAINING, or DNS no longer names it: takes nothing new
    # Requests this proxy has sent and not seen finish: load the status poll has not reported yet. Changed
    # only by `start` and `end`, by whoever sends the instance work.
    inflight: int = 0
    # Prompt tokens this proxy has sent the instance to compute and has no first token for yet: its prefill
    # queue as this proxy sees it (prefill_queue.py). Changed only by `start`, `prefilled` and `end`.
    queued_prompt_tokens: int = 0
    disconnects_seen: int = 0  # the client's disconnect count at the last answered poll

    def start(self, prompt_tokens: int = 0) -> None:
        """A call or stream of this proxy's is now with the instance (with `prompt_tokens` to prefill)."""
        self.inflight += 1
        self.queued_prompt_tokens += prompt_tokens

    def prefilled(self, prompt_tokens: int) -> None:
        """The first token of a stream's prompt of `prompt_tokens` arrived: no longer queued here."""
        self.queued_prompt_tokens -= prompt_tokens

    def end(self, prompt_tokens: int = 0) -> None:
        """The call or stream ended, with `prompt_tokens` of its prompt still queued here."""
        self.inflight -= 1
        self.queued_prompt_tokens -= prompt_tokens

    @property
    def load(self) -> int:
        s = self.status
        return self.inflight + (s.num_running + s.num_waiting if s else 0)

    @property
    def routable(self) -> bool:
        # A dropped connection rules it out at once; its next answered poll lets it back in.
        return self.alive and not self.draining and not self.client.is_down

    @property
    def data_addr(self) -> str:
        return self.status.data_addr if self.status else ""


class Route(NamedTuple):
    """How an instance of a role is chosen for a request: by the leading blocks of its prompt each one
    holds (`cached`: address -> blocks, of `prompt_blocks`; see kv_routing), else by affinity `key`,
    else the least loaded."""
    key: bytes | None = None
    cached: dict[str, float] | None = None
    prompt_blocks: int = 0
    load_weight: float = 0.0
    elsewhere: float = 0.0  # what an instance absent from `cached` holds: the shared store's blocks, weighted
    # The request's LoRA adapter: instances that have read it are preferred (the others would read it first,
    # and may have no slot for it).
    lora: str | None = None


class NoInstanceError(Exception):
    """No healthy instance of a role (the client gets 503)."""


class RolePool:
    """The instances of one role: discovery, health polling, and choosing."""

    def __init__(self, role: Role, targets: Sequence[str], make_client: ClientFactory, max_misses: int = 3,
                 poll_timeout: float = 2.0, index: PrefixIndex | None = None) -> None:
        self.role = role
        self.index = index  # fed with what each instance's prefix cache holds (KV-aware routing)
        self.targets = [split_target(t) for t in targets]
        self.make_client = make_client
        self.max_misses = max_misses
        self.poll_timeout = poll_timeout
        self.instances: dict[str, Instance] = {}
        # Gone from DNS with requests of this proxy still there: polled until those end, never routed to.
        self.retiring: dict[str, Instance] = {}
        self.unresolved: set[str] = set()  # host names whose last lookup failed (warned about once)

    @property
    def configured(self) -> bool:
        return bool(self.targets)

    async def resolve(self) -> None:
        """Add instances that DNS now names, close those it no longer does."""
        loop = asyncio.get_running_loop()
        found: set[str] = set()
        for host, port in self.targets:
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                # Once per outage: a compose service scaled to 0 stays unresolvable for as long as it likes.
                level = logging.DEBUG if host in self.unresolved else logging.WARNING
                logger.log(level, "cannot resolve %s instance %s: %s (retrying every few seconds)",
                           self.role.value, host, exc)
                self.unresolved.add(host)
                continue
            self.unresolved.discard(host)
            # IPv4 addresses if the name has any, else IPv6: a dual-stack name points at the
            # same process twice, and services bind one family unless told otherwise.
            ipv4 = [info for info in infos if info[0] == socket.AF_INET]
            found.update(f"tcp://{bracketed(info[4][0])}:{port}" for info in ipv4 or infos)
        for address in found - self.instances.keys():
            instance = self.retiring.pop(address, None)
            if instance is not None:
                instance.draining = False  # its next poll tells whether it takes requests again
            else:
                logger.info("discovered %s instance %s", self.role.value, address)
                instance = Instance(self.role, address, self.make_client(address, self.role))
            self.instances[address] = instance
        for address in self.instances.keys() - found:
            instance = self.instances.pop(address)
            instance.draining = True
            if instance.inflight and instance.alive:
                logger.info("%s instance %s is no longer listed (DNS, discovery file); watching it until %d "
                            "request(s) there end",
                            self.role.value, address, instance.inflight)
                self.retiring[address] = instance
            else:
                logger.info("%s instance %s is no longer listed (DNS, discovery file)", self.role.value, address)
                await self._close_instance(instance)

    async def poll(self) -> None:
        await asyncio.gather(*(self._poll_one(i) for i in [*self.instances.values(), *self.retiring.values()]))
        for address, instance in list(self.retiring.items()):
            if not instance.inflight or not instance.alive:
                del self.retiring[address]
                await self._close_instance(instance)

    async def _close_instance(self, instance: Instance) -> None:
        instance.alive = False  # whoever still holds it (an abort on its way) leaves it alone
        if self.index is not None:
            self.index.drop(instance.address)
        await instance.client.close()

    async def _poll_one(self, instance: Instance) -> None:
        try:
            status = await instance.client.request(StatusRequest(), timeout=self.poll_timeout, expect=Status)
        except (ChannelError, TimeoutError) as exc:
            instance.misses += 1
            # A dropped connection that does not come back is a dead process: no need to wait for more misses.
            dropped = instance.client.num_disconnects != instance.disconnects_seen
            if instance.alive and (instance.misses >= self.max_misses or dropped):
                logger.warning("%s instance %s missed %d polls%s: dropped (%s)", self.role.value, instance.address,
                               instance.misses, " after its connection dropped" if dropped else "", exc)
                instance.alive = False
                if self.index is not None:  # if it comes back, a snapshot tells what it holds then
                    self.index.drop(instance.address)
            return
        ready = status.health == Health.READY
        retiring = instance.address in self.retiring
        if instance.routable != (ready and not retiring):
            logger.info("%s instance %s (%s) is %s", self.role.value, instance.address, status.engine_id,
                        status.health.value)
        instance.status, instance.misses = status, 0
        instance.disconnects_seen = instance.client.num_disconnects
        instance.alive = status.health != Health.UNHEALTHY
        instance.draining = not ready or retiring
        if self.index is not None and instance.alive:
            await self._poll_kv_events(instance)

    async def _poll_kv_events(self, instance: Instance) -> None:
        """Apply what the instance's prefix cache stored and evicted since the last poll (a snapshot when
        the index does not follow it yet). A failure here says nothing of liveness: the status poll does."""
        index = self.index
        try:
            events = await instance.client.request(KVEventsRequest(index.next_seq(instance.address)),
                                                   timeout=self.poll_timeout, expect=KVEvents)
        except (ChannelError, TimeoutError) as exc:
            logger.debug("%s instance %s: no KV events (%s)", self.role.value, instance.address, exc)
            return
        if index.block_size is None:
            index.block_size = events.block_size
        elif events.block_size != index.block_size:
            logger.warning("%s instance %s caches blocks of %d tokens, not %d: not indexed", self.role.value,
                           instance.address, events.block_size, index.block_size)
            return
        if not index.apply(instance.address, events.first_seq, events.last_seq, _hashes(events.stored),
                           _hashes(events.removed), events.snapshot, _hashes(events.offloaded_stored),
                           _hashes(events.offloaded_removed)):
            logger.info("%s instance %s: KV events from %d do not follow; asking for a snapshot",
                        self.role.value, instance.address, events.first_seq)

    def mark_failed(self, instance: Instance) -> None:
        """A request to it failed at the transport level: stop routing to it until it answers a poll."""
        instance.alive = False

    def healthy(self) -> list[Instance]:
        """The instances new requests may go to."""
        return [i for i in self.instances.values() if i.routable]

    def _require(self, exclude: Sequence[Instance] = ()) -> list[Instance]:
        candidates = [i for i in self.healthy() if i not in exclude]
        if not candidates:
            raise NoInstanceError(f"no healthy {self.role.value} instance")
        return candidates

    def pick(self, route: Route, exclude: Sequence[Instance] = ()) -> Instance:
        if route.lora is not None:
            exclude = [*exclude, *self._lacking_adapter(route.lora, exclude)]
        if route.cached is not None:
            return kv_routing.pick(self._require(exclude), route.cached, route.prompt_blocks, route.load_weight,
                                   route.key or b"", route.elsewhere)[0]
        if route.key is not None:
            return self.pick_affine(route.key, exclude)
        return self.pick_least_loaded(exclude)

    def _lacking_adapter(self, name: str, exclude: Sequence[Instance]) -> list[Instance]:
        """The candidates that have not read adapter `name`, when some other candidate has (else none: any
        instance reads it on first use)."""
        candidates = [i for i in self.healthy() if i not in exclude]
        lacking = [i for i in candidates if i.status is None or name not in i.status.lora_adapters]
        return lacking if len(lacking) < len(candidates) else []

    def pick_affine(self, key: bytes, exclude: Sequence[Instance] = (), slack: int = 4) -> Instance:
        """The key's rendezvous-hash favourite, unless it carries `slack` more requests than the least loaded."""
        candidates = self._require(exclude)
        favourite = max(candidates, key=lambda i: kv_routing.rendezvous(key, i.address))
        least = min(candidates, key=lambda i: i.load)
        return least if favourite.load > least.load + slack else favourite

    def pick_least_loaded(self, exclude: Sequence[Instance] = ()) -> Instance:
        """Most free KV blocks per running request; ties broken by fewer requests."""
        candidates = self._require(exclude)
        return max(candidates, key=lambda i: ((i.status.num_free_blocks if i.status else 0) / (1 + i.load), -i.load))

    async def close(self) -> None:
        for instance in [*self.instances.values(), *self.retiring.values()]:
            await instance.client.close()
        self.instances.clear()
        self.retiring.clear()


def _hashes(packed: bytes) -> list[bytes]:
    """Block hashes sent concatenated (KVEvents)."""
    return [packed[i:i + HASH_BYTES] for i in range(0, len(packed) - HASH_BYTES + 1, HASH_BYTES)]


def prefix_key(prompt_token_ids: Sequence[int], cache_salt: str | None, num_tokens: int = 64) -> bytes:
    """Affinity key of a prompt: its first `num_tokens` tokens (a few blocks) and its cache salt."""
    head = array("q", prompt_token_ids[:num_tokens]).tobytes()
    return hashlib.blake2b(head + (cache_salt or "").encode(), digest_size=16).digest()


class Router:
    """The pools of every role, kept fresh by one background task."""

    def __init__(self, pools: dict[Role, RolePool], poll_interval: float = 1.0, resolve_interval: float = 5.0,
                 index: PrefixIndex | None = None, store: RequestClient | None = None,
                 discovery: Discovery | None = None) -> None:
        """`store`: the shared KV store's control channel, whose KV events the index follows too; `discovery`:
        a file that lists instances (discovery.py), read again whenever it changes."""
        self.pools = pools
        self.discovery = discovery
        self.index = index  # what the engines' prefix caches hold, when routing is KV-aware
        self.store = store if index is not None and index.store is not None else None
        self.poll_interval = poll_interval
        self.resolve_interval = resolve_interval
        self._task: asyncio.Task | None = None

    def pool(self, role: Role) -> RolePool:
        return self.pools[role]

    @property
    def disaggregated(self) -> bool:
        return not self.pools[Role.UNIFIED].configured

    async def refresh(self) -> None:
        self._discover()
        for pool in self.pools.values():
            await pool.resolve()
        await asyncio.gather(*(pool.poll() for pool in self.pools.values()), self._poll_store())

    async def _poll_store(self) -> None:
        """Apply what the shared KV store stored and dropped since the last poll; a store that does not
        answer holds nothing for routing until it does (engines recompute rather than wait on it)."""
        if self.store is None:
            return
        index = self.index.store
        try:
            events = await self.store.request(KVEventsRequest(index.next_seq(STORE)), timeout=self.poll_interval * 2,
                                              expect=KVEvents)
        except (ChannelError, ErrorReply, TimeoutError) as exc:
            if index.num_blocks(STORE):
                logger.warning("KV store %s: no KV events (%s); routing without it", self.store.address, exc)
            index.drop(STORE)
            return
        index.apply(STORE, events.first_seq, events.last_seq, _hashes(events.stored), _hashes(events.removed),
                    events.snapshot)

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        last_resolve = time.monotonic()
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                if self._discover() or time.monotonic() - last_resolve > self.resolve_interval:
                    for pool in self.pools.values():
                        await pool.resolve()
                    last_resolve = time.monotonic()
                await asyncio.gather(*(pool.poll() for pool in self.pools.values()), self._poll_store())
            except Exception:  # the router must keep polling whatever one poll did
                logger.exception("router refresh failed")

    def _discover(self) -> bool:
        """The discovery file's instances as the targets of the roles it names; True if they changed."""
        if self.discovery is None or not self.discovery.changed():
            return False
        for role, targets in self.discovery.targets.items():
            self.pools[role].targets = [split_target(t) for t in targets]
        return True

    def find(self, engine_id: str) -> Instance | None:
        """The instance whose status reports `engine_id`."""
        for pool in self.pools.values():
            for instance in [*pool.instances.values(), *pool.retiring.values()]:
                if instance.status is not None and instance.status.engine_id == engine_id:
                    return instance
        return None

    def max_model_len(self) -> int | None:
        """The context length in force: the smallest the engines that answered their polls report (None: none
        has yet)."""
        lengths = [i.status.max_model_len for role in (Role.PREFILL, Role.DECODE, Role.UNIFIED)
                   for i in self.pools[role].instances.values() if i.status is not None and i.status.max_model_len]
        return min(lengths, default=None)

    def readiness(self) -> tuple[bool, dict]:
        """Ready when every configured role has a healthy instance: each serves some requests (encoders
        image prompts) that fail without it."""
        counts = {role.value: len(pool.healthy()) for role, pool in self.pools.items() if pool.configured}
        missing = [role for role, count in counts.items() if not count]
        return not missing, {"healthy_instances": counts, "unavailable_roles": missing}

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for pool in self.pools.values():
            await pool.close()
        if self.store is not None:
            await self.store.close()
