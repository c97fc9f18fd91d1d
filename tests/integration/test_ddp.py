"""Data-parallel learner: two gloo processes, each training on its shard of the trees, take the
same update as one process on the whole batch (parameters, gradient and metrics).

Both processes run every scenario in one process group (one spawn for the module); the
single-process reference runs in the test process. Tolerance: the model is fp32 and the loss is
computed in fp32; the two runs add the same per-token terms in a different order (other
packing, per-rank partial sums), so gradients agree to fp32 round-off (about 1e-7 relative) and
parameters after AdamW steps to well under ``lr * 1e-3``.
"""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bpo.data_parallel import DataParallel
from bpo.learner import Learner, LearnerConfig
from bpo.testing import random_tree, tiny_causal_lm

VOCAB = 64
WORLD = 2
PARAM_ATOL = 1e-6
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-5
METRIC_RTOL = 1e-5

# name: (number of trees, learner config, estimator, critic)
SCENARIOS = {
    # even shards, clipping active (the norm before clipping is about 0.03)
    "even_tree_clipped": (4, dict(aggregation="tree", max_grad_norm=0.01), "bpo", False),
    # odd number of trees: minibatches of 3 and 2 trees, shards 2+1 and 1+1, two epochs
    "odd_token_mean": (5, dict(aggregation="token_mean", minibatches=2, epochs=2), "bpo", False),
    # 3 trees in minibatches of 2 and 1: rank 1 has no tree in the second minibatch
    "empty_shard": (3, dict(aggregation="sequence_mean", minibatches=2), "bpo", False),
    # PPO: the value head and its globally normalised value loss
    "ppo_critic": (3, dict(aggregation="tree"), "ppo", True),
}
COMPARED = (
    "loss/total", "loss/pg", "loss/kl", "loss/entropy", "learner/grad_norm",
    "learner/grad_norm_max", "learner/clip_frac", "learner/ratio_mean", "learner/approx_kl_old",
    "learner/action_tokens", "learner/updates", "learner/lr",
    "loss/adv_mean", "loss/adv_abs_mean", "loss/adv_zero_frac",
)  # fmt: skip


tiny = tiny_causal_lm


def run_scenarios(dp: DataParallel | None, parallel: str = "ddp") -> dict[str, dict]:
    """Every scenario from the same initial model (seed 0 on every rank): the gradient at the
    start, then one ``update``; parameters (of the whole model, the one that samples),
    metrics and optimizer state after it."""
    out = {}
    for name, (n, kw, estimator, critic) in SCENARIOS.items():
        rng = np.random.default_rng(7)
        trees = [random_tree(rng, prefix=int(rng.integers(4, 16))) for _ in range(n)]
        cfg = LearnerConfig(lr=1e-3, parallel=parallel, **{"max_grad_norm": 1e9, **kw})
        learner = Learner(tiny(), cfg, critic=critic, data_parallel=dp)
        learner.optimizer_state()  # as the trainer's checkpoint of iteration 0: changes nothing
        grad = learner.gradient(trees, estimator) if estimator != "ppo" else None
        metrics = learner.update(trees, estimator)
        params = [p.detach().clone() for p in learner.full_model.parameters()]
        no_grad = [k for k, p in learner.model.named_parameters() if p.grad is None]
        optim = learner.optimizer_state()
        out[name] = {
            "grad": grad, "metrics": metrics, "params": params, "no_grad": no_grad, "optim": optim,
        }  # fmt: skip
    return out


def join_ranks(rank: int, port: int) -> DataParallel:
    """This process as rank ``rank`` of WORLD, from the environment torchrun would give it."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )  # fmt: skip
    torch.set_num_threads(1)
    dp = DataParallel.from_env("gloo")
    assert dp is not None and (dp.rank, dp.world) == (rank, WORLD)
    return dp


def _worker(rank: int, port: int, path: str) -> None:
    dp = join_ranks(rank, port)
    try:
        out = run_scenarios(dp)
        # a gradient on rank 0 only is summed; no gradient on any rank stays None
        lin = torch.nn.Linear(2, 1)
        if rank == 0:
            lin.weight.grad = torch.ones_like(lin.weight)
        dp.sum_grads([lin.weight, lin.bias])
        out["sum_grads"] = (lin.weight.grad, lin.bias.grad)
        torch.save(out, f"{path}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker, path) -> list:
    """Run ``worker(rank, port, path)`` in WORLD processes (one thread each); returns what each
    rank saved to ``path/rank{r}.pt``."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned children
    try:
        mp.spawn(worker, args=(_free_port(), str(path)), nprocs=WORLD, join=True)
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = old
    return [torch.load(path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_scenarios(None), spawn_ranks(_worker, tmp_path_factory.mktemp("ddp"))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks_take_the_single_process_update(runs, name):
    single, ranks = runs
    assert_single_process_update(single[name], ranks, name)


def assert_single_process_update(ref: dict, ranks: list[dict], name: str) -> None:
    """Every rank's gradient, parameters and metrics after scenario ``name`` match the
    single-process run's ``ref``, the replicas are identical, and the update moved them."""
    if name == "even_tree_clipped":
        assert ref["metrics"]["learner/grad_norm"] > 0.01  # so clipping is exercised
    for got in (r[name] for r in ranks):
        assert got["no_grad"] == ref["no_grad"]
        if ref["grad"] is not None:
            torch.testing.assert_close(got["grad"], ref["grad"], atol=GRAD_ATOL, rtol=GRAD_RTOL)
        moved = max(
            float((a - b).abs().max()) for a, b in zip(got["params"], ref["params"], strict=True)
        )
        gdiff = float((got["grad"] - ref["grad"]).abs().max()) if ref["grad"] is not None else 0
        mdiff = max(
            abs(got["metrics"][k] - ref["metrics"][k]) / max(abs(ref["metrics"][k]), 1e-12)
            for k in COMPARED
        )
        print(f"{name}: max |dparam| {moved:.1e}, |dgrad| {gdiff:.1e}, metric rel {mdiff:.1e}")
        assert moved < PARAM_ATOL, f"{name}: parameters differ by {moved:.2e}"
        for key in COMPARED:
            assert got["metrics"][key] == pytest.approx(
                ref["metrics"][key], rel=METRIC_RTOL, abs=1e-7
            ), key
    # the replicas are identical, not just close
    for a, b in zip(ranks[0][name]["params"], ranks[1][name]["params"], strict=True):
        assert torch.equal(a, b)
    # and the update did move the parameters (a no-op would also "match")
    init = tiny()
    assert any(
        not torch.equal(a, b) for a, b in zip(init.parameters(), ref["params"], strict=False)
    )


def test_a_gradient_missing_on_every_rank_stays_missing(runs):
    for r in runs[1]:
        weight, bias = r["sum_grads"]
        assert torch.equal(weight, torch.ones(1, 2)) and bias is None


def test_shards_are_round_robin_and_cover_every_tree():
    shards = [DataParallel(rank=r, world=3).shard(7) for r in range(3)]
    assert shards == [[0, 3, 6], [1, 4], [2, 5]]


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_bpo_train_under_torchrun(tmp_path, parallel) -> None:
    """``torchrun --nproc_per_node 2 -m bpo.cli train``: each rank samples half the tasks, the
    trees are gathered, the learner shards them; rank 0 alone writes the run directory, and
    the replicas end equal (the trainer checks, and fails otherwise). With FSDP (about 25 s on
    2 CPU cores) the checkpoints keep the single-process optimizer layout."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(_free_port()), "-m", "bpo.cli", "train",
        "--config", "configs/toy.yaml", "run.iterations=2", "run.tasks_per_iteration=4",
        "sandbox.num_train_tasks=4", "sandbox.num_eval_tasks=3", "sft.epochs=1",
        "budget.amount=100", "run.max_steps=5", f"learner.parallel={parallel}",
        "--out", str(run),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("held-out success: before") == 2  # each rank prints the result
    assert p.stdout.count("[iter 2/2]") == 1  # rank 0 alone logs
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    # the trees of both ranks were gathered: one per task of the iteration
    trees = [json.loads(line) for line in (run / "trees.jsonl").read_text().splitlines()]
    assert len(trees) == 2 * 2  # log_trees=2 per iteration, taken from the gathered batch
    assert rows[0]["compute/episodes"] >= 4
    assert sorted(x.name for x in (run / "checkpoints").iterdir()) == [
        "iter-000000", "iter-000001", "iter-000002",
    ]  # fmt: skip
    summary = json.loads((run / "summary.json").read_text())
    assert len(summary["eval_after"]["per_task"]) == 3  # evaluation sharded, then gathered
    # optimizer state by parameter index, whole; AdamW counted the 2 updates and no more
    optim = torch.load(run / "checkpoints/iter-000002/optimizer.pt", weights_only=False)
    assert sorted(optim["state"]) == optim["param_groups"][0]["params"]
    assert {float(s["step"]) for s in optim["state"].values()} == {2.0}


@pytest.mark.slow
def test_bpo_train_under_torchrun_resumes_exactly(tmp_path) -> None:
    """A torchrun run resumed from its last-but-one checkpoint repeats the last iteration's
    metrics: every rank's own sampling stream and budget cost model are checkpointed (rank 0
    writes them all), not re-seeded."""
    import json
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = tmp_path / "run"
    args = [
        "--config", "configs/toy.yaml", "run.iterations=3", "run.tasks_per_iteration=4",
        "sandbox.num_train_tasks=6", "sandbox.num_eval_tasks=2", "sft.epochs=1",
        "budget.amount=100", "run.max_steps=5", "--out", str(run),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}

    def torchrun(*extra: str) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(_free_port()), "-m", "bpo.cli", "train", *args, *extra]  # fmt: skip
        p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]

    def rows() -> list[dict]:
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    torchrun()
    first = rows()
    shutil.rmtree(run / "checkpoints" / "iter-000003")  # as if killed during iteration 3
    torchrun("--resume", str(run))
    again = rows()
    assert [r["iteration"] for r in again] == [1, 2, 3]
    keys = ("compute/generated_tokens", "compute/sandbox_steps", "compute/leaves",
            "rollout/success", "tree/nodes")  # fmt: skip
    assert {k: again[2][k] for k in keys} == {k: first[2][k] for k in keys}
    assert again[2]["loss/total"] == pytest.approx(first[2]["loss/total"], rel=1e-5, abs=1e-7)
