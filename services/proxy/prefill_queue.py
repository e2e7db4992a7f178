"""When a decode prefills a prompt itself because the prefill instances are backed up (conditional disaggregation).

Disaggregation pays while prefill keeps up: decodes step without prompts in their way. When prompts arrive
faster than the prefill instances compute them - a burst, or short chats queued behind long documents - each
waits behind the prompt tokens queued ahead of it, while decodes that could compute it sit idle or nearly so.
The proxy then sends a prompt straight to a decode (which prefills it with its own steps, as for a short
prompt) when

- the prompt has at most `limit` tokens: longer prompts always go to prefill, since they are what would stall
  a decode's running streams for the longest;
- every prefill instance has at least `limit` prompt tokens queued from this proxy (sent, no first token yet);
- and a decode has fewer queued, this prompt included, than the least queued prefill: whichever queue is
  shorter computes it, so a burst is shared between both roles instead of piling up on prefill.

The queues are this proxy's own view (what it sent and has no first token for), updated as it sends, so a
burst is split at once rather than one status poll later. `limit` 0 turns it off.

This is also what the planner takes for too little prefill: the prompts this rule gave to decodes (counted in
`epdserve:routing_decisions_total` under REASON) are prompts the prefill instances had no room for, so the planner
adds a prefill while the rule fires (services/planner/autoscaler.py reads that count): one definition of a
backed-up prefill, this one, for both.
"""
from __future__ import annotations

from typing import Iterable


REASON = "prefill_queue"  # the routing decision's reason when a prompt goes to a decode by this rule


def prefill_on_decode(prompt_tokens: int, prefill_queued: Iterable[int], decode_queued: Iterable[int],
                      limit: int) -> bool:
    """Whether a prompt of `prompt_tokens` is better prefilled by a decode, given the prompt tokens queued at each
    healthy prefill and decode instance."""
    if limit <= 0 or prompt_tokens > limit:
        return False
    shortest_prefill = min(prefill_queued, default=0)
    if shortest_prefill < limit:  # some prefill is not backed up: it takes the prompt
        return False
    return min(decode_queued, default=shortest_prefill) + prompt_tokens <= shortest_prefill
