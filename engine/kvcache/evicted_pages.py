"""The eviction record: which prompt pages this process cached once and dropped.

The tree records the page-chain digest of every page it drops
(``EvictedPages``: bounded, two generations of at most ``max_pages // 2`` digests each,
so it remembers the last ``max_pages // 2`` to ``max_pages`` evicted pages, about 17 MB
at the default). A page's digest chains the digests of all the pages before it, so it
names the whole prefix. A prefix that fell out of the record is reported as
``never_seen``: evicted is under-reported, never over-reported (up to a 64-bit hash
collision).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from engine.kvcache.tree_node import TreeNode

MAX_EVICTED_PAGES = 1 << 18  # digests the eviction record keeps at most
ROOT_DIGEST = 0  # the chain's start: the digest of the empty prefix


def page_digests(prior: int, tokens: Sequence[int], page_size: int) -> Iterator[int]:
    """The chain digest at the end of each whole page of ``tokens``, which continue a
    prefix whose digest is ``prior``.

    NOTE: Python's tuple hash (64 bits, not seeded for ints): the record only ever says
    "seen before", so a collision mislabels a never-seen page as evicted, nothing more.
    """
    for start in range(0, len(tokens) - page_size + 1, page_size):
        prior = hash((prior, *tokens[start : start + page_size]))
        yield prior


def chain_start(salt: str) -> int:
    """The digest of the empty prefix under ``salt`` (a cache_salt digest, "" for none):
    each salt's chains are disjoint, so one tenant's evictions never show in another's
    miss reasons (an `evicted` there would tell that someone sent the prompt)."""
    return hash(("cache_salt", salt)) if salt else ROOT_DIGEST


def end_digest(node: TreeNode, page_size: int, salt: str = "") -> int:
    """The chain digest of the prefix that ends with ``node`` (the root: the start of
    ``salt``'s chains; below it a node's own salt rules); memoised on the nodes (a node's
    end never moves: a split makes a new upper node)."""
    path: list[TreeNode] = []
    while node.parent is not None and node.digest is None:
        path.append(node)
        node = node.parent
    start = node.digest if node.parent is not None else None
    prior = chain_start(path[-1].salt if path else salt) if start is None else start
    for upper in reversed(path):
        for digest in page_digests(prior, upper.key, page_size):
            prior = digest
        upper.digest = prior
    return prior


class EvictedPages:
    """Bounded record of the page-chain digests of pages the tree dropped.

    Two generations: a digest goes into the newer one; when that holds
    ``max_pages // 2``, the older one is forgotten and the newer one takes its place.
    """

    def __init__(self, max_pages: int = MAX_EVICTED_PAGES) -> None:
        self.generation_size = max(max_pages // 2, 1)
        self._new: set[int] = set()
        self._old: set[int] = set()

    def __len__(self) -> int:
        return len(self._new) + len(self._old - self._new)

    def __contains__(self, digest: int) -> bool:
        return digest in self._new or digest in self._old

    def add(self, digest: int) -> None:
        self._new.add(digest)
        if len(self._new) >= self.generation_size:
            self._old, self._new = self._new, set()

    def record(self, node: TreeNode, page_size: int) -> None:
        """``node`` leaves the tree: remember each of its pages (its parent still linked)."""
        assert node.parent is not None
        prior = end_digest(node.parent, page_size, node.salt)
        for digest in page_digests(prior, node.key, page_size):
            self.add(digest)

    def seen_len(self, prior: int, tokens: Sequence[int], page_size: int, skip: int = 0) -> int:
        """How many tokens of ``tokens`` after the first ``skip`` (whole pages, continuing
        a prefix whose digest is ``prior``) were evicted once, as a leading run.

        NOTE: a cached prefix always holds its whole path, so when a page was evicted so
        was every page before it that is not cached now: the recorded pages of a prompt
        are a leading run, and the scan stops at the first page not recorded."""
        if not self._new and not self._old:
            return 0
        seen, position = 0, 0
        for digest in page_digests(prior, tokens, page_size):
            position += page_size
            if position <= skip:
                continue
            if digest not in self:
                break
            seen += page_size
        return seen
