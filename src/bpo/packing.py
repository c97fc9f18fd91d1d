"""Prefix-shared training inputs: a batch of trees as a *token forest* (DESIGN section 5).

Every token of every tree appears once. Each token has a predecessor (the token before it in
the context it was part of) so that the tokens form a forest; a token attends to exactly its
ancestors in that forest, and its position id is its depth. Siblings therefore share their
prefix's computation, and the log-probs equal those of the independent computation (every
root-to-leaf path read as its own sequence) up to float error.

The mask is an *additive float* mask (0 where visible, dtype-min elsewhere): transformers
passes a custom 4D mask through for Qwen2 and Llama, and a boolean 4D mask is silently wrong
under eager attention (MACHINE.md). The dense ``[L, L]`` mask costs O(L^2), which is why
:func:`choose_layout` weighs the tokens the forest saves against its wider rows and falls back
to independent (padded) rows when the trees share little. A batch whose rows are all plain
sequences (the paths layout) gets no mask at all: the model's own causal attention is exact
for right-padded rows, and skips building and reading the dense mask.

The layout is planned on the host (NumPy); the tensors are then made on the requested
``device`` (the model's: the learner passes it), one copy each.

Written by hand because no library packs tree-structured sequences for training: TRL, verl and
OpenRLHF pack *independent* sequences (block-diagonal masks), not shared prefixes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from bpo.tree import Tree

__all__ = [
    "ActionTokens",
    "Packed",
    "attention_pair_cost",
    "choose_layout",
    "chunk_rows",
    "layout_costs",
    "pack_forest",
    "pack_paths",
]


@dataclass(frozen=True)
class ActionTokens:
    """Where each action token of each edge sits in a packed batch."""

    row: np.ndarray  # [A] int64: row of the packed batch
    pred: np.ndarray  # [A] int64: index of the token whose logits predict it
    token: np.ndarray  # [A] int64: the token id
    edge: np.ndarray  # [A] int64: global edge index (see Packed.edges)


@dataclass(frozen=True)
class Packed:
    """Model inputs for a batch of trees, plus the map back to their action tokens."""

    input_ids: torch.Tensor  # [R, L] int64
    position_ids: torch.Tensor  # [R, L] int64
    attention_mask: torch.Tensor | None
    """[R, 1, L, L] float additive (0 visible, min hidden); None when every row is one causal
    sequence, right-padded (the model's causal mask is then exact)."""
    actions: ActionTokens
    edges: list[tuple[int, int]]  # global edge index -> (tree index, node index)
    computed_tokens: int
    """Tokens the model computes, padding excluded (each row up to its last scored token: the
    forest's unique tokens, or the paths' sum)."""
    row_lengths: np.ndarray
    """[R] int64: each row's tokens before its padding. Rows come longest first, so that
    :func:`bpo.logprobs.row_chunks` can cut them into chunks each padded only to its own
    longest row."""

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])


def _tree_tokens(tree: Tree) -> tuple[list[int], list[int], list[tuple[int, int, int]]]:
    """The token forest of one tree: ids, predecessor (-1 = root of a context) and, for each
    action token, (position, edge node, offset)."""
    ids: list[int] = []
    prev: list[int] = []
    acts: list[tuple[int, int, int]] = []
    last: dict[int, int] = {}  # node -> index of the last token of its context (-1: none)

    def push(tok: int, p: int) -> int:
        ids.append(int(tok))
        prev.append(p)
        return len(ids) - 1

    stack = [0]
    while stack:
        i = stack.pop()
        node = tree.nodes[i]
        p = -1 if i == 0 else last[node.parent]
        if node.turn is not None:
            for j, tok in enumerate(node.turn.action_ids):
                p = push(tok, p)
                acts.append((p, i, j))
        if node.context_reset:
            p = -1
        for tok in node.obs_ids:
            p = push(tok, p)
        last[i] = p
        stack.extend(reversed(node.children))
    return ids, prev, acts


def _ancestor_mask(prev: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Boolean [L, L] ancestor-or-self matrix and depths (position ids) for a token forest
    whose predecessors come before their successors."""
    n = len(prev)
    vis = np.zeros((n, n), dtype=bool)
    depth = np.zeros(n, dtype=np.int64)
    for t, p in enumerate(prev):
        if p >= 0:
            vis[t, : p + 1] = vis[p, : p + 1]
            depth[t] = depth[p] + 1
        vis[t, t] = True
    return vis, depth


def _is_chain(prev: Sequence[int]) -> bool:
    """True when each token's predecessor is the token before it (one causal sequence)."""
    return all(p == t - 1 for t, p in enumerate(prev))


_Row = tuple[list[int], list[int], list[tuple[int, int, int, int]]]
"""A packed row before padding: token ids, each token's predecessor (-1: none), and each scored
token's (position, edge, predictor position, token id)."""


def _finish_rows(rows: list[_Row]) -> list[_Row]:
    """Rows as they are packed: each ends at its last scored token (what follows, such as a
    leaf's final observation, predicts nothing the loss reads), longest first (stable; see
    :attr:`Packed.row_lengths`)."""
    cut = [
        (ids[: end + 1], prev[: end + 1], acts)
        for ids, prev, acts in rows
        for end in [max((pos for pos, _, _, _ in acts), default=len(ids) - 1)]
    ]
    return sorted(cut, key=lambda row: -len(row[0]))


def chunk_rows(lengths: Sequence[int], max_tokens: int) -> list[slice]:
    """Consecutive row ranges whose padded size (rows x the range's longest row) stays within
    ``max_tokens``, at least one row each: the row chunks the learner forwards as batches."""
    chunks: list[slice] = []
    start = width = 0  # the open chunk's first row and longest row so far
    for r, n in enumerate(lengths):
        if r > start and (r - start + 1) * max(width, int(n)) > max_tokens:
            chunks.append(slice(start, r))
            start, width = r, 0
        width = max(width, int(n))
    if len(lengths):
        chunks.append(slice(start, len(lengths)))
    return chunks


def _to_packed(
    rows: list[_Row],
    edges: list[tuple[int, int]],
    pad_id: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> Packed:
    rows = _finish_rows(rows)
    width = max(len(ids) for ids, _, _ in rows)
    r = len(rows)
    causal = all(_is_chain(prev) for _, prev, _ in rows)
    input_ids = np.full((r, width), pad_id, dtype=np.int64)
    # causal rows: padding continues the positions, so that transformers does not read a
    # restart at 0 as the start of another packed sequence and build a mask after all
    position_ids = np.tile(np.arange(width, dtype=np.int64), (r, 1)) if causal else None
    if position_ids is None:
        position_ids = np.zeros((r, width), dtype=np.int64)
    vis = None if causal else np.zeros((r, width, width), dtype=bool)
    a_row, a_pred, a_tok, a_edge = [], [], [], []
    computed = 0
    for k, (ids, prev, acts) in enumerate(rows):
        n = len(ids)
        computed += n
        input_ids[k, :n] = ids
        if vis is not None:
            m, d = _ancestor_mask(prev)
            position_ids[k, :n] = d
            vis[k, :n, :n] = m
            vis[k, n:, n:] = np.eye(width - n, dtype=bool)  # padding attends to itself only
        for pos, edge, pred, tok in acts:
            a_row.append(k)
            a_pred.append(pred)
            a_tok.append(tok)
            a_edge.append(edge)
            del pos
    mask = None
    if vis is not None:
        mask = torch.zeros((r, 1, width, width), dtype=dtype, device=device)
        hidden = ~torch.as_tensor(vis, device=device)[:, None]  # [R, 1, L, L] bool
        mask.masked_fill_(hidden, torch.finfo(dtype).min)
    actions = ActionTokens(
        np.array(a_row, dtype=np.int64),
        np.array(a_pred, dtype=np.int64),
        np.array(a_tok, dtype=np.int64),
        np.array(a_edge, dtype=np.int64),
    )
    return Packed(
        torch.as_tensor(input_ids, device=device),
        torch.as_tensor(position_ids, device=device),
        mask, actions, edges, computed,
        np.array([len(ids) for ids, _, _ in rows], dtype=np.int64),
    )  # fmt: skip


def pack_forest(
    trees: Sequence[Tree],
    *,
    pad_id: int = 0,
    dtype: torch.dtype = torch.float32,
    max_row_tokens: int | None = None,
    device: torch.device | str = "cpu",
) -> Packed:
    """Each tree's unique tokens once; consecutive trees share a row (block-diagonal) while it
    has room: up to ``max_row_tokens``, and never wider than the largest tree, since every row
    is padded to that width anyway and attention costs the square of a row's width (four
    512-token trees in one 2048-token row took 2.7x as long as four rows; BENCHMARKS.md).
    The tensors are made on ``device``."""
    rows, edges = _forest_rows(trees, max_row_tokens)
    return _to_packed(rows, edges, pad_id, dtype, device)


def _forest_rows(
    trees: Sequence[Tree], max_row_tokens: int | None
) -> tuple[list[_Row], list[tuple[int, int]]]:
    """:func:`pack_forest`'s rows (unpadded) and edges."""
    edges: list[tuple[int, int]] = []
    forests = [_tree_tokens(tree) for tree in trees]
    cap = _row_cap([len(ids) for ids, _, _ in forests], max_row_tokens)
    rows: list[_Row] = []
    for t, (ids, prev, acts) in enumerate(forests):
        node_edge: dict[int, int] = {}
        for _, node, _ in acts:
            if node not in node_edge:
                node_edge[node] = len(edges)
                edges.append((t, node))
        if rows and len(rows[-1][0]) + len(ids) <= cap:
            row_ids, row_prev, row_acts = rows[-1]
        else:
            row_ids, row_prev, row_acts = [], [], []
            rows.append((row_ids, row_prev, row_acts))
        off = len(row_ids)
        row_ids.extend(ids)
        row_prev.extend(p + off if p >= 0 else -1 for p in prev)
        for pos, node, _ in acts:
            pred = row_prev[pos + off]
            if pred < 0:
                raise ValueError(f"tree {t} node {node}: an action token has no context before it")
            row_acts.append((pos + off, node_edge[node], pred, row_ids[pos + off]))
    return rows, edges


def _row_cap(lengths: Sequence[int], max_row_tokens: int | None) -> int:
    """Widest row that trees may share: ``max_row_tokens``, but at most the largest tree."""
    if not max_row_tokens or not lengths:
        return 0
    return min(max_row_tokens, max(lengths))


def pack_paths(
    trees: Sequence[Tree],
    *,
    pad_id: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Packed:
    """The independent layout: one row per leaf (its full root-to-leaf sequence, causal mask).
    Each edge's tokens are scored in the first row (leftmost leaf) whose path contains it.
    A context reset on the path ends the row after the reset node's action (which was sampled
    from the old context) and starts a new row with the new context. This is the reference
    the packed forest must equal, and the faster layout when trees share little. The tensors
    are made on ``device``."""
    rows, edges = _path_rows(trees)
    return _to_packed(rows, edges, pad_id, dtype, device)


def _path_rows(trees: Sequence[Tree]) -> tuple[list[_Row], list[tuple[int, int]]]:
    """:func:`pack_paths`'s rows (unpadded) and edges."""
    edges: list[tuple[int, int]] = []
    rows: list[_Row] = []

    def flush(ids: list[int], acts: list[tuple[int, int, int, int]]) -> None:
        if acts:
            rows.append((ids, list(range(-1, len(ids) - 1)), acts))

    for t, tree in enumerate(trees):
        seen: set[int] = set()
        for leaf in tree.leaves():
            path = []
            j = leaf
            while j != -1:
                path.append(j)
                j = tree.nodes[j].parent
            path.reverse()
            ids: list[int] = []
            acts: list[tuple[int, int, int, int]] = []
            for i in path:
                node = tree.nodes[i]
                if node.turn is not None:
                    if i not in seen:
                        seen.add(i)
                        edges.append((t, i))
                        for tok in node.turn.action_ids:
                            acts.append((len(ids), len(edges) - 1, len(ids) - 1, tok))
                            ids.append(tok)
                    else:
                        ids.extend(node.turn.action_ids)
                if node.context_reset:
                    flush(ids, acts)
                    ids, acts = [], []
                ids.extend(node.obs_ids)
            flush(ids, acts)
    return rows, edges


SDPA_MASK_OVERHEAD = 4.0
"""How much more an attention pair costs (sdpa with a dense additive mask, forward + backward,
CPU) than its multiply-adds suggest, relative to the linear layers: a least-squares fit over
rows of 320-2176 tokens of a tiny model gave 3.0 (BENCHMARKS.md, Learner); rounded up, which
leans towards the padded layout when the estimate is close."""
CAUSAL_PAIR_SHARE = 0.25
"""A mask-free causal row's cost per attended pair relative to a dense-masked row's: an
estimate, not a fit (sdpa's causal kernel skips the blocks above the diagonal, half the pairs,
and reads no mask, whose overhead :data:`SDPA_MASK_OVERHEAD` puts at 4x; 0.125 by that
reckoning, doubled to lean towards the forest). One measurement backs it: 1.5x faster
forward + backward without the mask on 32 x 384 rows of the tiny model (BENCHMARKS.md,
Learner, finding 7)."""
DEFAULT_PAIR_COST = 1e-3
"""Cost of one attended (query, key) pair in units of one token position through the model,
for :func:`choose_layout` when it is given no model: SmolLM2-135M's by
:func:`attention_pair_cost` (a 0.5 M-parameter test model's is 3.9e-3, Qwen2.5-7B's 1.1e-4)."""


def attention_pair_cost(config: object) -> float:
    """One attended (query, key) pair's compute relative to one token position's, for a
    transformers config (Llama / Qwen2 style): per layer, QK^T and AV take 4 * hidden
    multiply-adds a pair, the projections and MLP 2 * their weights a token, the LM head
    2 * hidden * vocab a token; times :data:`SDPA_MASK_OVERHEAD`. ``DEFAULT_PAIR_COST`` when the
    config lacks those fields."""
    try:
        h = int(config.hidden_size)  # type: ignore[attr-defined]
        layers = int(config.num_hidden_layers)  # type: ignore[attr-defined]
        inter = int(config.intermediate_size)  # type: ignore[attr-defined]
        vocab = int(config.vocab_size)  # type: ignore[attr-defined]
        heads = int(config.num_attention_heads)  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return DEFAULT_PAIR_COST
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    per_layer = 2 * h * h + 2 * h * kv * (h // heads) + 3 * h * inter  # q, o; k, v; gated MLP
    token = 2 * (layers * per_layer + h * vocab)
    return SDPA_MASK_OVERHEAD * 4 * layers * h / token


def layout_costs(
    trees: Sequence[Tree], pair_cost: float = DEFAULT_PAIR_COST, max_row_tokens: int | None = None
) -> dict[str, float]:
    """Estimated forward + backward cost of each layout, in token positions, for the rows the
    packers make and the chunks the learner forwards (:func:`chunk_rows` with
    ``max_row_tokens``, 2048 when None): a chunk of r rows padded to width w costs
    r * (w + c * w^2), with c = ``pair_cost`` for the forest's dense-masked rows and
    ``pair_cost * CAUSAL_PAIR_SHARE`` for the paths' mask-free causal rows."""
    budget = max_row_tokens or 2048
    costs = {}
    for name, rows, c in (
        ("forest", _forest_rows(trees, max_row_tokens)[0], pair_cost),
        ("paths", _path_rows(trees)[0], pair_cost * CAUSAL_PAIR_SHARE),
    ):
        lengths = [len(ids) for ids, _, _ in _finish_rows(rows)]
        total = 0.0
        for chunk in chunk_rows(lengths, budget):
            width = lengths[chunk.start]  # rows come longest first
            total += (chunk.stop - chunk.start) * (width + c * width * width)
        costs[name] = total
    return costs


def choose_layout(
    trees: Sequence[Tree], pair_cost: float = DEFAULT_PAIR_COST, max_row_tokens: int | None = None
) -> str:
    """The layout with the lower :func:`layout_costs`: "forest" when shared prefixes save more
    token positions than its wider rows cost in attention, else "paths". Sharing alone (unique
    / total tokens) is not enough: a GRPO group's forest (a 128-token prompt, 8 x 256 tokens)
    holds 0.71 of the paths' tokens but took twice their time on a 0.5 M-parameter model and
    on SmolLM2-135M (BENCHMARKS.md, Learner). Pass ``attention_pair_cost(model.config)`` for the model being trained."""
    costs = layout_costs(trees, pair_cost, max_row_tokens)
    return "forest" if costs["forest"] <= costs["paths"] else "paths"
