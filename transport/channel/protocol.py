"""Every message the services exchange, as typed structs in one tagged union.

Messages are frozen, slotted dataclasses: a received message cannot be changed by the loop that
handles it, and its fields are exactly those declared here. `epdserve.transport.channel.codec` is the only
code that turns them into bytes and back; it validates every field against the annotations below,
so what a loop receives always has the declared types.

Conventions:
- Sequences are tuples (immutable, like the struct that holds them).
- A top-level message has a `TAG` that names it on the wire; nested structs (KVHandle, ...) have none.
- Fields typed `torch.Tensor` travel out of band as raw frames after the message (see the codec); they
  are excluded from `==` so that messages compare by their control fields.
- Times are Unix seconds (float) so that they mean the same on every host.
- Engine types (SamplingParams, the sampler's logprobs, RequestOutput) are converted to and from
  these structs by `epdserve.services.host.wire` and nowhere else.

Compatibility: there is none across versions. Every message carries PROTOCOL_VERSION and the codec
drops any other version; within a version it requires exactly the declared fields (a default is
filled in by the constructor, never by the decoder). So any change to the wire schema - a field
added (with or without a default), removed, renamed or retyped, a tag or an enum value changed -
bumps PROTOCOL_VERSION, and peers of different versions refuse each other at the handshake.
tests/unit/test_protocol.py pins a fingerprint of the schema to the version.

This module does not import torch (only the annotations of tensor fields name it), nor does the codec:
tensors are tensor_frames.py's, which registers itself with the codec where a process moves tensors. The
proxy, which moves none, never loads torch.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Union

if TYPE_CHECKING:
    import torch

PROTOCOL_VERSION = 17


class Role(str, enum.Enum):
    PROXY = "proxy"
    ENCODER = "encoder"
    PREFILL = "prefill"
    DECODE = "decode"
    UNIFIED = "unified"
    KVSTORE = "kvstore"  # a shared KV store: blocks by chained hash, for every engine


class Health(str, enum.Enum):
    STARTING = "starting"  # alive, model not loaded yet: do not route to it
    READY = "ready"
    DRAINING = "draining"  # finishes what it holds, takes nothing new
    UNHEALTHY = "unhealthy"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"


class ErrorCode(str, enum.Enum):
    BAD_REQUEST = "bad_request"  # the request itself is invalid; retrying elsewhere will not help
    NOT_FOUND = "not_found"  # unknown request id, mm_hash or expired lease
    # A request's image embeddings could not be had from the encoder that made them (gone, unreachable):
    # encoded again, the same request may succeed.
    EMBEDDINGS_UNAVAILABLE = "embeddings_unavailable"
    STALE = "stale"  # a KV handle of an earlier generation: its blocks were released since
    OUT_OF_RANGE = "out_of_range"  # block ids or sizes outside what the peer holds
    INCOMPATIBLE = "incompatible"  # handshake refused: model or KV layout differ
    VERSION_MISMATCH = "version_mismatch"  # handshake refused: protocol versions differ
    HANDSHAKE_REQUIRED = "handshake_required"  # peer spoke before (re)doing the handshake
    UNAUTHENTICATED = "unauthenticated"  # handshake refused: no proof of the deployment's secret
    OVERLOADED = "overloaded"
    ABORTED = "aborted"
    INTERNAL = "internal"


# ---------------------------------------------------------------------------------------------
# Nested structs (no tag: they only travel inside a message)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What two engines must agree on before a KV block moves between them."""

    model_id: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    block_size: int  # tokens per block
    num_layers: int
    num_kv_heads: int
    head_size: int  # elements of one token's row of one head: an int8 pool's rows carry their scale (+2)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """(dtype, shape) of a tensor whose bytes travel separately (as a frame, or over UCX)."""

    dtype: str  # torch dtype name without the "torch." prefix
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LogitBias:
    token_id: int
    bias: float


@dataclass(frozen=True, slots=True)
class WireStructuredOutputs:
    """An output constraint (the engine's StructuredOutputsParams): what a grammar is compiled from."""

    kind: str  # json | json_object | regex | choice | grammar
    spec: str = ""


@dataclass(frozen=True, slots=True)
class WireSamplingParams:
    """The engine's SamplingParams as they travel: the same fields, minus those only the engine sets
    (see `epdserve.services.host.wire`, which converts, and the test that holds the two field sets equal)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: tuple[LogitBias, ...] = ()
    structured_outputs: WireStructuredOutputs | None = None


@dataclass(frozen=True, slots=True)
class MMItem:
    """One image of an EncodeRequest: its content hash and its encoded file bytes (PNG, JPEG...)."""

    mm_hash: str
    data: bytes


@dataclass(frozen=True, slots=True)
class EncodedItem:
    mm_hash: str
    num_tokens: int  # embedding rows the item expands to in the prompt


@dataclass(frozen=True, slots=True)
class MMPlaceholder:
    """Where an item's embeddings go in the prompt, and which encoder holds them."""

    offset: int  # first prompt position of the item's placeholder tokens
    length: int
    mm_hash: str
    encoder_addr: str


@dataclass(frozen=True, slots=True)
class MRopePositions:
    """An M-RoPE model's (Qwen2.5-VL) three positions of each prompt token, computed where the prompt was
    built: every engine that computes the prompt - prefill, a decode that recomputes, a unified one -
    rotates by these, and continues after them from the largest plus one."""

    temporal: tuple[int, ...]
    height: tuple[int, ...]
    width: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class WireLoRA:
    """The LoRA adapter a request runs with: its name, and the PEFT folder an engine reads it from (each
    engine that computes the request's KV - prefill and decode alike - applies the same adapter)."""

    name: str
    path: str


@dataclass(frozen=True, slots=True)
class KVHandle:
    """A request's KV blocks held by a prefill engine under a lease, for decode to pull."""

    engine_id: str
    kv_addr: str  # address of the prefill engine's KV transfer server
    block_ids: tuple[int, ...]  # in the request's block-table order
    # The server's token for this exposure of the blocks: a fetch must carry it back, and is refused once the
    # blocks were released (and maybe reused), even if the request id is exposed again.
    generation: int
    num_tokens: int  # tokens whose KV the blocks hold (the last block may be partial)
    lease_deadline: float  # Unix seconds; the blocks are freed after it unless renewed
    control_addr: str = ""  # the prefill engine's control channel, where Release goes


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The first token prefill sampled for one of a request's n sequences (n > 1)."""

    token_id: int
    logprobs: TokenLogprobs | None = None
    finish_reason: FinishReason | None = None  # set only when the whole request ended at its first tokens


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probabilities of one generated token: the sampled one and the top-N alternatives, best
    first. The one logprobs type services send and the proxy formats for the client."""

    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()  # one per top_token_ids entry
    rank: int | None = None  # of the token itself (1 = the most likely); None where unknown

    @property
    def top(self) -> list[tuple[int, float]]:
        """The alternatives as (token id, logprob) pairs, best first."""
        return list(zip(self.top_token_ids, self.top_logprobs))


@dataclass(frozen=True, slots=True)
class TraceSpan:
    """One timed stage of a request inside one service. Services return their spans with the request's
    answer; the proxy assembles them into the request's trace (services/proxy/tracing.py)."""

    name: str  # e.g. "prefill.queue", "prefill.compute", "kv.transfer", "decode.first_step"
    engine_id: str
    start: float  # Unix seconds
    end: float
    num_bytes: int = 0  # data moved in the stage (KV blocks, embeddings)
    num_blocks: int = 0


# ---------------------------------------------------------------------------------------------
# Handshake (first message on every connection)


@dataclass(frozen=True, slots=True)
class Handshake:
    TAG: ClassVar[str] = "handshake"
    protocol_version: int
    role: Role
    engine_id: str
    kv_layout: KVLayout | None = None  # set by KV transfer clients; must equal the server's
    kv_transport: str | None = None  # set by KV transfer clients ("zmq" | "ucx"); must equal the server's
    ucx_address: bytes | None = None  # UCX worker address of a UCX transfer client
    # Proof of the deployment's secret (transport/channel/peer_auth.py): a fresh nonce and its HMAC.
    auth_nonce: bytes | None = None
    auth_proof: bytes | None = None


@dataclass(frozen=True, slots=True)
class HandshakeAck:
    TAG: ClassVar[str] = "handshake_ack"
    protocol_version: int
    engine_id: str
    kv_layout: KVLayout | None = None
    kv_transport: str | None = None  # set by KV transfer servers
    ucx_address: bytes | None = None
    # A ZMQ transfer server's plain TCP port for blocks (block_stream), on the host of its address,
    # and the token a connection to it starts with; only for peers that may fetch blocks.
    data_port: int | None = None
    data_token: bytes | None = None
    auth_proof: bytes | None = None  # the server's proof of the deployment's secret, over the hello's nonce


# ---------------------------------------------------------------------------------------------
# Request lifecycle: encode -> prefill -> decode


@dataclass(frozen=True, slots=True)
class EncodeRequest:
    TAG: ClassVar[str] = "encode_request"
    request_id: str
    items: tuple[MMItem, ...]


@dataclass(frozen=True, slots=True)
class EncodeDone:
    TAG: ClassVar[str] = "encode_done"
    request_id: str
    items: tuple[EncodedItem, ...]
    trace: tuple[TraceSpan, ...] = ()


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    TAG: ClassVar[str] = "prefill_request"
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: WireSamplingParams
    mm_placeholders: tuple[MMPlaceholder, ...] = ()
    cache_salt: str | None = None
    mrope_positions: MRopePositions | None = None  # an M-RoPE model's image prompt's; None: 1-D positions
    lora: WireLoRA | None = None  # None: the base model


@dataclass(frozen=True, slots=True)
class PrefillDone:
    TAG: ClassVar[str] = "prefill_done"
    request_id: str
    first_token: int
    kv_handle: KVHandle | None  # None when the request already finished at its first token
    num_cached_tokens: int = 0  # prompt tokens served from the prefill engine's prefix cache
    finish_reason: FinishReason | None = None
    first_logprobs: TokenLogprobs | None = None
    # With prompt_logprobs: one per prompt token after the first (nothing predicts the first).
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    # With n > 1, the first tokens of sequences 1 .. n-1 (the fields above are sequence 0's); all of them
    # share the prompt's KV in `kv_handle`.
    other_first_tokens: tuple[FirstToken, ...] = ()
    trace: tuple[TraceSpan, ...] = ()  # queue and compute time in the prefill engine


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    TAG: ClassVar[str] = "decode_request"
    request_id: str
    prompt_token_ids: tuple[int, ...]
    first_token: int
    kv_handle: KVHandle
    sampling_params: WireSamplingParams
    # Decode hashes blocks for its own prefix cache exactly as prefill did, so it needs these too.
    mm_placeholders: tuple[MMPlaceholder, ...] = ()
    cache_salt: str | None = None
    reply_to: str = ""  # the proxy inbox (pull channel) that TokenDeltas are pushed to
    # With n > 1, the first tokens prefill sampled for sequences 1 .. n-1: decode pulls the prompt's KV
    # once and forks every sequence from it.
    other_first_tokens: tuple[int, ...] = ()
    # The positions prefill computed the prompt at: a decode that recomputes it uses the same, and every
    # token after it continues from them.
    mrope_positions: MRopePositions | None = None
    lora: WireLoRA | None = None  # prefill's adapter: decode continues with the same one


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """Prefill and decode in one engine: to a unified service, or to decode for a local prefill."""

    TAG: ClassVar[str] = "generate_request"
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: WireSamplingParams
    reply_to: str  # the proxy inbox that TokenDeltas are pushed to
    mm_placeholders: tuple[MMPlaceholder, ...] = ()
    cache_salt: str | None = None
    # A stream another instance lost, continued (n = 1): the tokens it delivered. The engine continues after
    # them, as if it had sampled them, and streams only what follows.
    output_token_ids: tuple[int, ...] = ()
    mrope_positions: MRopePositions | None = None  # an M-RoPE model's image prompt's; None: 1-D positions
    lora: WireLoRA | None = None


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """New tokens of one request since its previous delta (streamed decode -> proxy)."""

    TAG: ClassVar[str] = "token_delta"
    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token when requested, else empty
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that finished it
    num_cached_tokens: int | None = None  # on a stream's first delta: prompt tokens found in a prefix cache
    # On a stream's first delta, with prompt_logprobs: one per prompt token after the first.
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    index: int = 0  # which of the request's n sequences the tokens belong to
    # On a request's first delta: the engine's stages until then (queue, KV pull or local prefill,
    # first decode step).
    trace: tuple[TraceSpan, ...] = ()
    # How many of the sequence's output tokens came before this delta's (those a peer sampled included):
    # pushes are at most once, and this is how the proxy tells that one was lost on the way.
    offset: int = 0


@dataclass(frozen=True, slots=True)
class TokenDeltas:
    """The deltas one engine step made for the requests of one proxy: one message per step, not per request."""

    TAG: ClassVar[str] = "token_deltas"
    deltas: tuple[TokenDelta, ...]


@dataclass(frozen=True, slots=True)
class Release:
    """Decode has pulled the request's blocks: prefill may free them."""

    TAG: ClassVar[str] = "release"
    request_id: str


@dataclass(frozen=True, slots=True)
class RenewLease:
    TAG: ClassVar[str] = "renew_lease"
    request_id: str


@dataclass(frozen=True, slots=True)
class LeaseRenewed:
    TAG: ClassVar[str] = "lease_renewed"
    request_id: str
    lease_deadline: float


@dataclass(frozen=True, slots=True)
class Abort:
    TAG: ClassVar[str] = "abort"
    request_id: str


@dataclass(frozen=True, slots=True)
class HoldCheck:
    """Does the engine still run `request_id` (its stream not ended)? Ack if so, Error NOT_FOUND if not. A proxy
    asks when a stream has been silent a while: pushes are at most once, and a stream whose last delta was lost
    would otherwise wait out --token-timeout."""

    TAG: ClassVar[str] = "hold_check"
    request_id: str


@dataclass(frozen=True, slots=True)
class Ack:
    """Reply to a message that needs no other answer (Release, Abort, HoldCheck)."""

    TAG: ClassVar[str] = "ack"
    request_id: str


# ---------------------------------------------------------------------------------------------
# Status polling and errors


@dataclass(frozen=True, slots=True)
class StatusRequest:
    TAG: ClassVar[str] = "status_request"


@dataclass(frozen=True, slots=True)
class Status:
    TAG: ClassVar[str] = "status"
    engine_id: str
    role: Role
    health: Health
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    data_addr: str = ""  # its KV / embedding transfer server, for encoders and prefills
    # LoRA adapters it has read, which it serves without reading them again (routers prefer it for them),
    # and how many it can hold in its model at once (0: it serves none).
    lora_adapters: tuple[str, ...] = ()
    max_loras: int = 0
    max_model_len: int = 0  # the context length in force on an engine (its --max-model-len); 0: not an engine


@dataclass(frozen=True, slots=True)
class LoadLoRA:
    """Read and check a LoRA adapter now (answered by Ack, or an Error saying why it cannot be served)."""
    TAG: ClassVar[str] = "load_lora"
    name: str
    path: str


@dataclass(frozen=True, slots=True)
class UnloadLoRA:
    """Forget a LoRA adapter: requests running with it finish, new ones may not name it (Ack, or NOT_FOUND)."""
    TAG: ClassVar[str] = "unload_lora"
    name: str


@dataclass(frozen=True, slots=True)
class KVEventsRequest:
    """What an engine's prefix cache stored and evicted from event batch `next_seq` on (see
    shared/engine/kv_events.py); None: a snapshot of everything it holds."""
    TAG: ClassVar[str] = "kv_events_request"
    next_seq: int | None = None


@dataclass(frozen=True, slots=True)
class KVEvents:
    TAG: ClassVar[str] = "kv_events"
    engine_id: str
    block_size: int  # tokens per block: what a router hashes a prompt's blocks by
    first_seq: int
    last_seq: int
    # 16-byte chained block hashes, concatenated (shared/engine/block_hash.py). A reader applies the
    # removals before the stores.
    stored: bytes = b""
    removed: bytes = b""
    snapshot: bool = False  # `stored` is all the cache holds as of `last_seq`; forget the rest
    # The same for the engine's local offload tier: blocks it keeps beyond its pool, restored on a hit at
    # the cost of a copy (a snapshot's `offloaded_stored` is all the tier holds).
    offloaded_stored: bytes = b""
    offloaded_removed: bytes = b""


@dataclass(frozen=True, slots=True)
class KVStorePut:
    """Blocks for a KV store to keep, by chained block hash (shared/block_hash.py), answered with Ack. Each
    block is [num_layers, 2, num_kv_heads, block_size, head_size] of every layer's K and V, as `layout`
    says; the store checks each against its checksum (XXH3 of its bytes as sent) and keeps those intact."""
    TAG: ClassVar[str] = "kv_store_put"
    layout: KVLayout
    block_hashes: bytes  # 16 bytes each, concatenated
    token_ids: tuple[int, ...]  # block_size per block, in order
    checksums: tuple[int, ...]  # one per block
    blocks: tuple[torch.Tensor, ...] = field(compare=False)  # one [num_blocks, *block] tensor


@dataclass(frozen=True, slots=True)
class KVStoreGet:
    """The leading blocks of `block_hashes` the store holds for `layout`, answered with KVStoreBlocks. The
    getter shows the token ids it expects of those blocks (block_size per block): the store sends a block
    only to a getter that already holds its prefix, so what it keeps never tells one tenant another's prompt."""
    TAG: ClassVar[str] = "kv_store_get"
    layout: KVLayout
    block_hashes: bytes
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVStoreBlocks:
    TAG: ClassVar[str] = "kv_store_blocks"
    block_hashes: bytes  # the leading ones of the request held with the token ids asked for (maybe none)
    checksums: tuple[int, ...]  # as the blocks were put: the getter compares them with what landed
    blocks: tuple[torch.Tensor, ...] = field(compare=False)  # one [num_blocks, *block] tensor, or none


@dataclass(frozen=True, slots=True)
class Error:
    TAG: ClassVar[str] = "error"
    code: ErrorCode
    message: str
    request_id: str | None = None
    retryable: bool = False  # the refusal is about this instance, not the request: another may succeed
    retry_after: float = 0.0  # seconds after which this instance may take it (0: no estimate)


# ---------------------------------------------------------------------------------------------
# Data plane: KV blocks and encoder embeddings


@dataclass(frozen=True, slots=True)
class FetchBlocks:
    """Ask a KV transfer server for blocks it exposes for `request_id`.

    `run_lengths` splits `block_ids` into runs of consecutive ids (they sum to len(block_ids)). The
    data of a run is one segment per layer and K/V, sent straight from the server's cache: segment
    [run_length, *block] = kv_cache[layer, k_or_v, first_id : first_id + run_length], in the order
    run by run, then layer, then K before V.

    Empty `run_lengths`: the blocks are gathered into one segment [num_layers, 2, len(block_ids), *block]
    in block_ids order (blocks scattered over the cache move cheaper so than as tiny segments).

    With `ucx_tag` set, segment i goes over UCX with tag `ucx_tag + i` and the reply is BlocksSent;
    otherwise the reply is BlocksData carrying the segments. Either reply carries the checksum of each
    segment's bytes as sent (transport/kv/checksum.py), which the client compares with what landed.

    `generation` is the KVHandle's: the server refuses (ErrorCode.STALE) a fetch of another generation
    than the one it exposes the request's blocks under.
    """

    TAG: ClassVar[str] = "fetch_blocks"
    request_id: str
    generation: int
    block_ids: tuple[int, ...]
    run_lengths: tuple[int, ...]
    ucx_tag: int | None = None


@dataclass(frozen=True, slots=True)
class BlocksData:
    TAG: ClassVar[str] = "blocks_data"
    request_id: str
    block_ids: tuple[int, ...]
    checksums: tuple[int, ...]  # one per segment, over its bytes as sent
    # The segments FetchBlocks describes, each [run_length, *block] with blocks as the engines' caches
    # store them: head-major, [num_kv_heads, block_size, head_size] (see model_runner). The handshake's
    # KVLayout makes both sides' block shapes equal, so a block moves as raw bytes.
    segments: tuple[torch.Tensor, ...] = field(compare=False)


@dataclass(frozen=True, slots=True)
class BlocksSent:
    """The segments of a FetchBlocks went (or are going) another way: over UCX, or before this message on a
    block connection (transport/block_stream/)."""

    TAG: ClassVar[str] = "blocks_sent"
    request_id: str
    num_segments: int  # over UCX: with tags ucx_tag .. ucx_tag + num_segments - 1
    checksums: tuple[int, ...]  # one per segment, over its bytes as sent


@dataclass(frozen=True, slots=True)
class FetchEmbeddings:
    TAG: ClassVar[str] = "fetch_embeddings"
    mm_hash: str
    ucx_tag: int | None = None


@dataclass(frozen=True, slots=True)
class EmbeddingsData:
    TAG: ClassVar[str] = "embeddings_data"
    mm_hash: str
    checksum: int  # over the tensor's bytes as sent
    data: torch.Tensor = field(compare=False)  # [num_tokens, hidden_size]


@dataclass(frozen=True, slots=True)
class EmbeddingsSent:
    """The embeddings follow over UCX with the requested tag; `spec` sizes the receive buffer."""

    TAG: ClassVar[str] = "embeddings_sent"
    mm_hash: str
    spec: TensorSpec
    checksum: int  # over the tensor's bytes as sent


Message = Union[
    Handshake, HandshakeAck,
    EncodeRequest, EncodeDone, PrefillRequest, PrefillDone, DecodeRequest, GenerateRequest, TokenDelta,
    TokenDeltas, Release, RenewLease, LeaseRenewed, Abort, HoldCheck, Ack,
    StatusRequest, Status, KVEventsRequest, KVEvents, KVStorePut, KVStoreGet, KVStoreBlocks, Error, LoadLoRA,
    UnloadLoRA,
    FetchBlocks, BlocksData, BlocksSent, FetchEmbeddings, EmbeddingsData, EmbeddingsSent,
]

MESSAGE_TYPES: dict[str, type] = {cls.TAG: cls for cls in Message.__args__}

# What each role may send to a service (besides its Handshake): the request path of the design and
# nothing else. A peer's role is what its handshake claims; with CURVE on, only holders of the
# deployment's key get that far.
_KV_STORE_USE = (KVStorePut, KVStoreGet, KVEventsRequest, StatusRequest)
MAY_SEND: dict[Role, frozenset[type]] = {
    Role.PROXY: frozenset({StatusRequest, KVEventsRequest, EncodeRequest, PrefillRequest, DecodeRequest,
                           GenerateRequest, Abort, HoldCheck, LoadLoRA, UnloadLoRA}),
    # Engines pull embeddings and KV, hand prefill's blocks back, and push tokens to proxies.
    # Engines with a shared KV store put blocks there and get them, following what it holds by its KV events.
    Role.PREFILL: frozenset({FetchEmbeddings, TokenDelta, TokenDeltas, Error, *_KV_STORE_USE}),
    Role.DECODE: frozenset({FetchEmbeddings, FetchBlocks, RenewLease, Release, TokenDelta, TokenDeltas, Error,
                            *_KV_STORE_USE}),
    Role.UNIFIED: frozenset({FetchEmbeddings, TokenDelta, TokenDeltas, Error, *_KV_STORE_USE}),
    Role.ENCODER: frozenset(),
    Role.KVSTORE: frozenset(),
}
assert len(MESSAGE_TYPES) == len(Message.__args__), "two messages share a tag"
