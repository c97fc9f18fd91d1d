"""Teacher-forced log-probs of packed trees: a forward of rows of a :class:`bpo.packing.Packed`
batch gives the log-prob and entropy of every action token in them (in the forest layout each
shared prefix is computed once) and, on request, the hidden state a value head reads.

The learner's update (``bpo.learner``), the supervised warm start (``bpo.agent``) and the learner
benchmark all forward through :func:`token_logprobs`, in row chunks of :func:`row_chunks`.
"""

from __future__ import annotations

import numpy as np
import torch

from bpo.packing import Packed, chunk_rows

__all__ = ["model_device", "row_chunks", "token_logprobs"]


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's (first) parameter: where its inputs must be made."""
    return next(model.parameters()).device


def token_logprobs(
    model: torch.nn.Module,
    packed: Packed,
    rows: slice | None = None,
    temperature: float = 1.0,
    hidden: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Log-probs and entropies of the action tokens in ``rows`` of a packed batch.

    Returns ``(logp [A], entropy [A], index [A])`` where ``index`` selects those tokens in
    ``packed.actions`` (entries of other rows are not computed). When ``hidden`` is a list, the
    last layer's hidden states at each selected token's predictor position are appended to it
    (``[A, H]``: the state a value head reads). Everything is computed on ``model``'s device
    (the packed inputs are moved there when they were made elsewhere).
    """
    dev = model_device(model)
    rows = rows or slice(0, packed.num_rows)
    r0 = rows.start or 0
    a = packed.actions
    sel = np.flatnonzero((a.row >= r0) & (a.row < rows.stop))
    # logits only at the positions that predict an action token (``logits_to_keep``, the same
    # positions for every row of the chunk): the vocabulary projection of every context token
    # would cost [rows, L, V] memory, 400 MB per 2048-token row at a 49k vocabulary
    keep = np.unique(a.pred[sel])
    mask = packed.attention_mask
    width = int(packed.row_lengths[rows].max())  # the chunk's longest row: the rest is padding
    out = model(
        input_ids=packed.input_ids[rows, :width].to(dev),
        position_ids=packed.position_ids[rows, :width].to(dev),
        attention_mask=None if mask is None else mask[rows, :, :width, :width].to(dev),
        use_cache=False,
        output_hidden_states=hidden is not None,
        logits_to_keep=torch.as_tensor(keep, device=dev),
    )
    logits = out.logits  # [r, P, V]
    row = torch.as_tensor(a.row[sel] - r0, device=dev)  # [A]
    col = torch.as_tensor(np.searchsorted(keep, a.pred[sel]), device=dev)  # [A]
    picked = logits[row, col]  # [A, V]
    if hidden is not None:
        pred = torch.as_tensor(a.pred[sel], device=dev)  # [A]
        hidden.append(out.hidden_states[-1][row, pred])  # [A, H]
    logprobs_all = torch.log_softmax(picked.float() / temperature, dim=-1)  # [A, V]
    tok = torch.as_tensor(a.token[sel], device=dev)  # [A]
    logp = logprobs_all.gather(-1, tok[:, None]).squeeze(-1)  # [A]
    entropy = -(logprobs_all.exp() * logprobs_all).sum(-1)  # [A]
    return logp, entropy, sel


def row_chunks(packed: Packed, max_tokens: int) -> list[slice]:
    """Consecutive row ranges whose padded size (rows x the range's longest row) stays within
    ``max_tokens`` (at least one row each; :func:`bpo.packing.chunk_rows`): independent rows
    are forwarded as a batch, padded only to their own longest row (:func:`token_logprobs`
    cuts the columns there). The packers put rows longest first, so neighbours are alike."""
    return chunk_rows(packed.row_lengths, max_tokens)
