"""The states a request's KV handoff passes through on the transport side, named in one place.

A prefill's KV transfer server exposes a finished request's blocks, a decode's client pulls them, and the
server withdraws them once they are released; an encoder's embeddings go the same way without the
exposure. Each side sees part of the way:

    EXPOSED --a fetch--> FETCHING --landed intact--> FETCHED --Release--> RELEASED
       |                    '--failed (TransferError)--> FAILED --Release--> RELEASED
       '--Release, an abort, the lease ran out, or the client gave up--> RELEASED
    withdrawn while a send still reads the blocks: RELEASING, until the last send ends (or is cut)
    a handle of an earlier exposure of the same request id: STALE

The server (`KVTransferServer.state`) tells EXPOSED, FETCHING (a send of one of its data paths reads the
blocks; back to EXPOSED when it ends), RELEASING, RELEASED and STALE; it serves fetches only in EXPOSED and
FETCHING, and its owner frees the blocks only once they are RELEASED (`KVTransferServer.wait_sent`). It
forgets a request once it is released: a request it never exposed is RELEASED too. The client tells
FETCHING, FETCHED and FAILED of its own fetches (`fetch_blocks` under way, returned, raised), and learns the
server's RELEASED and STALE from its refusals (BlocksNotFoundError, StaleHandleError). Why the blocks were
released - a decode's Release, an abort, a lease that ran out - is the owner's business, not the transport's.
"""
from __future__ import annotations

import enum


class HandoffState(enum.Enum):
    """Where one request's KV blocks stand between the server that holds them and the client that pulls them."""

    EXPOSED = "exposed"  # held by the server under a generation (the handle's) and served to fetches
    FETCHING = "fetching"  # a fetch is moving them: a server's send reads them, a client's fetch writes its copy
    FETCHED = "fetched"  # they landed intact in the client's cache (client side; the server releases on request)
    FAILED = "failed"  # the client's fetch failed: what it wrote is unusable, it computes the KV itself
    RELEASING = "releasing"  # withdrawn, no fetch is served, but a send that began before still reads them
    RELEASED = "released"  # withdrawn and read by no send: the server's owner may free them
    STALE = "stale"  # the handle names an earlier exposure of the request id: its blocks were released since
