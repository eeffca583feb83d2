"""Hybrid radix cache: shared MLA KV pages by prefix, sparse KDA checkpoints on top.

docs/design.md ("Engine invariants") says why the cache has this shape.

MLA KV is append-only, so any cached prefix's pages can be shared. KDA state cannot be sliced at an
arbitrary token, so a prefix is *usable* only up to a KDA checkpoint: a state slot holding the recurrent
and conv state after exactly `end` tokens. Checkpoints sit at chunk boundaries (multiples of
`chunk_size`), sparsely: at most `max_checkpoints_per_path` per root-to-leaf path (LRU, branch points
kept longest), and they are evicted independently of their KV, leaving the node a tombstone.

The "tokens" the tree compares are a request's cache keys (`Request.cache_keys`): its token ids, with the
media pads of a prompt with images replaced by negative keys of the image's content (`rollout.media`), so
prompts with other images part at their first pad.

Terms: a node owns the tokens and KV pages of the edge into it and ends at token position `end`; its
`checkpoint` is a state slot or None. Page ids and slot ids index `rollout.memory` pools; the cache
owns the ids it holds and frees them into the allocators it was given when it evicts.

Request lifecycle (what is safe to call when):
1. `match_prefix(tokens)`: longest usable hit. Then, before anything else is allocated, enqueue the
   copy-on-write restore of `checkpoint_slot` into the request's working slot and `lock(node)`.
   Eviction only recycles slot ids; the restore was enqueued first on the serial stream, so it reads the
   checkpoint before any later write to that slot (stream order is the happens-before).
2. Prefill from `prefix_len`. After each chunk, snapshot the state (at a `chunk_size` boundary) into a
   fresh slot and `insert(...)` the page-aligned prefix with that slot: the tree takes pages and slots it
   lacks (ownership moves, no copy: donate by index). Move the lock to the returned node.
3. At finish or abort: a final `insert`, `unlock`, then free what the result says the request still owns.

Over a unified pool (`rollout.unified_memory`) a free can move blocks and rename their ids: the pool's
owner calls `rename_pages` / `rename_slots`, which rewrite the ids in every node. The tree itself holds ids
only in its nodes, so a rename in the middle of its own evictions is safe; a `MatchResult` is a copy and
is stale after one.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

from rollout.memory import IndexAllocator

_node_order = itertools.count()


@dataclass(eq=False)
class Node:
    key: list[int]  # tokens of the edge into this node; len is a multiple of page_size
    pages: list[int]  # KV page ids for those tokens
    parent: "Node | None"
    end: int  # token position after this node's last token
    checkpoint: int | None = None  # state slot holding the KDA state after `end` tokens
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)
    lock_ref: int = 0  # running requests whose locked node is this one or below
    last_access: int = 0
    # creation order: breaks eviction ties between nodes of equal last_access, so the same request stream
    # evicts the same nodes in every run (a memory address would not)
    order: int = field(default_factory=_node_order.__next__)


class MatchResult(NamedTuple):
    prefix_len: int  # tokens the request skips: the deepest usable checkpoint's position (0 = cold)
    pages: list[int]  # KV pages of [0, prefix_len), tree-owned (hold the lock while using them)
    checkpoint_slot: int | None  # restore source; None means start from zero state
    node: Node  # lock this
    kv_match_len: int  # longest page-aligned KV match, >= prefix_len
    fork_pos: int | None  # chunk-aligned fork beyond prefix_len where a snapshot should be planted


class InsertResult(NamedTuple):
    node: Node  # deepest node of the inserted prefix: move the request's lock here
    pages: list[int]  # the tree's pages for the inserted prefix: the request's page table from now on
    duplicate_pages: list[int]  # request pages the tree already had: still the request's to free
    rejected_slots: list[int]  # donated slots the tree did not take: still the request's (reuse or free)


class HybridRadixCache:
    def __init__(
        self,
        pages: IndexAllocator,
        slots: IndexAllocator,
        *,
        page_size: int,
        chunk_size: int,
        max_checkpoints_per_path: int = 4,
    ):
        if page_size < 1 or chunk_size < 1 or chunk_size % page_size:
            raise ValueError(f"chunk_size ({chunk_size}) must be a positive multiple of page_size ({page_size})")
        if max_checkpoints_per_path < 1:
            raise ValueError(f"max_checkpoints_per_path must be >= 1, got {max_checkpoints_per_path}")
        self.page_alloc, self.slot_alloc = pages, slots
        self.page_size, self.chunk_size = page_size, chunk_size
        self.max_checkpoints_per_path = max_checkpoints_per_path
        self.root = Node(key=[], pages=[], parent=None, end=0)
        self._clock = itertools.count(1)
        # id(node) -> locks taken on exactly that node; locked nodes stay in the tree, so ids stay unique
        self._direct_locks: Counter[int] = Counter()

    # ------------------------------------------------------------------ lookup
    def _child_key(self, tokens: list[int], at: int) -> tuple[int, ...]:
        return tuple(tokens[at : at + self.page_size])

    def _match_len(self, key: list[int], tokens: list[int], at: int, end: int | None = None) -> int:
        """Tokens of `key` matching tokens[at:end], in whole pages. A whole edge is one list comparison first
        (the usual case: a request re-inserting its own path), page by page only where it differs."""
        p = self.page_size
        span = min(len(key), (len(tokens) if end is None else end) - at) // p * p
        if tokens[at : at + span] == (key if span == len(key) else key[:span]):
            return span
        n = 0
        while n + p <= span and key[n : n + p] == tokens[at + n : at + n + p]:
            n += p
        return n

    def match_prefix(self, tokens: list[int], *, leave_last: bool = True) -> MatchResult:
        """Longest prefix of `tokens` that can be skipped. With `leave_last`, a hit never covers the last
        token, which the request must compute to get next-token logits. Touches the path for LRU."""
        limit = len(tokens) - 1 if leave_last else len(tokens)
        now = next(self._clock)
        node, pos = self.root, 0
        path_pages: list[int] = []
        best = (self.root, 0, 0)  # (checkpoint node, its end, pages before it)
        kv_len = 0
        while True:
            node.last_access = now
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            m = self._match_len(child.key, tokens, pos)
            if m == 0:
                break
            path_pages.extend(child.pages[: m // self.page_size])
            kv_len = pos + m
            if m < len(child.key):
                break
            node, pos = child, pos + m
            if node.checkpoint is not None and node.end <= limit:
                best = (node, node.end, len(path_pages))
        hit_node, hit_len, n_pages = best
        fork = (min(kv_len, limit) // self.chunk_size) * self.chunk_size
        diverges = kv_len < len(tokens)
        return MatchResult(
            hit_len,
            path_pages[:n_pages],
            hit_node.checkpoint,
            hit_node,
            kv_len,
            fork if diverges and fork > hit_len else None,
        )

    # ----------------------------------------------------------------- locking
    def lock(self, node: Node) -> None:
        """Protect the KV of `node` and its ancestors from eviction (one count per call)."""
        self._direct_locks[id(node)] += 1
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        assert self._direct_locks[id(node)] > 0, "unlock without lock"
        self._direct_locks[id(node)] -= 1
        if not self._direct_locks[id(node)]:
            del self._direct_locks[id(node)]
        while node is not None:
            node.lock_ref -= 1
            assert node.lock_ref >= 0
            node = node.parent

    # ------------------------------------------------------------------ insert
    def _split(self, node: Node, at: int) -> Node:
        """Split `node`'s edge after `at` tokens; returns the new upper node (ends at parent.end + at)."""
        assert 0 < at < len(node.key) and at % self.page_size == 0
        upper = Node(
            key=node.key[:at],
            pages=node.pages[: at // self.page_size],
            parent=node.parent,
            end=node.end - len(node.key) + at,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        upper.parent.children[tuple(upper.key[: self.page_size])] = upper
        node.key, node.pages = node.key[at:], node.pages[at // self.page_size :]
        node.parent = upper
        upper.children[tuple(node.key[: self.page_size])] = node
        return upper

    def _node_ending_at(self, tokens: list[int], end: int, below: Node | None = None) -> Node:
        """The node on tokens' (already inserted) path that ends exactly at `end`, splitting if needed; the
        walk starts at `below` (a node on the path) when it ends at or before `end`."""
        node = below if below is not None and below.end <= end else self.root
        pos = node.end
        while pos < end:
            node = node.children[self._child_key(tokens, pos)]
            if pos + len(node.key) > end:
                return self._split(node, end - pos)
            pos += len(node.key)
        return node

    def insert(
        self, tokens: list[int], pages: list[int], checkpoints: dict[int, int] | None = None, start: Node | None = None
    ) -> InsertResult:
        """Cache the first len(pages) * page_size tokens with the request's KV pages, and donate
        `checkpoints` {position: slot} (positions: multiples of chunk_size, within the prefix).

        Pages the tree lacked become tree-owned; pages for positions it already had come back as
        duplicates (identical ids are the tree's own, from match_prefix). A donated slot at a position that
        already has a checkpoint comes back rejected. Then the per-path checkpoint cap is enforced along
        this path, freeing the evicted slots into the slot allocator.

        `start`: a node on tokens' path whose prefix the caller already holds as the tree's own, pages
        included (pages[:start.end // page_size] are its path's pages: a running request's locked node after
        its last insert); the walk then begins there instead of matching that prefix again from the root (a
        decode step's inserts re-matched the whole prompt, about 20 nodes a row). The path above `start` is
        touched for LRU all the same."""
        n = len(pages) * self.page_size
        if n > len(tokens):
            raise ValueError(f"{len(pages)} pages cover {n} tokens but only {len(tokens)} were given")
        checkpoints = dict(checkpoints or {})
        for p in checkpoints:
            if p <= 0 or p > n or p % self.chunk_size:
                raise ValueError(
                    f"checkpoint at {p}: must be a positive multiple of chunk_size "
                    f"{self.chunk_size} within the inserted prefix ({n} tokens)"
                )
        now = next(self._clock)
        node, pos, duplicates, canonical = self.root, 0, [], []
        if start is not None and start.end <= n:
            node, pos, canonical = start, start.end, pages[: start.end // self.page_size]
            above = start.parent
            while above is not None:
                above.last_access = now
                above = above.parent
        while pos < n:
            node.last_access = now
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                leaf = Node(
                    key=list(tokens[pos:n]),
                    pages=list(pages[pos // self.page_size :]),
                    parent=node,
                    end=n,
                    last_access=now,
                )
                node.children[tuple(leaf.key[: self.page_size])] = leaf
                canonical.extend(leaf.pages)
                node, pos = leaf, n
                break
            m = self._match_len(child.key, tokens, pos, n)
            if m < len(child.key):
                child = self._split(child, m)
            mine = pages[pos // self.page_size : (pos + m) // self.page_size]
            duplicates.extend(p for p, t in zip(mine, child.pages) if p != t)
            canonical.extend(child.pages)
            node, pos = child, pos + m
        node.last_access = now
        rejected, planted = [], []
        for p in sorted(checkpoints):
            target = self._node_ending_at(tokens, p, start)
            if target.checkpoint is None:
                target.checkpoint = checkpoints[p]
                target.last_access = now
                planted.append(target)
            else:
                rejected.append(checkpoints[p])
        if planted:
            self._enforce_path_cap(planted[0])
        return InsertResult(node, canonical, duplicates, rejected)

    # ---------------------------------------------------------------- eviction
    def _enforce_path_cap(self, top: Node) -> None:
        """Restore "at most max_checkpoints_per_path checkpoints on any root-to-node path" after checkpoints
        were planted at `top` (the shallowest planted node) or below. Victims are the least recently used,
        branch points (2+ children) last: every future branch shares them. Walks top's subtree."""
        chain, node = [], top.parent
        while node is not None:
            if node.checkpoint is not None:
                chain.append(node)
            node = node.parent
        self._cap_walk(top, chain[::-1])

    def _cap_walk(self, node: Node, above: list[Node]) -> None:
        here = [*above, node] if node.checkpoint is not None else above
        excess = len(here) - self.max_checkpoints_per_path
        if excess > 0:
            for victim in sorted(here, key=lambda n: (len(n.children) >= 2, n.last_access))[:excess]:
                self.slot_alloc.free([victim.checkpoint])
                victim.checkpoint = None
            here = [n for n in here if n.checkpoint is not None]
        for child in list(node.children.values()):
            self._cap_walk(child, here)

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def evict_checkpoints(self, num_slots: int) -> int:
        """Free up to `num_slots` checkpoint slots, least recently used first, branch points last; their
        nodes keep their KV (tombstones). Locks do not protect checkpoints (see the module docstring)."""
        cands = [(len(n.children) >= 2, n.last_access, n.order, n) for n in self._nodes() if n.checkpoint is not None]
        freed = 0
        for *_, node in sorted(cands)[:num_slots]:
            self.slot_alloc.free([node.checkpoint])
            node.checkpoint = None
            freed += 1
        return freed

    def evict_pages(self, num_pages: int) -> int:
        """Free at least `num_pages` KV pages if possible by removing unlocked leaves, those without a
        checkpoint first (their KV can serve no hit), then least recently used. Returns pages freed."""

        def entry(n: Node):
            return (n.checkpoint is not None, n.last_access, n.order, n)

        heap = [entry(n) for n in self._nodes() if n is not self.root and not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            *_, leaf = heapq.heappop(heap)
            self.page_alloc.free(leaf.pages)
            freed += len(leaf.pages)
            if leaf.checkpoint is not None:
                self.slot_alloc.free([leaf.checkpoint])
            parent = leaf.parent
            del parent.children[tuple(leaf.key[: self.page_size])]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, entry(parent))
        return freed

    # ----------------------------------------------------------------- renames
    def rename_pages(self, moves: dict[int, int]) -> None:
        """KV pages moved to new ids ({old: new}): every node's edge follows."""
        for node in self._nodes():
            if node.pages:
                node.pages[:] = [moves.get(p, p) for p in node.pages]

    def rename_slots(self, moves: dict[int, int]) -> None:
        """State slots moved to new ids ({old: new}): every checkpoint follows."""
        for node in self._nodes():
            if node.checkpoint is not None:
                node.checkpoint = moves.get(node.checkpoint, node.checkpoint)

    # ------------------------------------------------------------------ checks
    def owned_pages(self) -> set[int]:
        return {p for n in self._nodes() for p in n.pages}

    def owned_slots(self) -> set[int]:
        return {n.checkpoint for n in self._nodes() if n.checkpoint is not None}

    def stats(self) -> dict[str, int]:
        nodes = [n for n in self._nodes() if n is not self.root]
        return {
            "nodes": len(nodes),
            "pages": sum(len(n.pages) for n in nodes),
            "evictable_pages": sum(len(n.pages) for n in nodes if n.lock_ref == 0),
            "checkpoints": sum(n.checkpoint is not None for n in nodes),
            "tombstones": sum(n.checkpoint is None for n in nodes),
        }

    def sanity_check(self, request_pages: set[int] | None = None, request_slots: set[int] | None = None) -> None:
        """Rebuild the accounting from the tree and assert it. With the pages / slots that running requests
        own privately, also assert every id is in exactly one place: the tree, a request, or a free list."""
        tree_pages: list[int] = []
        tree_slots: list[int] = []
        for node in self._nodes():
            if node is not self.root:
                assert node.parent is not None and node.parent.children[tuple(node.key[: self.page_size])] is node
                assert len(node.key) > 0 and len(node.key) % self.page_size == 0
                assert len(node.pages) * self.page_size == len(node.key)
                assert node.end == node.parent.end + len(node.key)
            if node.checkpoint is not None:
                assert node.end % self.chunk_size == 0 and node.end > 0
                tree_slots.append(node.checkpoint)
            tree_pages.extend(node.pages)
            expected = self._direct_locks.get(id(node), 0) + sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref == expected, f"lock_ref {node.lock_ref} != {expected} at end={node.end}"
        assert self._max_checkpoints_on_a_path(self.root, 0) <= self.max_checkpoints_per_path
        assert len(tree_pages) == len(set(tree_pages)), "a KV page is held twice by the tree"
        assert len(tree_slots) == len(set(tree_slots)), "a state slot is held twice by the tree"
        assert not any(self.page_alloc.is_free(p) for p in tree_pages), "tree holds a free page"
        assert not any(self.slot_alloc.is_free(s) for s in tree_slots), "tree holds a free slot"
        if request_pages is not None:
            assert not set(tree_pages) & request_pages, "a page is both tree-owned and request-owned"
            assert len(tree_pages) + len(request_pages) + self.page_alloc.num_free == self.page_alloc.capacity
        if request_slots is not None:
            assert not set(tree_slots) & request_slots, "a slot is both tree-owned and request-owned"
            assert len(tree_slots) + len(request_slots) + self.slot_alloc.num_free == self.slot_alloc.capacity

    def _max_checkpoints_on_a_path(self, node: Node, above: int) -> int:
        here = above + (node.checkpoint is not None)
        return max([here] + [self._max_checkpoints_on_a_path(c, here) for c in node.children.values()])
