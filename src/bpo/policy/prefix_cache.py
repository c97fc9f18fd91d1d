"""A radix tree of token ids holding the KV cache of recently computed sequences.

An agent episode's turn t+1 context is turn t's context + the action + new observation tokens,
and the siblings at a branch node share their whole context. Keeping the KV of computed
sequences in a radix tree (as SGLang's RadixAttention does) lets a new request compute only the
tokens after its longest cached prefix, and stores a prefix shared by many sequences once.

* Each edge holds a run of token ids and their KV, one tensor ``[L, 2, H_kv, len, D]`` (layers,
  key/value, kv heads, tokens, head dim). The KV of token i depends only on tokens 0..i (causal
  attention, absolute positions), so any prefix of a cached sequence is a valid cache.
* A node may also hold the next-token logits after its last token (the distribution for the
  first action token of a context), so that sampling again from a fully cached context needs no
  forward pass at all -- the BPO case: the backbone sampled at s_t, the branch rule then asks
  for K-1 forks from the same context.
* Eviction: least recently used leaves first, until the tokens held fit the budget.

Tensors stay where they were computed (the model's device): slices and concatenations of the
KV and logits it is given; the cache itself makes none.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


class _Node:
    __slots__ = ("children", "kv", "last_used", "logits", "parent", "tokens")

    def __init__(
        self, tokens: np.ndarray, kv: torch.Tensor | None, parent: _Node | None, tick: int
    ) -> None:
        self.tokens = tokens  # [n] int64: the edge label
        self.kv = kv  # [L, 2, H, n, D] or None for the root
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.logits: torch.Tensor | None = None  # [V] next-token logits after the last token
        self.last_used = tick


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a request."""

    length: int
    """Number of leading tokens whose KV is cached."""
    kv: torch.Tensor | None
    """``[L, 2, H, length, D]`` (a fresh tensor), or None when ``length == 0``."""
    logits: torch.Tensor | None
    """Next-token logits after the whole request, when the whole request is cached and they
    were stored; else None."""


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays."""
    k = min(len(a), len(b))
    diff = np.flatnonzero(a[:k] != b[:k])
    return int(diff[0]) if len(diff) else k


class PrefixCache:
    """Token-id radix tree with KV payloads and an LRU token budget."""

    def __init__(self, budget_tokens: int) -> None:
        if budget_tokens < 0:
            raise ValueError(f"budget_tokens must be >= 0, got {budget_tokens}")
        self.budget_tokens = budget_tokens
        self._tick = 0
        self._root = _Node(np.zeros(0, dtype=np.int64), None, None, 0)
        self.size = 0
        """Tokens held."""
        self.evicted = 0
        """Tokens evicted by the budget so far."""

    # ---------------------------------------------------------------- lookup

    def match(self, ids: Sequence[int], with_kv: bool = True) -> PrefixMatch:
        """The longest cached prefix of ``ids`` (marks its nodes as recently used)."""
        arr = np.asarray(ids, dtype=np.int64)
        self._tick += 1
        node, pos, parts = self._root, 0, []
        logits = None
        while pos < len(arr):
            child = node.children.get(int(arr[pos]))
            if child is None:
                break
            m = common_prefix_length(child.tokens, arr[pos:])
            child.last_used = self._tick
            parts.append(child.kv if m == len(child.tokens) else child.kv[:, :, :, :m])
            pos += m
            if m < len(child.tokens):
                break
            node = child
            if pos == len(arr):
                logits = child.logits
        kv = None
        if with_kv and parts:
            kv = parts[0].clone() if len(parts) == 1 else torch.cat(parts, dim=3)
        return PrefixMatch(pos, kv, logits)

    # ---------------------------------------------------------------- insert

    def insert(
        self,
        ids: Sequence[int],
        kv: torch.Tensor,
        logits_at: dict[int, torch.Tensor] | None = None,
    ) -> None:
        """Cache ``ids`` with their KV ``[L, 2, H, len(ids), D]``; ``logits_at[k]`` are the
        next-token logits after ``ids[:k]``. Already cached parts keep their stored KV."""
        arr = np.asarray(ids, dtype=np.int64)
        if kv.shape[3] != len(arr):
            raise ValueError(f"kv covers {kv.shape[3]} tokens but {len(arr)} ids were given")
        self._tick += 1
        node, pos = self._root, 0
        while pos < len(arr):
            child = node.children.get(int(arr[pos]))
            if child is None:
                leaf = _Node(arr[pos:].copy(), kv[:, :, :, pos:].clone(), node, self._tick)
                node.children[int(arr[pos])] = leaf
                self.size += len(arr) - pos
                pos = len(arr)
                break
            m = common_prefix_length(child.tokens, arr[pos:])
            if m < len(child.tokens):
                child = self._split(child, m)
            child.last_used = self._tick
            node, pos = child, pos + m
        for k, logits in (logits_at or {}).items():
            if 0 < k <= len(arr):
                self._boundary(arr[:k]).logits = logits
        self.evict()

    def _split(self, node: _Node, m: int) -> _Node:
        """Split ``node``'s edge after ``m`` tokens; returns the new upper node."""
        assert node.parent is not None and node.kv is not None and 0 < m < len(node.tokens)
        upper = _Node(
            node.tokens[:m].copy(), node.kv[:, :, :, :m].clone(), node.parent, node.last_used
        )
        node.parent.children[int(node.tokens[0])] = upper
        node.tokens = node.tokens[m:].copy()
        node.kv = node.kv[:, :, :, m:].clone()
        node.parent = upper
        upper.children[int(node.tokens[0])] = node
        return upper

    def _boundary(self, arr: np.ndarray) -> _Node:
        """The node ending exactly after ``arr`` (which must be cached), splitting if needed."""
        node, pos = self._root, 0
        while pos < len(arr):
            child = node.children[int(arr[pos])]
            m = common_prefix_length(child.tokens, arr[pos:])
            if m < len(child.tokens):
                child = self._split(child, m)
            node, pos = child, pos + m
        return node

    # ---------------------------------------------------------------- removal

    def evict(self) -> None:
        """Drop least recently used leaves until ``size <= budget_tokens``."""
        if self.size <= self.budget_tokens:
            return
        heap = [(n.last_used, id(n), n) for n in self._nodes() if not n.children]
        heapq.heapify(heap)
        while self.size > self.budget_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            self._remove_leaf(leaf, evicted=True)
            if parent is not None and parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))

    def release(self, prefix: Sequence[int]) -> None:
        """Drop everything cached at or after ``prefix``, and the prefix's own tokens where no
        other cached sequence shares them."""
        arr = np.asarray(prefix, dtype=np.int64)
        node, pos = self._root, 0
        while pos < len(arr):
            child = node.children.get(int(arr[pos]))
            if child is None:
                return
            m = common_prefix_length(child.tokens, arr[pos:])
            if m < len(child.tokens) and pos + m < len(arr):
                return  # the prefix diverges inside this edge: nothing cached extends it
            node, pos = child, pos + m
        if node is self._root:
            return
        self._drop_subtree(node)

    def clear(self) -> None:
        """Drop everything."""
        self._root.children.clear()
        self.size = 0

    def _drop_subtree(self, node: _Node) -> None:
        """Remove ``node`` with its descendants, then ancestors left without children."""
        assert node.parent is not None
        stack, dropped = [node], 0
        while stack:
            n = stack.pop()
            dropped += len(n.tokens)
            stack.extend(n.children.values())
        parent = node.parent
        del parent.children[int(node.tokens[0])]
        node.parent = None
        self.size -= dropped
        while parent is not self._root and not parent.children:
            grand = parent.parent
            self._remove_leaf(parent, evicted=False)
            assert grand is not None
            parent = grand

    def _remove_leaf(self, leaf: _Node, evicted: bool) -> None:
        assert leaf.parent is not None and not leaf.children
        del leaf.parent.children[int(leaf.tokens[0])]
        self.size -= len(leaf.tokens)
        if evicted:
            self.evicted += len(leaf.tokens)
        leaf.parent = None

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def num_nodes(self) -> int:
        return len(self._nodes())
