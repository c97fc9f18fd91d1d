"""Rollout: the real RolloutEngine with HFPolicy on real sandboxes; BPO trees vs independent
groups at a matched budget (DESIGN sections 3 and 7).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/rollout.py [--quick] [--smollm] [--json P]

Models: a tiny random-init Qwen2 with a byte-level tokenizer (``init_model``; hidden 128,
2 layers), and SmolLM2-135M-Instruct with ``--smollm`` (``fetch_model("smollm2-135m")``).
Environments: the toy key-and-door game (native snapshots) and TextWorld-Express coin with
3 locations (replay snapshots inside one JVM per sandbox).

Methods, all at one per-task budget of generated tokens (``Budget("tokens", N * H * T)``,
expected mode; N = group size, H = ``--max-steps``, T = ``--new-tokens``):

* ``bpo/every`` and ``bpo/entropy_quantile``: root_width 2, K = 4, causal rule;
* ``group``: rule ``none``, root_width N (the GRPO/RLOO group).

Each engine runs one warm-up iteration (the cost model and the entropy quantile learn from it;
not measured), then ``--iterations`` measured ones. The prefix cache is cleared before every
iteration (in training the weights change between iterations, which drops it anyway).

Reported per method:

* **efficiency** = tokens the policy computed / unique tokens in the trees (target <= 1.05).
  Computed = the samples' ``prefill_tokens`` + generated tokens (the engine's ``Compute``
  totals; this counts each non-final action's last token twice: once generated, once
  prefilled with the next observation). Unique = distinct token prefixes over the iteration's
  trees (a token trie): each tree's tokens once, and what trees share (the system prompt)
  once. ``eff. per tree`` divides by the per-tree count instead (every node's tokens, each
  tree on its own), which sharing across trees pushes below 1. ``model eff.`` is from
  ``policy.stats()``: (prefill + decode) / unique, the positions the model really ran;
  ``padding`` = padded positions / (prefill + decode), real compute on no token;
  ``no-cache eff.`` = (every context token + generated) / unique, what a policy without
  prefix reuse would compute;
* **gen tok/s** (generated tokens / rollout wall time) and **steps/s** (sandbox steps / wall);
* **snapshot %** = time in snapshot() + restore() / rollout wall time (target <= 5%);
* **live after** = the most snapshots any tree left alive when it finished (must be 0).

A random tiny model writes no valid commands: its episodes run to ``--max-steps`` on
"Nothing happens." observations; this measures the machinery, not the agent.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import inspect
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from common import fmt_num, load_average, machine_info, markdown_table, write_json

from bpo.branching import make_rule
from bpo.policy.hf import HFPolicy
from bpo.policy.models import fetch_model, init_model
from bpo.policy.parsing import parse_action
from bpo.policy.prompts import PromptBuilder
from bpo.policy.protocol import SamplingParams
from bpo.rollout import Budget, RolloutConfig, RolloutEngine
from bpo.rollout.budget import Compute
from bpo.sandbox import Sandbox, list_tasks, make_env
from bpo.tree import Tree

TWX_PARAMS = {"numLocations": 3}


@dataclass(frozen=True)
class Method:
    """A tree shape: branch rule, its K, and the root's width."""

    name: str
    rule: str
    k: int
    root_width: int

    def make_rule(self) -> Any:
        return make_rule(self.rule) if self.rule == "none" else make_rule(self.rule, k=self.k)


@dataclass(frozen=True)
class EnvCase:
    """An environment: how to build its sandboxes and which tasks to grow trees on."""

    name: str
    factory: Callable[[], Sandbox]
    tasks: Callable[[int], list[str]]
    concurrency: int


ENVS: dict[str, EnvCase] = {
    "toy": EnvCase(
        "toy (native)",
        lambda: make_env("toy", max_steps=200),
        lambda n: list_tasks("toy", "train")[:n],
        concurrency=8,
    ),
    "twx": EnvCase(
        "twx coin (replay)",
        lambda: make_env("twx", games=["coin"], params=TWX_PARAMS),
        lambda n: list_tasks("twx", "train", games=["coin"], params=TWX_PARAMS)[:n],
        concurrency=4,  # one JVM (about 0.5 GB) per sandbox
    ),
}


def unique_tokens(tree: Tree) -> int:
    """Tokens of the tree, each once: every node's observation tokens and action tokens."""
    return sum(len(n.obs_ids) + (len(n.turn.action_ids) if n.turn else 0) for n in tree.nodes)


def distinct_tokens(trees: Sequence[Tree]) -> int:
    """Distinct token prefixes over all trees of a batch: the fewest token positions any policy
    must compute to act in every state of these trees, sharing prefixes within and across trees
    (the system prompt, say). Built as a token trie that follows each tree's structure."""
    root: dict[int, dict] = {}
    count = 0

    def walk(node: dict[int, dict], ids: Sequence[int]) -> dict[int, dict]:
        nonlocal count
        for tok in ids:
            nxt = node.get(tok)
            if nxt is None:
                nxt = node[tok] = {}
                count += 1
            node = nxt
        return node

    for tree in trees:
        at: list[dict[int, dict]] = []
        for node in tree.nodes:  # parents come before their children
            if node.turn is None:
                at.append(walk(root, node.obs_ids))
                continue
            ptr = walk(at[node.parent], node.turn.action_ids)
            at.append(walk(root if node.context_reset else ptr, node.obs_ids))
    return count


def cache_budget(a: argparse.Namespace) -> int:
    """The prefix-cache budget in tokens: ``--cache-tokens`` or HFPolicy's default."""
    default = inspect.signature(HFPolicy).parameters["cache_budget_tokens"].default
    return a.cache_tokens if a.cache_tokens is not None else int(default)


def load_model(smollm: bool, workdir: str, cache_tokens: int | None) -> tuple[str, HFPolicy]:
    """The policy, and a label for the model."""
    if smollm:
        path = fetch_model("smollm2-135m")
        label = "SmolLM2-135M"
    else:
        path = init_model(os.path.join(workdir, "tiny"), hidden=128, layers=2, seed=0)
        label = "tiny qwen2 (h128, 2 layers, byte vocab)"
    options = {} if cache_tokens is None else {"cache_budget_tokens": cache_tokens}
    return label, HFPolicy(path, seed=0, **options)


def measure(
    policy: HFPolicy, env: EnvCase, method: Method, a: argparse.Namespace
) -> dict[str, Any]:
    """One warm-up iteration, then ``a.iterations`` measured ones, summed."""
    group = a.group
    budget = Budget("tokens", group * a.max_steps * a.new_tokens)
    prompter = PromptBuilder(policy.tokenizer, max_context_tokens=a.max_context)
    engine = RolloutEngine(
        policy,
        prompter,
        lambda raw, adm: parse_action(raw, adm).text,
        method.make_rule(),
        env.factory,
        RolloutConfig(
            root_width=method.root_width,
            max_steps=a.max_steps,
            budget=budget,
            concurrency=min(env.concurrency, a.tasks),
        ),
        SamplingParams(max_new_tokens=a.new_tokens, temperature=1.0),
    )
    tasks = [(t, i) for i, t in enumerate(env.tasks(a.tasks))]
    total = Compute()
    trees: list[Tree] = []
    distinct = 0
    wall = 0.0
    used = dict.fromkeys(STAT_KEYS, 0)
    try:
        for it in range(1 + a.iterations):
            policy.clear_cache()
            s0 = policy.stats()
            t0 = time.perf_counter()
            got = engine.run([(t, s + 1000 * it) for t, s in tasks])
            dt = time.perf_counter() - t0
            if it == 0:
                continue  # warm-up
            s1 = policy.stats()
            wall += dt
            trees += got
            distinct += distinct_tokens(got)
            for tree in got:
                total.add(tree.meta["compute"])
            for k in STAT_KEYS:
                used[k] += getattr(s1, k) - getattr(s0, k)
    finally:
        engine.close()
    return _row(env, method, trees, total, wall, used, distinct)


STAT_KEYS = ("prefill_tokens", "decode_tokens", "padded_tokens", "evicted_tokens")
"""Policy counters summed over the measured iterations."""


def _row(
    env: EnvCase,
    method: Method,
    trees: list[Tree],
    c: Compute,
    wall: float,
    d: dict[str, int],
    distinct: int,
) -> dict[str, Any]:
    unique = sum(unique_tokens(t) for t in trees)
    model_computed = d["prefill_tokens"] + d["decode_tokens"]
    gen_per_tree = [t.meta["compute"].generated_tokens for t in trees]
    branch_k = [n.branch_k for t in trees for n in t.nodes if n.branch_k >= 2]
    return {
        "env": env.name,
        "method": method.name,
        "trees": len(trees),
        "nodes": sum(len(t) for t in trees),
        "leaves": sum(len(t.leaves()) for t in trees),
        "branch_nodes": len(branch_k),
        "mean_k": float(np.mean(branch_k)) if branch_k else 0.0,
        "generated_tokens": c.generated_tokens,
        "generated_per_tree": float(np.mean(gen_per_tree)),
        "prefill_tokens": c.prefill_tokens,
        "context_tokens": c.context_tokens,
        "unique_tokens": unique,
        "distinct_tokens": distinct,
        "efficiency": (c.prefill_tokens + c.generated_tokens) / distinct,
        "efficiency_per_tree_unique": (c.prefill_tokens + c.generated_tokens) / unique,
        "model_computed_tokens": model_computed,
        "model_efficiency": model_computed / distinct,
        "padding": d["padded_tokens"] / max(model_computed, 1),
        "evicted_tokens": d["evicted_tokens"],
        "no_cache_efficiency": (c.context_tokens + c.generated_tokens) / distinct,
        "wall_s": wall,
        "generated_tokens_per_s": c.generated_tokens / wall,
        "computed_tokens_per_s": model_computed / wall,
        "sandbox_steps": c.sandbox_steps,
        "sandbox_steps_per_s": c.sandbox_steps / wall,
        "snapshots": c.snapshots,
        "restores": c.restores,
        "snapshot_fraction": c.snapshot_seconds / wall,
        "policy_fraction": c.policy_seconds / wall,
        "sandbox_fraction": c.sandbox_seconds / wall,
        "live_snapshots_after_max": max(t.meta["live_snapshots_after"] for t in trees),
    }


METHODS = (
    Method("bpo/every", "every", 4, 2),
    Method("bpo/entropy_quantile", "entropy_quantile", 4, 2),
)


def table(rows: Sequence[dict[str, Any]]) -> str:
    headers = ["model", "env", "method", "leaves", "branch nodes", "gen tok / tree",
               "efficiency", "eff. per tree", "model eff.", "padding", "no-cache eff.",
               "gen tok/s", "steps/s", "snapshot %", "live after"]  # fmt: skip
    out = []
    for r in rows:
        out.append(
            [
                r["model"],
                r["env"],
                r["method"],
                r["leaves"],
                r["branch_nodes"],
                fmt_num(r["generated_per_tree"]),
                f"{r['efficiency']:.3f}",
                f"{r['efficiency_per_tree_unique']:.3f}",
                f"{r['model_efficiency']:.3f}",
                f"{100 * r['padding']:.1f}%",
                f"{r['no_cache_efficiency']:.2f}",
                fmt_num(r["generated_tokens_per_s"]),
                fmt_num(r["sandbox_steps_per_s"]),
                f"{100 * r['snapshot_fraction']:.2f}%",
                r["live_snapshots_after_max"],
            ]
        )
    return markdown_table(headers, out, right=range(3, 15))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 tasks, 4 steps, 1 iteration")
    p.add_argument("--smollm", action="store_true", help="also run SmolLM2-135M")
    p.add_argument("--envs", nargs="*", default=list(ENVS), choices=list(ENVS))
    p.add_argument("--tasks", type=int, default=8, help="trees per iteration")
    p.add_argument("--iterations", type=int, default=1, help="measured iterations")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--group", type=int, default=8, help="independent group size N")
    p.add_argument("--max-context", type=int, default=3800, help="prompt budget (tokens)")
    p.add_argument(
        "--cache-tokens",
        type=int,
        default=None,
        help="HFPolicy's prefix-cache budget (default: HFPolicy's own)",
    )
    p.add_argument("--methods", nargs="*", help="only these methods (e.g. bpo/every group)")
    p.add_argument("--json", help="also write the rows here")
    a = p.parse_args(argv)
    if a.quick:
        a.tasks, a.iterations, a.max_steps, a.group = 2, 1, 4, 4
    torch.manual_seed(0)
    load_before = load_average()
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    methods = [*METHODS, Method(f"group N={a.group}", "none", 1, a.group)]
    if a.methods:
        methods = [m for m in methods if m.name.split(" ")[0] in a.methods or m.name in a.methods]
    with tempfile.TemporaryDirectory() as workdir:
        for smollm in [False, True] if a.smollm else [False]:
            label, policy = load_model(smollm, workdir, a.cache_tokens)
            for env_name in a.envs:
                for method in methods:
                    print(f"  {label} / {env_name} / {method.name} ...", file=sys.stderr,
                          flush=True)  # fmt: skip
                    row = measure(policy, ENVS[env_name], method, a)
                    rows.append({"model": label, "cache_budget_tokens": cache_budget(a), **row})
    wall = time.perf_counter() - started
    load_after = load_average()
    print(table(rows))
    print(
        f"\n{a.tasks} trees per iteration x {a.iterations} measured iterations (+1 warm-up); "
        f"max_steps {a.max_steps}, max_new_tokens {a.new_tokens}; budget per task "
        f"{a.group * a.max_steps * a.new_tokens} generated tokens (expected mode); prefix cache "
        f"{cache_budget(a)} tokens. wall "
        f"{wall:.0f} s; load average {load_before} before, {load_after} after."
    )
    m = machine_info()
    print(f"machine: {m['cores']} x {m['machine']} ({m['cpu']}), {m['os']}, {m['date_utc']} UTC, "
          f"torch {m.get('torch')} with {m.get('torch_threads')} threads")  # fmt: skip
    if a.json:
        write_json(a.json, "rollout", rows, settings=vars(a), wall_s=wall,
                   load_before=load_before, load_after=load_after)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
