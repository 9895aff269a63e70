"""cache_salt below the engine: the radix tree's partition, the L3 key chain, validation.

The references are independent: L3 keys are recomputed here with hashlib from the
documented scheme, and the tree's answers are compared with a plain dict of what each
salt inserted.
"""

from __future__ import annotations

import hashlib
import random

import pytest

from engine.cache_salt import (
    MAX_CACHE_SALT_CHARS,
    SALT_BUCKETS,
    check_cache_salt,
    salt_bucket,
    salt_digest,
)
from engine.errors import InvalidRequestError
from engine.kvcache.allocator import PageAllocator
from engine.kvcache.radix_cache import RadixCache
from engine.kvcache.storage.keys import chain_start, page_keys
from engine.request import SamplingParams

PAGE = 4
NAMESPACE = hashlib.sha256(b"a namespace").hexdigest()


def fresh_tree(pages: int = 64) -> RadixCache:
    return RadixCache(PageAllocator(pages, PAGE))


def insert(tree: RadixCache, key: list[int], salt: str) -> None:
    slots = tree.allocator.alloc_pages(len(key) // PAGE)
    already = tree.insert(key, slots, salt)
    if already:
        tree.allocator.free(slots[:already])


def test_validation_names_the_field() -> None:
    for good in (None, "t", "x" * MAX_CACHE_SALT_CHARS, "tenant-ä"):
        check_cache_salt(good)
    for bad in ("", "x" * (MAX_CACHE_SALT_CHARS + 1), 7, ["a"]):
        with pytest.raises(InvalidRequestError) as err:
            check_cache_salt(bad)
        assert err.value.param == "cache_salt"
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(cache_salt="").validate(vocab_size=100)
    assert err.value.param == "cache_salt"


def test_digest_and_bucket() -> None:
    assert salt_digest(None) == salt_digest("") == ""
    a, b = salt_digest("a"), salt_digest("b")
    assert a != b and len(a) == 64 and a == salt_digest("a")
    buckets = {salt_bucket(salt_digest(f"tenant-{i}")) for i in range(400)}
    assert buckets == set(range(SALT_BUCKETS))  # bounded, and every bucket is used


def test_same_key_under_other_salts_misses() -> None:
    tree = fresh_tree()
    key = list(range(100, 112))
    alice, bob = salt_digest("alice"), salt_digest("bob")
    insert(tree, key, alice)
    assert tree.match_prefix(key, salt=alice).device_len == 12
    assert tree.match_prefix(key, salt=bob).device_len == 0
    assert tree.match_prefix(key).device_len == 0  # unsalted sees no salted node
    insert(tree, key, "")
    insert(tree, key, bob)
    # Three copies now, one per salt, each matched only under its own salt.
    assert tree.cached_tokens == 36
    for salt in (alice, bob, ""):
        match = tree.match_prefix(key, salt=salt)
        assert match.device_len == 12
        node = match.device_node
        while node is not tree.root:
            assert node.salt == salt
            assert node.parent is not None
            node = node.parent


def test_unsalted_children_keep_the_bare_page_key() -> None:
    tree = fresh_tree()
    insert(tree, [1, 2, 3, 4, 5, 6, 7, 8], "")
    insert(tree, [1, 2, 3, 4, 5, 6, 7, 8], salt_digest("s"))
    assert (1, 2, 3, 4) in tree.root.children  # what an unsalted tree always had
    assert (salt_digest("s"), 1, 2, 3, 4) in tree.root.children


def test_split_evict_and_reinsert_keep_the_partition() -> None:
    """Random inserts, matches and evictions over 4 salts (and unsalted): every match
    equals the longest page-aligned prefix that salt inserted and still holds."""
    rng = random.Random(5)
    tree = fresh_tree(pages=40)
    salts = ["", *(salt_digest(f"t{i}") for i in range(4))]
    stems = [[rng.randrange(1000) for _ in range(16)] for _ in range(3)]
    held: dict[str, set[tuple[int, ...]]] = {s: set() for s in salts}
    for _ in range(400):
        salt = rng.choice(salts)
        key = rng.choice(stems)[: rng.choice((4, 8, 12, 16))] + [
            rng.randrange(1000) for _ in range(rng.choice((0, 4)))
        ]
        if rng.random() < 0.15:
            tree.evict(rng.choice((4, 16, 40)))
            # What survives, per salt: read back from the nodes (their paths).
            for s in salts:
                held[s] = set()
            for node in tree.nodes():
                path: list[int] = []
                walk = node
                while walk is not tree.root:
                    path[:0] = walk.key
                    assert walk.parent is not None and walk.salt == node.salt
                    walk = walk.parent
                for end in range(PAGE, len(path) + 1, PAGE):
                    held[node.salt].add(tuple(path[:end]))
        expect = max(
            (e for e in range(PAGE, len(key) + 1, PAGE) if tuple(key[:e]) in held[salt]),
            default=0,
        )
        assert tree.match_prefix(key, touch=False, salt=salt).device_len == expect
        if tree.allocator.free_pages * PAGE >= len(key):
            insert(tree, key, salt)
            for end in range(PAGE, len(key) + 1, PAGE):
                held[salt].add(tuple(key[:end]))
        total = tree.allocator.free_tokens + tree.cached_tokens
        assert total == tree.allocator.capacity


def _reference_keys(prior: bytes, tokens: list[int]) -> list[str]:
    keys = []
    for start in range(0, len(tokens) - PAGE + 1, PAGE):
        page = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + PAGE])
        prior = hashlib.sha256(prior + page).digest()
        keys.append(prior.hex())
    return keys


def test_l3_keys_of_unsalted_prompts_are_unchanged() -> None:
    tokens = list(range(500, 513))
    assert chain_start(NAMESPACE, "") is None
    assert page_keys(NAMESPACE, tokens, PAGE) == _reference_keys(bytes.fromhex(NAMESPACE), tokens)


def test_l3_keys_of_salted_prompts_start_from_the_salt() -> None:
    tokens = list(range(500, 513))
    salt = salt_digest("tenant")
    start = chain_start(NAMESPACE, salt)
    seed = bytes.fromhex(NAMESPACE) + b"cache-salt" + bytes.fromhex(salt)
    assert start == hashlib.sha256(seed).hexdigest()
    salted = page_keys(NAMESPACE, tokens, PAGE, start)
    assert salted == _reference_keys(bytes.fromhex(start), tokens)
    other = page_keys(NAMESPACE, tokens, PAGE, chain_start(NAMESPACE, salt_digest("other")))
    plain = page_keys(NAMESPACE, tokens, PAGE)
    assert not set(salted) & set(other) and not set(salted) & set(plain)
    assert len(set(salted + other + plain)) == 9
