"""``bpo view RUN_DIR``: one self-contained HTML page to look at a run's sampled trees.

The page (inline CSS, JS and SVG; no network) draws each tree of ``trees.jsonl`` as a tree, root
at the top: branch nodes coloured by the policy's entropy there, leaves by the return of their
path, sibling advantages written on the edges; hovering a node shows its turn (action and
observation), clicking pins it in a side panel with the path of actions that led there. Beside
it: the run's summary numbers and curves (the PNGs of :mod:`bpo.report`, inlined as data URIs).

All text from the run (observations and actions are arbitrary strings) reaches the page as JSON
inside a ``<script type="application/json">`` block with ``<``, ``>`` and ``&`` escaped, and is
put into the document with ``textContent`` only; the Python side escapes what it writes.
"""

from __future__ import annotations

import base64
import html
import json
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bpo.report import RunData, describe_config, load_run, run_plots, summary_numbers
from bpo.view_page import PAGE

__all__ = ["build_html", "load_trees", "main", "select_trees", "slim_tree", "write_view"]

MAX_TEXT = 6000
"""Characters of an observation or action kept in the page (the rest is cut, and said so)."""


ENTROPY_SPAN = 0.25
"""Narrowest entropy colour scale (nats): branch entropies closer than this look alike."""


def _clip(text: str, limit: int = MAX_TEXT) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... {len(text) - limit} more characters cut by bpo view]"


def _finite(v: Any) -> float | None:
    return float(v) if v is not None and math.isfinite(float(v)) else None


def load_trees(run_dir: str | Path) -> list[dict[str, Any]]:
    """The trees of ``RUN_DIR/trees.jsonl`` (``Tree.to_dict`` + ``iteration``), in order; a line
    cut by a crash is skipped."""
    path = Path(run_dir) / "trees.jsonl"
    trees = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                trees.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return trees


def select_trees(
    trees: Sequence[dict[str, Any]], iteration: int | None = None, max_trees: int | None = None
) -> list[dict[str, Any]]:
    """Trees of one iteration (all when None), at most ``max_trees`` spread evenly over the run
    (first and last kept)."""
    chosen = list(trees)
    if iteration is not None:
        chosen = [t for t in trees if t.get("iteration") == iteration]
        if not chosen:
            have = sorted({t.get("iteration") for t in trees if t.get("iteration") is not None})
            raise ValueError(
                f"no sampled trees for iteration {iteration}; iterations with trees: {have}"
            )
    if max_trees is not None and len(chosen) > max_trees:
        if max_trees < 1:
            raise ValueError(f"--max-trees must be at least 1, got {max_trees}")
        keep = np.unique(np.linspace(0, len(chosen) - 1, max_trees).round().astype(int))
        chosen = [chosen[i] for i in keep]
    return chosen


def slim_tree(tree: dict[str, Any]) -> dict[str, Any]:
    """What the page needs of one ``Tree.to_dict`` (no token ids), with each node's return so
    far (rewards summed from the root; for a leaf, its path's return)."""
    nodes = []
    for d in tree["nodes"]:
        p = int(d["parent"])
        t = d.get("turn")
        reward = float(t["reward"]) if t else 0.0
        node: dict[str, Any] = {
            "parent": p, "step": int(d.get("step", 0)), "entropy": _finite(d.get("entropy")),
            "branch_k": int(d.get("branch_k", 1)), "advantage": _finite(d.get("advantage")),
            "return": (nodes[p]["return"] if p >= 0 else 0.0) + reward,
            "observation": _clip(str(d.get("observation", ""))),
        }  # fmt: skip
        if t:
            logprobs = t.get("logprobs") or []
            node.update(
                action=_clip(str(t.get("action_text", ""))), reward=reward,
                terminated=bool(t.get("terminated")), truncated=bool(t.get("truncated")),
                tokens=len(t.get("action_ids") or []), logprob=_finite(sum(logprobs)),
            )  # fmt: skip
        nodes.append(node)
    return {
        "task": str(tree.get("task", "")),
        "seed": tree.get("seed"),
        "iteration": tree.get("iteration"),
        "nodes": nodes,
    }


def _range(values: Sequence[float], floor: float | None = None, span: float = 1.0) -> list[float]:
    """[low, high] of a colour scale, at least ``span`` wide (so that differences of no
    consequence do not get the whole scale); ``floor`` widens it downwards (returns start at 0:
    a tree of failures is all red)."""
    if not values:
        return [0.0, span]
    lo, hi = min(values), max(values)
    if floor is not None:
        lo = min(lo, floor)
    if hi - lo < span:
        if floor is not None and lo == floor:
            hi = lo + span
        else:
            mid = (lo + hi) / 2
            lo, hi = mid - span / 2, mid + span / 2
    return [lo, hi]


def page_data(trees: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The JSON the page's script reads: slimmed trees and the colour-scale ranges."""
    slim = [slim_tree(t) for t in trees]
    branch_ent, leaf_ret = [], []
    for t in slim:
        kids = [0] * len(t["nodes"])
        for n in t["nodes"]:
            if n["parent"] >= 0:
                kids[n["parent"]] += 1
        for n, k in zip(t["nodes"], kids, strict=True):
            if k >= 2 and n["entropy"] is not None:
                branch_ent.append(n["entropy"])
            if k == 0:
                leaf_ret.append(n["return"])
    return {
        "trees": slim,
        "entropy_range": _range(branch_ent, span=ENTROPY_SPAN),
        "return_range": _range(leaf_ret, floor=0.0),
    }


def _script_json(data: Any) -> str:
    """JSON safe to put inside a <script> element (no '</script>', no '<!--')."""
    text = json.dumps(data, allow_nan=False, ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def _plots_html(run: RunData) -> str:
    if not run.rows and run.summary is None:
        return '<p class="muted">No metrics logged yet.</p>'
    with tempfile.TemporaryDirectory(prefix="bpo-view-") as tmp:
        plots = run_plots(run, tmp)
        return "\n".join(
            f'<figure><img alt="{html.escape(p.title)}" src="{_data_uri(p.path)}"></figure>'
            for p in plots
        )


def build_html(
    run_dir: str | Path,
    *,
    iteration: int | None = None,
    max_trees: int | None = 200,
    plots: bool = True,
) -> str:
    """The page for one run directory, as a string."""
    run = load_run(run_dir)
    trees = select_trees(load_trees(run.path), iteration, max_trees)
    cards = "".join(
        f'<div class="card"><div class="v">{html.escape(v)}</div>'
        f'<div class="k">{html.escape(k)}</div></div>'
        for k, v in summary_numbers(run)
    )
    method = describe_config(run.config).replace("`", "") if run.config else ""
    fill = {
        "{{TITLE}}": html.escape(f"bpo view: {run.path.name}"),
        "{{RUN}}": html.escape(str(run.path)),
        "{{METHOD}}": html.escape(method),
        "{{CARDS}}": cards,
        "{{PLOTS}}": _plots_html(run) if plots else '<p class="muted">Plots left out.</p>',
        "{{DATA}}": _script_json(page_data(trees)),
    }
    page = PAGE
    for key, value in fill.items():
        page = page.replace(key, value)
    return page


def write_view(
    run_dir: str | Path,
    out: str | Path | None = None,
    *,
    iteration: int | None = None,
    max_trees: int | None = 200,
) -> Path:
    """Write the page (default ``RUN_DIR/view.html``) and return its path."""
    path = Path(out) if out else Path(run_dir) / "view.html"
    text = build_html(run_dir, iteration=iteration, max_trees=max_trees)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def main(argv: list[str]) -> int:
    """``bpo view RUN_DIR``: write an HTML page of the run's sampled trees and curves."""
    import argparse

    ap = argparse.ArgumentParser(prog="bpo view", description=main.__doc__)
    ap.add_argument("run_dir", help="a run directory written by `bpo train`")
    ap.add_argument("--out", help="HTML file to write (default: RUN_DIR/view.html)")
    ap.add_argument("--iteration", type=int, help="only the trees sampled at this iteration")
    ap.add_argument(
        "--max-trees", type=int, default=200, help="at most this many trees, spread over the run"
    )
    args = ap.parse_args(argv)
    try:
        path = write_view(
            args.run_dir, args.out, iteration=args.iteration, max_trees=args.max_trees
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"bpo view: {e}")
        return 2
    print(f"view: {path} (open it in a browser; it needs no network)")
    return 0
