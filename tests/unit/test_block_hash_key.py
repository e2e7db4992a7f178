"""A deployment's key makes its block hashes its own: nobody without the deployment's secret can compute the
hash of a guessed prompt's block (to look it up in a store, or plant KV under it); every engine and router of
the deployment, holding the same secret, hashes alike."""
import hashlib
from array import array

from epdserve.services.cli.main import engine_config, parse_args, proxy_config
from epdserve.shared.block_hash import deployment_key, extend_block_hashes, hash_block
from epdserve.shared.engine.block_manager import BlockManager

TOKENS = list(range(64))


def test_keyed_hashes_are_the_deployments_own():
    key, other = deployment_key(b"a" * 32), deployment_key(b"b" * 32)
    assert deployment_key(None) is None and key == deployment_key(b"a" * 32) and key != other
    plain = extend_block_hashes([], TOKENS, 16, (), "tenant")
    keyed = extend_block_hashes([], TOKENS, 16, (), "tenant", key=key)
    assert len(keyed) == 4 and not set(plain) & set(keyed)
    assert not set(keyed) & set(extend_block_hashes([], TOKENS, 16, (), "tenant", key=other))
    # The block-at-a-time form and the incremental one agree, with the key kept along the chain.
    parent = None
    for i in range(4):
        parent = hash_block(parent, TOKENS[i * 16:(i + 1) * 16], ("salt:tenant",) if i == 0 else (), key=key)
        assert parent == keyed[i]
    partial = extend_block_hashes([], TOKENS[:40], 16, (), "tenant", key=key)
    assert extend_block_hashes(partial, TOKENS, 16, (), "tenant", key=key) == keyed
    # What an unkeyed hash over the tokens gives (as a prober would compute it) names none of them.
    guess = hashlib.blake2b(b"\0" * 16 + array("q", TOKENS[:16]).tobytes() + b"\x1fsalt:tenant", digest_size=16)
    assert guess.digest() == plain[0] != keyed[0]


def test_the_block_manager_hashes_with_the_deployments_key():
    from epdserve.shared.engine.request import Request
    from epdserve.shared.engine import SamplingParams

    key = deployment_key(b"k" * 32)
    manager = BlockManager(8, 16, hash_key=key)
    request = Request("r", TOKENS, SamplingParams(max_tokens=1), max_model_len=1024)
    manager._update_block_hashes(request)
    assert request.block_hashes == extend_block_hashes([], TOKENS, 16, key=key)


def test_engines_and_the_router_of_a_deployment_share_the_key(monkeypatch, default_model_path):
    monkeypatch.setenv("EPDSERVE_SECRET", "d" * 32)
    proxy = proxy_config(parse_args(["serve", "proxy", "--decode", "127.0.0.1:7001"]), str(default_model_path))
    assert proxy.lifecycle.block_hash_key == deployment_key(b"d" * 32)
    assert "d" * 32 not in repr(proxy)
