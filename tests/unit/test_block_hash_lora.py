"""A LoRA adapter's key makes every block of a prompt its own: no two adapters, nor an adapter and the base
model, share a block hash for the same tokens; the same adapter always hashes the same."""
from epdserve.shared.block_hash import extend_block_hashes


def hashes(lora_key=None, salt=None):
    return extend_block_hashes([], list(range(64)), 16, (), salt, lora_key)


def test_adapters_and_base_never_share_a_block():
    base, a, b = hashes(), hashes("digest-a"), hashes("digest-b")
    assert len(base) == len(a) == len(b) == 4
    assert not set(base) & set(a) and not set(a) & set(b) and not set(base) & set(b)


def test_same_adapter_same_hashes_and_salt_still_counts():
    assert hashes("digest-a") == hashes("digest-a")
    assert not set(hashes("digest-a")) & set(hashes("digest-a", salt="tenant"))


def test_incremental_extension_keeps_the_key():
    tokens = list(range(64))
    partial = extend_block_hashes([], tokens[:40], 16, (), None, "digest-a")
    assert extend_block_hashes(partial, tokens, 16, (), None, "digest-a") == hashes("digest-a")
