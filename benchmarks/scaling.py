"""Scaling: rollout throughput against the number of sandbox actors and inference engines on
Ray, and the per-part costs that a model of larger clusters is built from (issue 9).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/scaling.py [--env toy|twx] [--json P]

Setup: the real RolloutEngine growing BPO trees (entropy_quantile, K = 4, root_width 2) on
``--tasks`` tasks at once (one tree per task; ``--tasks`` trees in flight), a tiny random-init
Qwen2 (hidden 128, 2 layers, byte vocabulary) sampling at temperature 1, a budget of
``8 x max_steps x new_tokens`` generated tokens per tree. One warm-up iteration (Ray actors
start, the cost model learns), then one measured iteration with the same seeds in every
configuration.

Configurations (Ray started once on this machine, ``num_cpus`` = 2 x the cores so that the
actors' CPU requests never queue; the real limit is the cores):

* ``in-process``: the policy and the sandboxes in the benchmark's process (no Ray);
* ``M actors``: the sandboxes in M Ray sandbox actors (``SandboxPool``), steps of different
  trees in flight together (``step_threads = M``); the policy in process;
* ``N engines``: the policy in N Ray inference-engine actors (``EngineGroup``) behind the
  prefix router (or round robin), with 2 sandbox actors.

Per-part costs, measured separately: a policy call's latency against its batch (contexts of
one turn), a sandbox step in process and through an actor (the Ray round trip), a snapshot and
restore through an actor, the learner's trained tokens per second on the measured trees, and
the weights' trip to the engines (``EngineGroup.load``) in MB/s.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
from common import fmt_num, load_average, machine_info, markdown_table, write_json

from bpo.branching import make_rule
from bpo.cluster.routing import prefix_hit_rate
from bpo.learner import Learner, LearnerConfig
from bpo.policy.hf import HFPolicy
from bpo.policy.models import init_model
from bpo.policy.parsing import parse_action
from bpo.policy.prompts import PromptBuilder
from bpo.policy.protocol import SamplingParams
from bpo.rollout import Budget, RolloutConfig, RolloutEngine
from bpo.rollout.budget import Compute
from bpo.sandbox import list_tasks, make_env

ENVS = {
    "toy": ("toy", {"max_steps": 200}),
    "twx": ("twx", {"games": ["coin"], "params": {"numLocations": 3}}),
}


def train_tasks(key: str) -> list[str]:
    """The training split of ``ENVS[key]`` (twx lists tasks per game options; the toy game's
    options are sandbox options only)."""
    env, opts = ENVS[key]
    return list(list_tasks(env, "train", **opts) if env == "twx" else list_tasks(env, "train"))


def engine_for(
    policy: Any, factory: Any, a: argparse.Namespace, step_threads: int
) -> RolloutEngine:
    return RolloutEngine(
        policy,
        PromptBuilder(policy.tokenizer, max_context_tokens=1024),
        lambda raw, adm: parse_action(raw, adm).text,
        make_rule("entropy_quantile", k=4),
        factory,
        RolloutConfig(
            root_width=2,
            max_steps=a.max_steps,
            concurrency=a.tasks,
            step_threads=step_threads,
            budget=Budget("tokens", 8 * a.max_steps * a.new_tokens),
        ),
        SamplingParams(max_new_tokens=a.new_tokens, temperature=1.0),
    )


def rollouts(name: str, policy: Any, factory: Any, a: argparse.Namespace,
             step_threads: int = 1) -> tuple[dict[str, Any], list]:  # fmt: skip
    tasks = train_tasks(a.env)[: a.tasks]
    engine = engine_for(policy, factory, a, step_threads)
    try:
        for it in range(2):
            policy.clear_cache()
            before = policy.stats()
            t0 = time.perf_counter()
            trees = engine.run([(t, i + 1000 * it) for i, t in enumerate(tasks)])
            wall = time.perf_counter() - t0
    finally:
        engine.close()
    c = Compute()
    for t in trees:
        c.add(t.meta["compute"])
    row = {
        "config": name,
        "trees": len(trees),
        "sandbox steps": c.sandbox_steps,
        "gen tokens": c.generated_tokens,
        "wall s": wall,
        "steps/s": c.sandbox_steps / wall,
        "gen tok/s": c.generated_tokens / wall,
        "prefix hit rate": prefix_hit_rate(before, policy.stats()),
        # the engine's turns alternate: one batched policy call, then every tree's step
        "policy %": 100 * c.policy_seconds / wall,
    }
    print(f"  {name}: {fmt_num(row['steps/s'])} steps/s, {fmt_num(row['gen tok/s'])} tok/s, "
          f"hit {row['prefix hit rate']:.3f}", flush=True)  # fmt: skip
    return row, trees


def part_costs(policy: HFPolicy, trees: list, model: torch.nn.Module, a: argparse.Namespace,
               pool_cls: Any) -> list[dict[str, Any]]:  # fmt: skip
    """The per-part costs of the model in BENCHMARKS.md."""
    import ray

    rows: list[dict[str, Any]] = []
    env, opts = ENVS[a.env]
    task = train_tasks(a.env)[0]
    # policy latency against batch size: the first turn's contexts of distinct tasks
    prompter = PromptBuilder(policy.tokenizer, max_context_tokens=1024)
    ctxs = []
    for i in range(8):
        sb = make_env(env, **opts)
        obs = sb.reset(task, i)
        ctxs.append(list(prompter.start(obs.instruction, obs.text, obs.admissible).ids))
        sb.close()
    params = SamplingParams(max_new_tokens=a.new_tokens, temperature=1.0)
    for b in (1, 2, 4, 8):
        times = []
        for _ in range(3):
            policy.clear_cache()
            t0 = time.perf_counter()
            policy.sample(ctxs[:b], 1, params)
            times.append(time.perf_counter() - t0)
        rows.append({"part": f"policy call, batch {b} (prefill + up to {a.new_tokens} tokens)",
                     "cost": f"{1e3 * float(np.median(times)):.1f} ms"})  # fmt: skip
    # a sandbox step in process and through an actor; snapshot + restore through an actor
    local = make_env(env, **opts)
    local.reset(task, 0)
    actions = ["look"] * a.steps
    t0 = time.perf_counter()
    for act in actions:
        local.step(act)
    step_local = (time.perf_counter() - t0) / len(actions)
    local.close()
    with pool_cls(env, 1, env_options=opts, num_cpus_per_actor=0) as pool:
        sb = pool.open()
        sb.reset(task, 0)
        t0 = time.perf_counter()
        for act in actions:
            sb.step(act)
        step_actor = (time.perf_counter() - t0) / len(actions)
        t0 = time.perf_counter()
        for _ in range(50):
            snap = sb.snapshot()
            sb.restore(snap)
            sb.release(snap)
        snap_actor = (time.perf_counter() - t0) / 50
        # many steps in flight at once through one actor (how far one host goes)
        sbs = [pool.open() for _ in range(8)]
        for s in sbs:
            s.reset(task, 0)
        t0 = time.perf_counter()
        for _ in range(a.steps // 8):
            pool.step_many(sbs, ["look"] * 8)
        step_batched = (time.perf_counter() - t0) / (8 * (a.steps // 8))
        for s in sbs:
            s.close()
        sb.close()
    rows += [
        {"part": f"sandbox step, in process ({a.env})", "cost": f"{1e3 * step_local:.3f} ms"},
        {"part": f"sandbox step, through a Ray actor ({a.env})", "cost": f"{1e3 * step_actor:.3f} ms"},
        {"part": "sandbox step, 8 in flight through one actor (per step)",
         "cost": f"{1e3 * step_batched:.3f} ms"},
        {"part": "snapshot + restore + release, through a Ray actor",
         "cost": f"{1e3 * snap_actor:.3f} ms"},
    ]  # fmt: skip
    # the learner on the measured trees
    learner = Learner(model, LearnerConfig())
    tokens = sum(len(n.turn.action_ids) + len(n.obs_ids) for t in trees for n in t.nodes if n.turn)
    t0 = time.perf_counter()
    learner.update(trees, "bpo")
    dt = time.perf_counter() - t0
    rows.append({"part": "learner update (2 epochs x 2 minibatches, packed trees)",
                 "cost": f"{dt:.2f} s for {tokens} tree tokens ({tokens * 2 / dt:.0f} tok/s "
                         "through forward + backward)"})  # fmt: skip
    # the weights' trip to 2 engines through the object store
    state = {"w": torch.zeros(64 * 2**20 // 4)}  # 64 MB
    from bpo.cluster.roles import _InferenceEngine

    remote = ray.remote(_InferenceEngine)
    actors = [remote.options(num_cpus=0).remote(model, policy.tokenizer, i, 4096) for i in range(2)]
    ray.get([x.stats.remote() for x in actors])
    t0 = time.perf_counter()
    ref = ray.put(state)
    ray.get([x.set_weights.remote(1, ref) for x in actors])
    dt = time.perf_counter() - t0
    for x in actors:
        ray.kill(x)
    rows.append({"part": "weights to 2 engines through the object store (64 MB)",
                 "cost": f"{dt * 1e3:.0f} ms ({64 / dt:.0f} MB/s)"})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", choices=sorted(ENVS), default="toy")
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--max-steps", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--steps", type=int, default=400, help="steps timed per sandbox cost")
    ap.add_argument("--actors", default="1,2,4")
    ap.add_argument("--engines", default="1,2")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    import ray
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bpo.cluster.roles import EngineGroup, Placement
    from bpo.config import ClusterConfig
    from bpo.sandbox.pool import SandboxPool

    start = machine_info()
    load0 = load_average()
    torch.manual_seed(0)
    work = tempfile.mkdtemp(prefix="bpo-scaling-")
    path = init_model(os.path.join(work, "tiny"), hidden=128, layers=2, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    env, opts = ENVS[a.env]
    cores = os.cpu_count() or 1
    ray.init(num_cpus=2 * cores, object_store_memory=512 * 2**20, include_dashboard=False)
    rows: list[dict[str, Any]] = []
    try:
        policy = HFPolicy(model, tok, seed=0)
        row, trees = rollouts("in-process", policy, lambda: make_env(env, **opts), a)
        rows.append(row)
        for m in [int(x) for x in a.actors.split(",")]:
            with SandboxPool(env, m, env_options=opts, num_cpus_per_actor=0.5) as pool:
                rows.append(rollouts(f"{m} sandbox actor(s)", policy, pool.open, a, m)[0])
        for n in [int(x) for x in a.engines.split(",")]:
            for routing in ("prefix", "round_robin") if n > 1 else ("prefix",):
                cfg = ClusterConfig(address="local", inference_engines=n, sandbox_actors=2,
                                    engine_resources={"CPU": 1},
                                    sandbox_resources={"CPU": 0.5})  # fmt: skip
                placement = Placement.reserve(cfg)
                group = EngineGroup(placement, model, tok, policy.stop_token_ids, 0, 32768,
                                    routing)  # fmt: skip
                group.load(0, {k: v.detach() for k, v in model.named_parameters()})
                pool = SandboxPool(env, 2, env_options=opts,
                                   actor_options=[placement.options(b)
                                                  for b in placement.sandboxes])  # fmt: skip
                try:
                    name = f"{n} engine(s), {routing}, 2 sandbox actors"
                    rows.append(rollouts(name, group.policy, pool.open, a, 2)[0])
                finally:
                    pool.close()
                    group.close()
                    placement.release()
        costs = part_costs(policy, trees, model, a, SandboxPool)
    finally:
        ray.shutdown()
    cols = ["config", "trees", "sandbox steps", "gen tokens", "wall s", "steps/s", "gen tok/s",
            "prefix hit rate", "policy %"]  # fmt: skip
    print(f"\nmachine: {start['cpu']}, {cores} cores; load {load0} -> {load_average()}\n")
    fmt = [[r[c] if isinstance(r[c], str) else fmt_num(r[c]) for c in cols] for r in rows]
    print(markdown_table(cols, fmt, right=range(1, len(cols))))
    print()
    print(markdown_table(["part", "cost"], [[r["part"], r["cost"]] for r in costs]))
    if a.json:
        write_json(a.json, "scaling", rows, parts=costs, machine_at_start=start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
