"""Phase 1 of a learner update (``bpo.learner``): what every action token of a minibatch
contributes to the loss.

First the advantage and tree weight of every edge: the configured estimator
(``bpo.estimators``), or for PPO, GAE over turns on the value head's V(s) at every acting state.
Then per action token: the edge's advantage, its loss weight normalised for the aggregation
(``bpo.losses``) over the whole minibatch (sums over ranks under data parallelism, so that
micro-batches and ranks can accumulate gradients and every method shares one effective step
size), the sampling log-prob, and PPO's return targets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from bpo import estimators
from bpo.data_parallel import DataParallel
from bpo.logprobs import row_chunks, token_logprobs
from bpo.packing import Packed
from bpo.tree import Tree

__all__ = ["edge_terms", "gae_terms", "token_terms"]


def edge_terms(
    trees: Sequence[Tree], estimator: str, options: dict[str, Any]
) -> list[estimators.EdgeAdvantages]:
    """The advantage and tree weight of every edge, per tree, by the named estimator (GiGPO
    also gets the nodes' state fingerprints)."""
    out = []
    for tree in trees:
        fps = tree.fingerprints() if estimator == "gigpo" else None
        out.append(
            estimators.compute(
                estimator, tree.parents(), tree.rewards(), fingerprints=fps, **options
            )
        )
    return out


def gae_terms(
    model: torch.nn.Module,
    trees: Sequence[Tree],
    packed: Packed,
    *,
    max_row_tokens: int,
    gamma: float,
    lam: float,
) -> tuple[list[estimators.EdgeAdvantages], list[np.ndarray]]:
    """PPO: the value head's V(s) at every acting state (no grad), then GAE over turns.
    Returns (advantage and tree weight per edge, return targets per node) per tree.

    The learner computes it with its ``full_model`` (the weights of the sharded copy at this
    point): a forward through an FSDP model is a collective, and ranks have different numbers
    of chunks."""
    values = [np.zeros(len(t)) for t in trees]
    a = packed.actions
    with torch.no_grad():
        for rows in row_chunks(packed, max_row_tokens):
            hid: list[torch.Tensor] = []
            _, _, sel = token_logprobs(model, packed, rows, hidden=hid)
            v = model.value_head(hid[0]).squeeze(-1).float().cpu().numpy()  # [A]
            for k, s_ in enumerate(sel):
                t, node = packed.edges[a.edge[s_]]
                values[t][trees[t].nodes[node].parent] = v[k]  # same for every token of e
    terms, targets = [], []
    for t, tree in enumerate(trees):
        adv, ret = estimators.gae(tree.parents(), tree.rewards(), values[t], gamma=gamma, lam=lam)
        w = estimators.compute("bpo", tree.parents(), tree.rewards()).weight
        terms.append(estimators.EdgeAdvantages(adv, w))
        targets.append(ret)
    return terms, targets


def token_terms(
    packed: Packed | None,
    trees: Sequence[Tree],
    terms: list[estimators.EdgeAdvantages],
    *,
    aggregation: str,
    device: torch.device,
    dp: DataParallel | None = None,
    targets: list[np.ndarray] | None = None,
    num_trees: int | None = None,
) -> dict[str, torch.Tensor]:
    """Per action token: advantage, loss weight (normalised for the aggregation), old logp;
    with value targets, also the return target and value-loss weight of each edge's first
    token (the token whose predictor position is the acting state). The normalisers are
    those of the whole minibatch (``num_trees`` trees, sums over ranks); ``packed`` is None
    on a rank without trees. ``n_tok`` is the minibatch's action-token count."""
    num_trees = len(trees) if num_trees is None else num_trees
    edge = packed.actions.edge if packed is not None else np.zeros(0, dtype=np.int64)
    adv = np.empty(len(edge))
    w = np.empty(len(edge))
    old = np.empty(len(edge))
    ret = np.zeros(len(edge))
    first = np.zeros(len(edge))
    n_tok = np.zeros(len(packed.edges) if packed is not None else 0)
    np.add.at(n_tok, edge, 1)
    offsets: dict[int, int] = {}
    packed_edges = packed.edges if packed is not None else []
    for k, e in enumerate(edge):
        t, node = packed_edges[e]
        j = offsets.get(e, 0)
        offsets[e] = j + 1
        adv[k] = terms[t].advantage[node]
        w[k] = terms[t].weight[node]
        old[k] = trees[t].nodes[node].turn.logprobs[j]  # type: ignore[union-attr]
        if targets is not None and j == 0:
            ret[k] = targets[t][node]
            first[k] = 1.0
    totals = np.array([w.sum(), first.sum(), len(edge)])  # [3]
    if dp is not None:
        totals = dp.sum(totals)
    if aggregation == "tree":
        w = w / num_trees
    elif aggregation == "token_mean":
        w = w / max(totals[0], 1e-30)
    else:  # sequence_mean
        w = w / n_tok[edge] / num_trees
    f = torch.float32
    return {
        "n_tok": torch.tensor(totals[2], device=device),
        "adv": torch.tensor(adv, dtype=f, device=device),  # [A]
        "w": torch.tensor(w, dtype=f, device=device),  # [A]
        "old": torch.tensor(old, dtype=f, device=device),  # [A]
        "ret": torch.tensor(ret, dtype=f, device=device),  # [A]
        "vw": torch.tensor(first / max(totals[1], 1.0), dtype=f, device=device),  # [A]
    }
