"""A request handed from one engine to another after its first tokens: prefill computes the prompt and samples
each sequence's first token, decode continues from there on the prompt's KV (loaded through a KV connector,
or recomputed when it cannot be had).

The invariant that keeps this exact: a seeded request draws one vocabulary-sized row of noise per sampled
token (`draw_seeded_noise`), whichever engine samples it. The engine that continues a request draws the rows
of the tokens the peer sampled before it samples its own, so the seeded stream - and the tokens - are those
of one engine doing it all. The tokens themselves count as output for penalties, limits, stop conditions and
the structured-output matcher, and as already delivered: the peer's answer carried them to the client.
"""
from __future__ import annotations

from typing import Sequence

from epdserve.shared.engine.parallel_sampling import group_members
from epdserve.shared.engine.request import Request
from epdserve.shared.engine.sampler import draw_seeded_noise

# The part of the request the prefill engine runs: up to each sequence's first token.
PREFILL_OUTPUT_TOKENS = 1


def continue_from_peer(request: Request, first_token_ids: Sequence[int], vocab_size: int) -> None:
    """Give each sequence of `request` (n of them) the first token the peer sampled for it, as if sampled here."""
    members = group_members(request)
    if len(first_token_ids) != len(members):
        raise ValueError(f"{len(first_token_ids)} first tokens for a request of {len(members)} sequences")
    for sequence in members:
        token_id = first_token_ids[sequence.index]
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"first token {token_id} is outside the vocabulary [0, {vocab_size})")
        if sequence.generator is not None and not sequence.sampling_params.is_greedy:
            draw_seeded_noise(sequence.generator, vocab_size)
        sequence.append_output_token(token_id)
        sequence.num_peer_tokens = 1
