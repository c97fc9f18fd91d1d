"""Learner: forward + backward time of the packed token forest vs independent padded rows, for
trees of different shapes (DESIGN section 5).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/learner.py [--quick] [--smollm] [--json P]

Each shape is a batch of ``--trees`` synthetic trees (random token ids; turns of 16 action +
16 observation tokens, a terminal turn of actions only):

* ``p256/b64 K=4``: a 256-token prompt, 4 branches of 64 tokens (long shared prefix);
* ``p64/b256 K=4``: a 64-token prompt, 4 branches of 256 tokens (short prefix, long branches);
* ``nested K=2 d=3``: a 128-token prompt, binary branching at three levels, 64 tokens a level;
* ``group N=8``: a 128-token prompt and 8 independent 256-token episodes (GRPO's group);
* ``mixed``: the first three shapes in turn (trees of unequal sizes, so that rows are shared).

Layouts: ``forest`` = :func:`bpo.packing.pack_forest` as the learner packs it
(``max_row_tokens`` = 2048: trees share a row up to that, never wider than the largest tree;
dense tree mask), ``forest/row`` = one tree per row, ``paths`` = :func:`bpo.packing.pack_paths`
(one causal row per leaf, no mask). Rows end at their last scored token and come longest
first; each row chunk is padded only to its own longest row. Time = forward of
``token_logprobs`` + the clipped loss + backward over the learner's row chunks
(``row_chunks(packed, 2048)``), as ``Learner._step`` runs them minus the optimizer step: the
fastest of ``--repeats`` passes after one warm-up, the layouts interleaved so that load changes
hit them alike (on a shared machine the minimum is the estimate least disturbed by other jobs;
the median is beside it).
``ideal`` = unique / total tokens (forest tokens / path tokens): the time ratio if cost were
linear in tokens. Every layout's log-probs are compared with the paths layout's (max
difference, tolerance 1e-5). ``choose_layout`` is called as the learner calls it (the model's
``attention_pair_cost``, ``max_row_tokens`` 2048), next to its estimated cost ratio and to
what the earlier rule (forest when unique <= 0.75 total tokens) picked.

``--run RUN_DIR`` times batches of a run's own logged trees instead (``trees.jsonl``: run it with
``run.log_trees`` = tasks per iteration; ``--run-trees`` trees per batch, as the learner's
minibatches hold them) with the run's model.

Targets (issue): the layout ``choose_layout`` picks is never slower than padding (paths); on
long shared prefixes the forest's time ratio is within 1.25x of the ideal ratio.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from common import fmt_num, load_average, machine_info, markdown_table, write_json

from bpo.logprobs import row_chunks, token_logprobs
from bpo.losses import policy_loss
from bpo.packing import (
    Packed,
    attention_pair_cost,
    choose_layout,
    layout_costs,
    pack_forest,
    pack_paths,
)
from bpo.tree import Tree, Turn

ACT, OBS = 16, 16
"""Tokens per turn: action, then observation."""
MAX_ROW_TOKENS = 2048
"""The learner's default (``LearnerConfig.max_row_tokens``)."""
TOLERANCE = 1e-5


@dataclass(frozen=True)
class Shape:
    """A tree shape: the prompt, then ``levels`` of branching; each level is (children of every
    node at that level, tokens each child's segment holds)."""

    name: str
    prompt: int
    levels: tuple[tuple[int, int], ...]
    long_prefix: bool
    """Whether the issue's 1.25x-of-ideal target applies (long shared prefixes)."""
    mix: tuple[str, ...] = ()
    """A batch of trees of these other shapes, in turn (trees of unequal sizes)."""


SHAPES = (
    Shape("p256/b64 K=4", 256, ((4, 64),), True),
    Shape("p64/b256 K=4", 64, ((4, 256),), False),
    Shape("nested K=2 d=3", 128, ((2, 64), (2, 64), (2, 64)), True),
    Shape("group N=8", 128, ((8, 256),), False),
    Shape("mixed", 0, (), False, mix=("p256/b64 K=4", "p64/b256 K=4", "nested K=2 d=3")),
)
BY_NAME = {s.name: s for s in SHAPES}


def _segment(
    tree: Tree, parent: int, length: int, terminal: bool, rng: np.random.Generator, vocab: int
) -> int:
    """Append ``length`` tokens below ``parent`` as turns of ACT + OBS tokens (a terminal segment
    ends with a turn of actions only); returns the last node."""
    node, left = parent, length
    while left > 0:
        last = terminal and left <= ACT + OBS  # the final turn: actions only
        n_act = left if last else min(ACT, left)
        n_obs = 0 if last else min(OBS, left - n_act)
        act = rng.integers(3, vocab, n_act).tolist()
        turn = Turn(
            tuple(act), tuple(-rng.random(n_act)), (0.5,) * n_act, "a",
            float(rng.random()), terminated=last,
        )  # fmt: skip
        node = tree.add_child(node, turn, rng.integers(3, vocab, n_obs).tolist())
        left -= n_act + n_obs
    return node


def make_trees(shape: Shape, n: int, rng: np.random.Generator, vocab: int) -> list[Tree]:
    """``n`` trees of ``shape`` (of its ``mix`` shapes in turn)."""
    if shape.mix:
        return [make_tree(BY_NAME[shape.mix[i % len(shape.mix)]], rng, vocab) for i in range(n)]
    return [make_tree(shape, rng, vocab) for _ in range(n)]


def make_tree(shape: Shape, rng: np.random.Generator, vocab: int) -> Tree:
    tree = Tree(shape.name)
    tree.add_root(rng.integers(3, vocab, shape.prompt).tolist())
    frontier = [0]
    for depth, (k, seg) in enumerate(shape.levels):
        terminal = depth == len(shape.levels) - 1
        frontier = [
            _segment(tree, u, seg, terminal, rng, vocab) for u in frontier for _ in range(k)
        ]
    return tree


LAYOUTS: dict[str, Callable[[Sequence[Tree]], Packed]] = {
    "forest": lambda trees: pack_forest(trees, max_row_tokens=MAX_ROW_TOKENS),
    "forest/row": lambda trees: pack_forest(trees),
    "paths": lambda trees: pack_paths(trees),
}


def fwd_bwd(model: torch.nn.Module, packed: Packed, adv: torch.Tensor) -> float:
    """Seconds for the learner's forward + loss + backward over all row chunks."""
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    for rows in row_chunks(packed, MAX_ROW_TOKENS):
        logp, ent, sel = token_logprobs(model, packed, rows)
        idx = torch.from_numpy(sel)
        out = policy_loss(
            logp, logp.detach(), adv[idx], torch.ones_like(logp), torch.full_like(logp, 1e-3),
            entropy=ent, aggregation="tree", num_trees=1,
        )  # fmt: skip
        out.loss.backward()
    return time.perf_counter() - t0


def edge_logprobs(model: torch.nn.Module, packed: Packed) -> dict[tuple[int, int], np.ndarray]:
    """Log-probs of every action token, keyed by (tree, node)."""
    out: dict[tuple[int, int], list[float]] = {}
    with torch.no_grad():
        for rows in row_chunks(packed, MAX_ROW_TOKENS):
            logp, _, sel = token_logprobs(model, packed, rows)
            for lp, s in zip(logp.tolist(), sel, strict=True):
                out.setdefault(packed.edges[packed.actions.edge[s]], []).append(lp)
    return {k: np.array(v) for k, v in out.items()}


def measure_shape(
    model: torch.nn.Module, shape: Shape, n_trees: int, repeats: int, seed: int
) -> list[dict[str, Any]]:
    """Every layout on one batch of trees of ``shape``; one row per layout."""
    rng = np.random.default_rng(seed)
    trees = make_trees(shape, n_trees, rng, int(model.config.vocab_size))
    return measure_trees(model, shape.name, trees, repeats, rng, shape.long_prefix)


def run_trees(run_dir: str) -> dict[int, list[Tree]]:
    """A run's logged trees (``trees.jsonl``) by iteration, in iteration order."""
    from bpo.view import load_trees

    by_iter: dict[int, list[Tree]] = {}
    for d in load_trees(run_dir):
        by_iter.setdefault(int(d["iteration"]), []).append(Tree.from_dict(d))
    return dict(sorted(by_iter.items()))


def run_batches(run_dir: str, per_batch: int, batches: int) -> list[tuple[str, list[Tree]]]:
    """Minibatches of a run's logged trees (log them all with ``run.log_trees`` = the tasks per
    iteration): ``per_batch`` trees of one iteration each, as the learner splits an iteration's
    trees into minibatches; the first ``batches`` of them."""
    out = []
    for it, trees in run_trees(run_dir).items():
        for b in range(0, len(trees) - per_batch + 1, per_batch):
            out.append((f"run iter {it} batch {b // per_batch}", trees[b : b + per_batch]))
    return out[:batches]


def measure_trees(
    model: torch.nn.Module,
    label: str,
    trees: Sequence[Tree],
    repeats: int,
    rng: np.random.Generator,
    long_prefix: bool = False,
) -> list[dict[str, Any]]:
    """Every layout on one batch of trees; one row per layout."""
    n_trees = len(trees)
    packs, pack_s = {}, {}
    for name, pack in LAYOUTS.items():
        laps = []
        for _ in range(3):
            t0 = time.perf_counter()
            packs[name] = pack(trees)
            laps.append(time.perf_counter() - t0)
        pack_s[name] = statistics.median(laps)
    n_act = len(packs["paths"].actions.token)
    adv = torch.from_numpy(rng.standard_normal(n_act).astype(np.float32))
    ref = edge_logprobs(model, packs["paths"])
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for rep in range(repeats + 1):  # round 0 warms up
        for name in LAYOUTS if rep % 2 else reversed(list(LAYOUTS)):
            dt = fwd_bwd(model, packs[name], adv[: len(packs[name].actions.token)])
            if rep:
                times[name].append(dt)
    costs = layout_costs(trees, attention_pair_cost(model.config), MAX_ROW_TOKENS)
    chosen = choose_layout(trees, attention_pair_cost(model.config), MAX_ROW_TOKENS)
    t_paths = min(times["paths"])
    unique = packs["forest"].computed_tokens
    total = packs["paths"].computed_tokens
    rows = []
    for name, packed in packs.items():
        got = edge_logprobs(model, packed) if name != "paths" else ref
        diff = max(float(np.abs(got[k] - ref[k]).max()) for k in ref)
        assert got.keys() == ref.keys()
        t = min(times[name])
        rows.append(
            {
                "shape": label,
                "layout": name,
                "trees": n_trees,
                "rows": packed.num_rows,
                "width": int(packed.input_ids.shape[1]),
                "computed_tokens": packed.computed_tokens,
                "padded_positions": packed.num_rows * int(packed.input_ids.shape[1]),
                "unique_tokens": unique,
                "total_tokens": total,
                "ideal_ratio": unique / total,
                "seconds": t,
                "seconds_median": statistics.median(times[name]),
                "seconds_all": times[name],
                "ratio_to_paths": t / t_paths,
                "pack_seconds": pack_s[name],
                "max_logprob_diff": diff,
                "logprobs_equal": diff <= TOLERANCE,
                "chosen_by_choose_layout": name == chosen,
                "choose_layout": chosen,
                "estimated_forest_over_paths": costs["forest"] / costs["paths"],
                "token_ratio_rule": "forest" if unique <= 0.75 * total else "paths",
                "long_prefix": long_prefix,
            }
        )
    return rows


def load_model(smollm: bool, workdir: str) -> tuple[str, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    from bpo.policy.models import fetch_model, init_model

    if smollm:
        path, label = fetch_model("smollm2-135m"), "SmolLM2-135M"
    else:
        path = init_model(os.path.join(workdir, "tiny"), hidden=128, layers=2, seed=0)
        label = "tiny qwen2 (h128, 2 layers)"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    return label, model.train()


def load_run_model(run_dir: str) -> tuple[str, torch.nn.Module]:
    """A run's model as it starts: ``RUN_DIR/init-model`` for ``policy.model=tiny``, else the
    configured model path (timing needs the shapes, not the trained weights)."""
    from transformers import AutoModelForCausalLM

    from bpo.config import load_config

    model_cfg = load_config(os.path.join(run_dir, "config.yaml"), []).policy.model
    path = os.path.join(run_dir, "init-model") if model_cfg == "tiny" else model_cfg
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    return f"{model_cfg} model of {os.path.basename(os.path.normpath(run_dir))}", model.train()


def time_updates(
    run_dir: str,
    label: str,
    model: torch.nn.Module,
    repeats: int,
    overrides: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Seconds of ``Learner.update`` on each logged iteration's trees, as the run's trainer
    calls it (its learner config and estimator, a KL reference when ``kl_coef`` > 0), after
    the dotted config ``overrides`` (``learner.epochs=1``: another learner config on the same
    trees); the model is reset to the same weights before every pass."""
    import copy

    from bpo.config import load_config
    from bpo.learner import Learner

    cfg = load_config(os.path.join(run_dir, "config.yaml"), list(overrides))
    start = copy.deepcopy(model.state_dict())
    ref = copy.deepcopy(model).eval().requires_grad_(False) if cfg.learner.kl_coef > 0 else None
    out = []
    for it, trees in run_trees(run_dir).items():
        times = []
        for _ in range(repeats):
            model.load_state_dict(start)
            learner = Learner(model, cfg.learner, ref_model=ref)
            t0 = time.perf_counter()
            learner.update(trees, cfg.estimator.name, **cfg.estimator.options)
            times.append(time.perf_counter() - t0)
        out.append({"model": label, "iteration": it, "trees": len(trees),
                    "seconds": min(times), "seconds_median": statistics.median(times)})  # fmt: skip
    return out


def verdicts(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and shape: what choose_layout picks, whether that is ever slower than paths,
    and the forest's ratio against the ideal."""
    out = []
    for key in dict.fromkeys((r["model"], r["shape"]) for r in rows):
        group = {r["layout"]: r for r in rows if (r["model"], r["shape"]) == key}
        chosen = group[group["paths"]["choose_layout"]]
        best = min(group.values(), key=lambda r: r["seconds"])
        forest = group["forest"]
        out.append(
            {
                "model": key[0],
                "shape": key[1],
                "ideal": forest["ideal_ratio"],
                "forest_ratio": forest["ratio_to_paths"],
                "forest_vs_ideal": forest["ratio_to_paths"] / forest["ideal_ratio"],
                "forest_row_ratio": group["forest/row"]["ratio_to_paths"],
                "estimated_forest_ratio": forest["estimated_forest_over_paths"],
                "token_ratio_rule": forest["token_ratio_rule"],
                "chosen": chosen["layout"],
                "chosen_slower_than_paths": chosen["seconds"] > group["paths"]["seconds"],
                "fastest": best["layout"],
                "long_prefix": forest["long_prefix"],
                "logprobs_equal": all(r["logprobs_equal"] for r in group.values()),
                "max_logprob_diff": max(r["max_logprob_diff"] for r in group.values()),
            }
        )
    return out


HEADERS = ["model", "shape", "layout", "rows x width", "tokens computed", "fwd+bwd s (min)",
           "median s", "time / paths", "pack ms", "max |dlogp|"]  # fmt: skip
SUMMARY_HEADERS = ["model", "shape", "ideal (unique/total)", "forest / paths", "forest / ideal",
                   "forest/row / paths", "estimated forest / paths", "choose_layout",
                   "old rule (tokens <= 0.75)", "fastest", "chosen slower than paths?",
                   "log-probs equal (1e-5)"]  # fmt: skip


def tables(rows: Sequence[dict[str, Any]]) -> str:
    detail = markdown_table(
        HEADERS,
        [
            [
                r["model"],
                r["shape"],
                r["layout"],
                f"{r['rows']} x {r['width']}",
                r["computed_tokens"],
                fmt_num(r["seconds"]),
                fmt_num(r["seconds_median"]),
                f"{r['ratio_to_paths']:.2f}",
                fmt_num(1e3 * r["pack_seconds"]),
                f"{r['max_logprob_diff']:.1e}",
            ]
            for r in rows
        ],
        right=range(3, 10),
    )
    summary = markdown_table(
        SUMMARY_HEADERS,
        [
            [
                v["model"],
                v["shape"],
                f"{v['ideal']:.2f}",
                f"{v['forest_ratio']:.2f}",
                f"{v['forest_vs_ideal']:.2f}" + (" (target <= 1.25)" if v["long_prefix"] else ""),
                f"{v['forest_row_ratio']:.2f}",
                f"{v['estimated_forest_ratio']:.2f}",
                v["chosen"],
                v["token_ratio_rule"],
                v["fastest"],
                "**yes**" if v["chosen_slower_than_paths"] else "no",
                "yes" if v["logprobs_equal"] else f"**no** ({v['max_logprob_diff']:.1e})",
            ]
            for v in verdicts(rows)
        ],
        right=range(2, 7),
    )
    return detail + "\n\n" + summary


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 trees per shape, 1 repeat")
    p.add_argument("--smollm", action="store_true", help="also time SmolLM2-135M")
    p.add_argument("--no-tiny", action="store_true", help="skip the tiny model (with --smollm)")
    p.add_argument("--trees", type=int, default=4, help="trees per batch")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--smollm-trees", type=int, default=1)
    p.add_argument("--smollm-repeats", type=int, default=2)
    p.add_argument("--shapes", nargs="*", help="only these shape names")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--run", help="time batches of this run's logged trees (its own model config)")
    p.add_argument("--run-trees", type=int, default=4, help="trees per batch of --run")
    p.add_argument("--run-batches", type=int, default=4, help="batches of --run to time")
    p.add_argument("--run-updates", action="store_true",
                   help="with --run: time the learner's whole update() per logged iteration, with "
                   "the run's learner config (KL reference included)")  # fmt: skip
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="with --run-updates: config overrides, e.g. learner.epochs=1")  # fmt: skip
    a = p.parse_args(argv)
    if a.quick:
        a.trees, a.repeats, a.smollm_trees, a.smollm_repeats = 3, 1, 1, 1
    torch.manual_seed(a.seed)
    if a.threads:
        torch.set_num_threads(a.threads)
    shapes = [s for s in SHAPES if not a.shapes or s.name in a.shapes]
    load_before = load_average()
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as workdir:
        if a.run and a.run_updates:
            label, model = load_run_model(a.run)
            rows = time_updates(a.run, label, model, a.repeats, a.set)
            for r in rows:
                print(f"{r['iteration']}: trees {r['trees']}, min {r['seconds']:.2f} s, "
                      f"median {r['seconds_median']:.2f} s")  # fmt: skip
            if a.json:
                write_json(a.json, "learner_updates", rows, settings=vars(a))
            return 0
        if a.run:
            label, model = load_run_model(a.run)
            for name, trees in run_batches(a.run, a.run_trees, a.run_batches):
                print(f"  {label} / {name} ...", file=sys.stderr, flush=True)
                rng = np.random.default_rng(a.seed)
                for row in measure_trees(model, name, trees, a.repeats, rng):
                    rows.append({"model": label, **row})
        synthetic = [] if a.run else [False, True] if a.smollm else [False]  # SmolLM2 or not
        for smollm in synthetic:
            if a.no_tiny and not smollm:
                continue
            label, model = load_model(smollm, workdir)
            n, reps = (a.smollm_trees, a.smollm_repeats) if smollm else (a.trees, a.repeats)
            for shape in shapes:
                print(f"  {label} / {shape.name} ...", file=sys.stderr, flush=True)
                for row in measure_shape(model, shape, n, reps, a.seed):
                    rows.append({"model": label, **row})
            del model
    wall = time.perf_counter() - started
    load_after = load_average()
    print(tables(rows))
    print(
        f"\n{a.trees} trees per batch; times: the fastest of {a.repeats} timed passes after a "
        f"warm-up, median beside it (SmolLM2: {a.smollm_trees} tree(s), {a.smollm_repeats} "
        f"passes). wall {wall:.0f} s; "
        f"load average {load_before} before, {load_after} after."
    )
    m = machine_info()
    print(f"machine: {m['cores']} x {m['machine']} ({m['cpu']}), {m['os']}, {m['date_utc']} UTC, "
          f"torch {m.get('torch')} with {m.get('torch_threads')} threads")  # fmt: skip
    if a.json:
        write_json(a.json, "learner", rows, verdicts=verdicts(rows), settings=vars(a),
                   wall_s=wall, load_before=load_before, load_after=load_after)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
