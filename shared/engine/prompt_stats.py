"""Where the prompts an engine prefills come from, counted as vLLM counts them (`prefix_cache_*`,
`external_prefix_cache_*`, `prompt_tokens_by_source`) - once per request.

A request is counted when the engine first starts it from what it found: at its admission, its prefix-cache
hits; once a KV tier's load into its blocks succeeded (the local offload tier, the shared store: connectors
that `caches_prefixes`), the tokens that load brought too. A load that fails brings nothing: the request is
counted when it is admitted again, with the tokens it then computes. Looked up are the request's tokens, in
the pool's prefix cache and - with a tier - in the tiers; found are the hits of each. By source, its prompt
tokens are split into those computed here, found in the pool, and brought by a tier.

Counted once per request, so that a sum over every engine of a deployment counts each request once: a
preempted request computing its prompt again is not counted again, the n sequences of a request are counted
as one, and a request that continues from first tokens a peer sampled (handoff.py: a decode continuing after
prefill, or a stream continued after its instance was lost) is not counted at all - its prompt was looked up
and counted by the engine that prefilled it. What an engine computes, recomputations included, is its
`num_prompt_tokens`, not this.
"""
from __future__ import annotations

from typing import NamedTuple

from epdserve.shared.engine.parallel_sampling import group_members
from epdserve.shared.engine.request import Request

# vLLM's `source` label values of prompt_tokens_by_source.
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


class PromptCounts(NamedTuple):
    """The counters since the engine started (in tokens)."""

    prefix_queries: int  # tokens looked up in the pool's prefix cache
    prefix_hits: int  # ... and found there
    external_queries: int  # tokens looked up in the KV tiers (0 without one)
    external_hits: int  # ... and brought from one
    by_source: dict[str, int]  # prompt tokens by where they came from (SOURCES)


class PromptStats:
    def __init__(self) -> None:
        self.prefix_queries = self.prefix_hits = 0
        self.external_queries = self.external_hits = 0
        self.by_source = dict.fromkeys(SOURCES, 0)

    def count(self, request: Request, local_hits: int, external_hits: int, has_tier: bool) -> None:
        """`request` starts with `local_hits` tokens from the pool and `external_hits` from a tier (`has_tier`:
        the engine has one, so the tiers were looked up too); counted unless it was already, or continues
        from a peer's tokens. Its group's waiting sequences will fork from it: they count as counted."""
        if request.prompt_counted or request.num_peer_tokens:
            return
        for member in group_members(request):
            member.prompt_counted = True
        self.prefix_queries += request.num_tokens
        self.prefix_hits += local_hits
        if has_tier:
            self.external_queries += request.num_tokens
            self.external_hits += external_hits
        self.by_source["local_cache_hit"] += local_hits
        self.by_source["external_kv_transfer"] += external_hits
        self.by_source["local_compute"] += max(request.num_prompt_tokens - local_hits - external_hits, 0)

    def counts(self) -> PromptCounts:
        return PromptCounts(self.prefix_queries, self.prefix_hits, self.external_queries, self.external_hits,
                            dict(self.by_source))
