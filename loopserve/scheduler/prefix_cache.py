"""Prefix caching over depth planes: published prompt pages, shared by reference. Torch-free.

A page is one block-sized run of prompt positions `[i * block_size, (i + 1) * block_size)`.
Its KV lives in one block per plane (D under LAST_EXITED, 1 under SHARED); one cache entry
covers all of them. Prompt positions always run every loop, so a page's KV at every plane
depends only on the token ids up to its end: the key is a chained hash of the page's tokens
and its parent's key (`prefix_block_hashes`; the root key names the number of planes). Entries store their tokens
and parent, and a hit compares them, so a hash collision can never serve wrong KV.

Rules:
- a page is published only when all its positions are prompt positions complete at every
  plane (wavefront and per-depth prompts finish depths at different times; the scheduler
  publishes when its prompt frontier passes the page); pages written by decode (exits and
  finalize copies) are never published;
- a request reuses at most `(num_prompt - 1) // block_size` pages: its last prompt position
  always runs through all D loops (the first token's exit needs that row's hazards);
- reference counts: a page referenced by a running request is never written (its positions
  are behind every writer's frontier) and never evicted; unreferenced pages stay cached and
  are evicted least recently used first when the pool runs short;
- a page is `scored` when the runner's score store holds its positions' last-loop outputs
  (every prompt position's, written where the page's plane-0 block lies), so a request
  that asked for prompt logprobs can reuse it and still score its positions. Pages whose
  blocks came from a swap-in or a KV import are not (their outputs were never written
  there); such requests match only up to the first page that is not scored.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

PageKey = tuple[bytes, bytes, tuple[int, ...]]  # (key, parent key, tokens) of one page


def prefix_block_hashes(
    token_ids: Sequence[int], block_size: int, root: bytes = b""
) -> list[bytes]:
    """Chained hashes of the full blocks of `token_ids`: entry i covers blocks 0..i (after
    `root`). The one block hash of the project: the prefix cache keys its pages with it and
    the data-parallel router matches prompts across replicas with it. Stable across processes
    and runs (blake2b over little-endian int64 ids, each block's hash seeded by the previous
    one); a trailing partial block has no entry."""
    hashes: list[bytes] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in block))
        parent = digest.digest()
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class CachedPage:
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    blocks: tuple[int, ...]  # one per plane
    ref_count: int = 0
    scored: bool = True  # the score store holds its positions' last-loop outputs


@dataclass
class PrefixCacheStats:
    num_queried_tokens: int = 0  # prompt tokens looked up at admission
    num_hit_tokens: int = 0  # of them served from the cache
    num_published_pages: int = 0
    num_evicted_pages: int = 0


class PrefixCache:
    def __init__(self, block_size: int, num_planes: int) -> None:
        self.block_size = block_size
        self.num_planes = num_planes
        self.root = f"loopserve-prefix/{num_planes}/{block_size}".encode()
        self.pages: dict[bytes, CachedPage] = {}
        self.page_of_block: dict[int, CachedPage] = {}  # plane-0 block -> page
        self.evictable: OrderedDict[bytes, CachedPage] = OrderedDict()  # LRU first
        self.stats = PrefixCacheStats()

    @property
    def num_evictable_blocks(self) -> int:
        return len(self.evictable) * self.num_planes

    def page_keys(self, token_ids: list[int], salt: bytes = b"") -> list[PageKey]:
        """(key, parent, tokens) of every full page of `token_ids`, in order. `salt` keys
        pages apart that hold the same tokens but different K/V (a request setting that
        changes what its prompt computes)."""
        size = self.block_size
        root = self.root + salt
        hashes = prefix_block_hashes(token_ids, size, root)
        parents = [root, *hashes[:-1]]
        return [
            (key, parent, tuple(token_ids[i * size : (i + 1) * size]))
            for i, (key, parent) in enumerate(zip(hashes, parents))
        ]

    def match(
        self, keys: list[PageKey], max_pages: int, *, scored_only: bool = False
    ) -> list[CachedPage]:
        """The longest run of cached pages at the start of `keys` (not yet referenced);
        with `scored_only`, of scored pages."""
        hits = []
        for key, parent, tokens in keys[:max_pages]:
            page = self.pages.get(key)
            if page is None or page.parent != parent or page.tokens != tokens:
                break
            if scored_only and not page.scored:
                break
            hits.append(page)
        return hits

    def acquire(self, pages: list[CachedPage]) -> None:
        for page in pages:
            page.ref_count += 1
            self.evictable.pop(page.key, None)

    def is_cached(self, block: int) -> bool:
        return block in self.page_of_block

    def release(self, block: int) -> None:
        """Drop one reference to the page whose plane-0 block is `block`."""
        page = self.page_of_block[block]
        assert page.ref_count > 0, f"page {page.key} released more than acquired"
        page.ref_count -= 1
        if page.ref_count == 0:
            self.evictable[page.key] = page  # most recently used last

    def publish(
        self,
        key: bytes,
        parent: bytes,
        tokens: tuple[int, ...],
        blocks: tuple[int, ...],
        *,
        scored: bool = True,
    ) -> bool:
        """Make a request's complete page shareable (it keeps one reference); False when the
        same content is already cached (the request's copy stays private)."""
        if key in self.pages:
            return False
        page = CachedPage(key, parent, tokens, blocks, ref_count=1, scored=scored)
        self.pages[key] = page
        self.page_of_block[blocks[0]] = page
        self.stats.num_published_pages += 1
        return True

    def evict(self, num_blocks: int) -> list[int]:
        """Free at least `num_blocks` blocks from unreferenced pages, least recent first."""
        freed: list[int] = []
        while len(freed) < num_blocks:
            assert self.evictable, "nothing left to evict"
            _, page = self.evictable.popitem(last=False)
            del self.pages[page.key]
            del self.page_of_block[page.blocks[0]]
            freed.extend(page.blocks)
            self.stats.num_evicted_pages += 1
        return freed

    def check_invariants(self, owners: dict[int, int]) -> set[int]:
        """`owners`: block -> number of request tables holding it. Returns cached blocks."""
        cached: set[int] = set()
        for key, page in self.pages.items():
            assert page.key == key and len(page.blocks) == self.num_planes
            assert self.page_of_block[page.blocks[0]] is page
            for block in page.blocks:
                assert owners.get(block, 0) == page.ref_count, (
                    f"page {key}: {page.ref_count} references, block {block} held "
                    f"{owners.get(block, 0)} times"
                )
                assert block not in cached, f"block {block} in two cached pages"
                cached.add(block)
            assert (page.ref_count == 0) == (key in self.evictable), "LRU list out of date"
        assert len(self.page_of_block) == len(self.pages)
        return cached
