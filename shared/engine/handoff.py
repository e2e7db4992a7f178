"""A request handed from one engine to another after its first tokens: prefill computes the prompt and samples
each sequence's first token, decode continues from there on the prompt's KV (loaded through a KV connector,
or recomputed when it cannot be had). A stream whose engine was lost mid-way continues the same way on
another engine, from every token already delivered (one sequence: a group's sequences would fork from one
prompt computation, so each continues as a request of its own, its seed that of its place in the group).

The invariant that keeps this exact: a seeded request's noise for a token depends on its seed and the token's
position alone (`sampler.seeded_generator`), whichever engine samples it, so the seeded stream - and the tokens
- are those of one engine doing it all. The tokens themselves count as output for penalties, limits, stop
conditions and the structured-output matcher, and as already delivered: the peer's answer carried them to the
client.
"""
from __future__ import annotations

from typing import Sequence

from epdserve.shared.engine.parallel_sampling import group_members
from epdserve.shared.engine.request import Request

# The part of the request the prefill engine runs: up to each sequence's first token.
PREFILL_OUTPUT_TOKENS = 1


def continue_from_peer(request: Request, peer_token_ids: Sequence[Sequence[int]], vocab_size: int) -> None:
    """Give each sequence of `request` (n of them) the tokens peers sampled for it, as if sampled here."""
    members = group_members(request)
    if len(peer_token_ids) != len(members):
        raise ValueError(f"tokens of {len(peer_token_ids)} sequences for a request of {len(members)} sequences")
    if len(members) > 1 and any(len(tokens) != 1 for tokens in peer_token_ids):
        raise ValueError("a request of n > 1 sequences continues from exactly one token of each")
    for sequence in members:
        token_ids = peer_token_ids[sequence.index]
        if not token_ids:
            raise ValueError("a request continued from a peer needs at least one token of it")
        if len(token_ids) > sequence.max_output_tokens:
            raise ValueError(f"{len(token_ids)} tokens already sampled exceed the request's "
                             f"{sequence.max_output_tokens} output tokens")
        for token_id in token_ids:
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"token {token_id} is outside the vocabulary [0, {vocab_size})")
            sequence.append_output_token(token_id)
        sequence.num_peer_tokens = len(token_ids)
