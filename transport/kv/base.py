"""What every data path implements: a `ClientPath` plugs one way of moving bytes into a KVTransferClient
(client.py), a `ServerPath` the matching way into a KVTransferServer (server.py). The client and server do
what every path shares - the control channel, the handshake's checks, planning a fetch into `Chunk`s,
checking a fetch against the exposed blocks, the checksums' comparison - and hand each path only the bytes.

Each path lives in a package of its own (transport/zmq_frames/, transport/block_stream/, transport/ucx/),
imports this core and the channel layer, and no other path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from epdserve.transport.channel.protocol import FetchBlocks, FetchEmbeddings, Handshake, HandshakeAck, Message
from epdserve.transport.kv.transfer import Run

if TYPE_CHECKING:
    import torch
    import zmq

    from epdserve.transport.channel.request_client import RequestClient
    from epdserve.transport.kv.client import KVTransferClient
    from epdserve.transport.kv.server import KVTransferServer


@dataclass(frozen=True, slots=True)
class Chunk:
    """One fetch message: the (remote, local) run pairs it moves, as runs or gathered."""

    pairs: list[tuple[Run, Run]]
    gathered: bool

    @property
    def remote_ids(self) -> tuple[int, ...]:
        return tuple(i for remote, _ in self.pairs for i in range(remote.first, remote.first + remote.length))

    @property
    def local_ids(self) -> list[int]:
        return [i for _, local in self.pairs for i in range(local.first, local.first + local.length)]

    @property
    def local_runs(self) -> list[Run]:
        return [local for _, local in self.pairs]

    def request(self, request_id: str, generation: int, ucx_tag: int | None = None) -> FetchBlocks:
        run_lengths = () if self.gathered else tuple(remote.length for remote, _ in self.pairs)
        return FetchBlocks(request_id, generation, self.remote_ids, run_lengths, ucx_tag=ucx_tag)


class ClientPath:
    """One way a client's bytes travel; the defaults are those of a path with nothing to say."""

    transport: ClassVar[str]  # the --kv-transport it belongs to: the server must use the same
    client: KVTransferClient

    def bind(self, client: KVTransferClient) -> None:
        self.client = client

    def hello_extra(self) -> dict:
        """Handshake fields this path tells servers (RequestClient keyword arguments)."""
        return {}

    def usable(self, peer: HandshakeAck) -> bool:
        """Whether this path can fetch blocks from the peer that answered the handshake so."""
        return False

    async def fetch_chunk(self, control: RequestClient, request: FetchBlocks, chunk: Chunk, deadline: float) -> int:
        """Receive one message's blocks into the cache (`KVTransferClient.landing`) and hand them to
        `KVTransferClient.land`; the bytes received."""
        raise NotImplementedError

    fetches_embeddings: ClassVar[bool] = False

    async def fetch_embeddings(self, control: RequestClient, mm_hash: str,
                               deadline: float) -> tuple[torch.Tensor, int]:
        """The embeddings, and the checksum the server sent with them."""
        raise NotImplementedError

    async def close(self) -> None:
        pass


class ServerPath:
    """One way a server's bytes travel; the defaults are those of a path with nothing to say."""

    transport: ClassVar[str]  # the --kv-transport it belongs to: peers must use the same
    server: KVTransferServer

    def bind(self, server: KVTransferServer) -> None:
        self.server = server

    def serves(self, message: FetchBlocks | FetchEmbeddings) -> bool:
        """Whether this path answers `message` on the control channel."""
        return False

    async def start(self) -> None:
        pass

    def ack_extra(self, hello: Handshake) -> dict:
        """HandshakeAck fields this path tells a peer."""
        return {}

    async def check_peer(self, hello: Handshake) -> str | None:
        """Why this path refuses the peer, or None."""
        return None

    async def reply_blocks(self, message: FetchBlocks, peer: Handshake) -> tuple[Message, int]:
        """The answer to a FetchBlocks this path serves, and the bytes it moves."""
        raise NotImplementedError

    async def reply_embeddings(self, message: FetchEmbeddings, peer: Handshake, tensor: torch.Tensor) -> Message:
        raise NotImplementedError

    def on_sent(self, reply: Message, tracker: zmq.MessageTracker) -> None:
        """A reply of this server's left for ZMQ's I/O thread, which reads its frames until `tracker` is done."""

    def sending(self, request_id: str) -> bool:
        """Whether a send of this path still reads the request's blocks: FETCHING while they are exposed,
        RELEASING once withdrawn (states.py)."""
        return False

    def abort(self, request_id: str) -> None:
        """Stop the sends still reading the request's blocks (their fetches fail); `sending` turns False once
        they no longer read them."""

    @property
    def num_rejected(self) -> int:
        return 0

    async def close(self) -> None:
        pass
