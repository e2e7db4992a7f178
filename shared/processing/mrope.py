"""M-RoPE positions (Qwen2.5-VL): three positions per prompt token - temporal, height, width.

Made where the prompt is built, from its placeholders and each image's grid, and sent with the request,
so that every engine that computes the prompt (a prefill, a decode that recomputes, a unified one) rotates
by the same positions without knowing images. As HF's `get_rope_index`: a text token's three positions are
all one more than the largest position before it; an image of t x h x w merged tokens (row-major) starting
after position p - 1 puts token (i, j, k) at (p + i, p + j, p + k), and the text after it continues from
p + max(h, w) (a still image is one frame). Tokens generated later continue from the prompt's largest
position plus one (the engine's `Request.rope_positions`).
"""
from __future__ import annotations

from typing import Sequence

from epdserve.shared.processing.multimodal import MultiModalPlaceholder


def mrope_positions(num_tokens: int, placeholders: Sequence[MultiModalPlaceholder],
                    grids: Sequence[tuple[int, int, int]]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The (temporal, height, width) position rows of a `num_tokens` prompt whose i-th placeholder holds an
    image of `grids[i]` = (t, h, w) merged tokens (t * h * w == its length)."""
    if len(placeholders) != len(grids):
        raise ValueError(f"{len(placeholders)} placeholders but {len(grids)} image grids")
    rows: tuple[list[int], list[int], list[int]] = ([], [], [])
    cursor, next_position = 0, 0

    def text(until: int) -> None:
        nonlocal cursor, next_position
        run = range(next_position, next_position + until - cursor)
        for row in rows:
            row.extend(run)
        next_position += until - cursor
        cursor = until

    for ph, (t, h, w) in sorted(zip(placeholders, grids), key=lambda item: item[0].offset):
        if t * h * w != ph.length or ph.offset < cursor:
            raise ValueError(f"an image grid {t}x{h}x{w} does not fit its placeholder ({ph.offset}, {ph.length})")
        text(ph.offset)
        start = next_position
        for i in range(t):
            for j in range(h):
                rows[0].extend([start + i] * w)
                rows[1].extend([start + j] * w)
                rows[2].extend(range(start, start + w))
        cursor = ph.offset + ph.length
        next_position = start + max(h, w)
    if cursor > num_tokens:
        raise ValueError(f"the placeholders run past the {num_tokens}-token prompt")
    text(num_tokens)
    return tuple(rows[0]), tuple(rows[1]), tuple(rows[2])
