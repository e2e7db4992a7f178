"""The router's prefix index: which instance holds how many leading blocks of a prompt."""
from epdserve.services.proxy.prefix_index import PrefixIndex
from epdserve.shared.block_hash import extend_block_hashes


def hashes(tokens, block_size=4, salt=None):
    return extend_block_hashes([], tokens, block_size, cache_salt=salt)


def test_leading_blocks_per_instance():
    index = PrefixIndex()
    prompt = hashes(list(range(40)))  # 10 blocks
    assert index.apply("a", 1, 1, prompt[:6], ())
    assert index.apply("b", 1, 2, prompt[:3], ())
    assert index.apply("c", 1, 1, prompt[4:], ())  # holds later blocks only: no leading prefix
    assert index.match(prompt) == {"a": 6, "b": 3}
    other = hashes([7] * 40)
    assert index.match(other) == {}


def test_chained_hashes_make_equal_blocks_after_different_prefixes_differ():
    first = hashes([1, 2, 3, 4, 5, 6, 7, 8])
    second = hashes([9, 9, 9, 9, 5, 6, 7, 8])
    assert first[1] != second[1]
    assert hashes([1, 2, 3, 4], salt="x") != hashes([1, 2, 3, 4])


def test_removed_blocks_stop_matching_and_shared_blocks_stay_with_the_other_holder():
    index = PrefixIndex()
    prompt = hashes(list(range(16)))
    index.apply("a", 1, 1, prompt, ())
    index.apply("b", 1, 1, prompt[:2], ())
    index.apply("a", 2, 2, (), prompt[1:2])
    assert index.match(prompt) == {"a": 1, "b": 2}
    index.drop("b")
    assert index.match(prompt) == {"a": 1}
    assert index.num_blocks("a") == 3


def test_a_gap_in_event_numbers_clears_the_instance_until_a_snapshot():
    index = PrefixIndex()
    prompt = hashes(list(range(16)))
    assert index.apply("a", 1, 3, prompt[:2], ())
    assert index.next_seq("a") == 4
    # Batch 4 was lost: 5 does not follow; what the index knew of "a" is gone, a snapshot is wanted.
    assert not index.apply("a", 5, 5, prompt[2:], ())
    assert index.match(prompt) == {}
    assert index.next_seq("a") is None
    assert index.num_resyncs == 1
    # Neither a late batch nor one that starts again from 1 (a restart) is taken before the snapshot.
    assert not index.apply("a", 1, 1, prompt, ())
    assert index.apply("a", 1, 9, prompt[:3], (), snapshot=True)
    assert index.match(prompt) == {"a": 3}
    assert index.next_seq("a") == 10


def test_a_new_entry_takes_the_history_from_one_or_a_snapshot():
    index = PrefixIndex()
    prompt = hashes(list(range(8)))
    assert not index.apply("late", 7, 7, prompt, ())  # joined a running instance: needs its snapshot
    assert index.next_seq("late") is None
    assert index.apply("late", 0, 7, prompt, (), snapshot=True)
    assert index.match(prompt) == {"late": 2}


def test_the_bound_forgets_the_oldest_blocks_of_an_instance():
    index = PrefixIndex(max_blocks_per_instance=4)
    blocks = hashes(list(range(24)))  # 6 blocks
    index.apply("a", 1, 1, blocks, ())
    assert index.num_blocks("a") == 4
    assert index.match(blocks) == {}  # the first two blocks were the oldest
    assert index.match(blocks[2:]) == {"a": 4}
    assert index.memory_bytes() > 0


def test_removing_an_unknown_block_is_harmless():
    index = PrefixIndex()
    index.apply("a", 1, 1, (), hashes(list(range(8))))
    assert index.num_blocks("a") == 0


def test_extending_hashes_chains_block_by_block_however_it_is_split():
    from types import SimpleNamespace

    from epdserve.shared.block_hash import block_extra_keys, hash_block

    tokens = list(range(100, 200))
    images = [SimpleNamespace(offset=20, length=30, mm_hash="img")]
    expected = []
    for i in range(len(tokens) // 8):
        expected.append(hash_block(expected[-1] if expected else None, tokens[i * 8:(i + 1) * 8],
                                   block_extra_keys(i, 8, images, "salt")))
    assert extend_block_hashes([], tokens, 8, images, "salt") == expected
    part = extend_block_hashes([], tokens[:21], 8, images, "salt")
    assert extend_block_hashes(part, tokens, 8, images, "salt") == expected
    assert expected != extend_block_hashes([], tokens, 8)  # the image and the salt are in the hashes
    plain = []
    for i in range(len(tokens) // 8):
        plain.append(hash_block(plain[-1] if plain else None, tokens[i * 8:(i + 1) * 8]))
    assert extend_block_hashes([], tokens, 8) == plain
    assert extend_block_hashes(extend_block_hashes([], tokens[:21], 8), tokens, 8) == plain
