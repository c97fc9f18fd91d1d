"""``bpo train`` on a multi-node Ray cluster and with asynchronous rollouts.

The cluster is real Ray: a head node and a worker node started on this machine
(``ray.cluster_utils.Cluster``: separate raylets and object stores, talking over loopback), each
with a custom resource that places the roles: the learner (the whole trainer) on the head, the
inference engines and sandbox actors on the worker. The run must place them so
(``cluster.json``), route each tree's turns to one engine (the prefix-cache hit rate stays high),
keep staleness within the bound, and leave no actor behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
# Ray 2.60 keeps one auth token per user (~/.ray/auth_token), rewritten by every new local
# cluster; a loopback test cluster goes without, so that no other Ray on the machine (an
# earlier test's) leaves its processes with another token
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1",
       "PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": "disabled"}  # fmt: skip
TOY = [
    "--config", "configs/toy.yaml", "run.iterations=3", "run.tasks_per_iteration=4",
    "sandbox.num_train_tasks=4", "sandbox.num_eval_tasks=2", "sft.epochs=1",
    "budget.amount=100", "run.max_steps=5",
]  # fmt: skip


def _train(args: list[str], out: Path, timeout: int = 420) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "bpo.cli", "train", *TOY, *args, "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "held-out success: before" in p.stdout
    return p


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _running(pid: int) -> bool:
    """A process that exists and is not a zombie (an exited child not yet reaped)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def _tree_versions(run: Path) -> list[set[int]]:
    out = []
    for line in (run / "trees.jsonl").read_text().splitlines():
        tree = json.loads(line)
        out.append({n["turn"]["policy_version"] for n in tree["nodes"] if n.get("turn")})
    return out


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_AUTH_MODE", "disabled")  # the nodes inherit it (see ENV)

    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"learner_node": 1},
                        "object_store_memory": 150 * 2**20},
    )  # fmt: skip
    worker = c.add_node(num_cpus=2, resources={"rollout_node": 4},
                        object_store_memory=150 * 2**20)  # fmt: skip
    try:
        yield c, c.head_node.node_id, worker.node_id
    finally:
        c.shutdown()
        mp.undo()


def test_roles_run_where_the_placement_puts_them(cluster, tmp_path: Path) -> None:
    c, head, worker = cluster
    run = tmp_path / "run"
    _train(
        [
            f"cluster.address={c.address}",
            "cluster.inference_engines=2", "cluster.sandbox_actors=2",
            "cluster.learner_resources={CPU: 0.5, learner_node: 1}",
            "cluster.engine_resources={CPU: 0.5, rollout_node: 1}",
            "cluster.sandbox_resources={CPU: 0.25, rollout_node: 1}",
            "run.max_staleness=1",
        ],
        run,
    )  # fmt: skip
    info = json.loads((run / "cluster.json").read_text())
    assert head != worker
    assert info["trainer"]["node"] == head
    assert [e["node"] for e in info["engines"]] == [worker, worker]
    assert [s["node"] for s in info["sandbox_actors"]] == [worker, worker]
    assert len({e["pid"] for e in info["engines"]}) == 2
    rows = _metrics(run)
    assert [r["async/staleness"] for r in rows] == [0, 1, 1]
    assert [r["async/policy_version"] for r in rows] == [0, 0, 1]
    # every turn of a tree goes to the engine that served its earlier turns
    assert min(r["rollout/prefix_hit_rate"] for r in rows) > 0.5
    assert all(r["time/weight_sync_s"] > 0 for r in rows)
    assert all(len(v) == 1 for v in _tree_versions(run))  # a tree never mixes versions
    assert (run / "summary.json").exists()
    # the run's actors are gone (killed at its end; the processes exit shortly after). Their
    # own pids, from cluster.json: another Ray on the machine may run actors of these classes
    pids = [e["pid"] for e in info["engines"]] + [s["pid"] for s in info["sandbox_actors"]]
    pids += [info["trainer"]["pid"]] if "pid" in info["trainer"] else []
    deadline = time.time() + 30
    while (alive := [p for p in pids if _running(p)]) and time.time() < deadline:
        time.sleep(1)
    assert not alive, f"actors of the finished run are still alive: pids {alive}"


def test_a_cluster_without_room_fails_with_what_is_missing(cluster, tmp_path: Path) -> None:
    c, _, _ = cluster
    cmd = [
        sys.executable, "-m", "bpo.cli", "train", *TOY, f"cluster.address={c.address}",
        "cluster.inference_engines=1", "cluster.engine_resources={CPU: 1, GPU: 8}",
        "cluster.placement_timeout_s=5", "--out", str(tmp_path / "run"),
    ]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert "cannot hold this run's roles" in p.stderr and "GPU" in p.stderr


def test_asynchronous_rollouts_in_one_process(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train(["run.max_staleness=1", "run.iterations=4"], run)
    rows = _metrics(run)
    assert [r["async/staleness"] for r in rows] == [0, 1, 1, 1]
    assert [r["async/policy_version"] for r in rows] == [0, 0, 1, 2]
    assert all(len(v) == 1 for v in _tree_versions(run))
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts[-1] == "iter-000004"


def test_an_asynchronous_run_stopped_by_ctrl_c_resumes(tmp_path: Path) -> None:
    """Ctrl-C: the iteration in flight finishes (the batch being sampled ahead is dropped), a
    checkpoint is saved; --resume samples that batch again with the checkpoint's weights."""
    import signal

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "bpo.cli", "train", *TOY, "run.iterations=4",
           "run.max_staleness=1", "--out", str(run)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.time() + 240
        while not (run / "metrics.jsonl").exists() and time.time() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "--resume" in out, out[-3000:]
    done = len(_metrics(run))
    assert 1 <= done < 4
    p = subprocess.run([sys.executable, "-m", "bpo.cli", "train", "--resume", str(run)],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=400)  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = _metrics(run)
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    # the first batch after the resume is sampled by the checkpoint's weights (staleness 0)
    assert [r["async/staleness"] for r in rows[done:]] == [0] + [1] * (3 - done)


def test_an_engine_killed_mid_run_is_restarted(cluster, tmp_path: Path) -> None:
    """SIGKILL one inference engine's process while the run samples: the engine comes back in
    its bundle with the current weights, the turn's batch is sampled again, the run ends."""
    import signal

    c, _, _ = cluster
    run = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "bpo.cli", "train", *TOY, "run.iterations=4",
        f"cluster.address={c.address}", "cluster.inference_engines=2",
        "cluster.engine_resources={CPU: 0.5, rollout_node: 1}", "--out", str(run),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.time() + 240
        info = run / "cluster.json"
        while not (info.exists() and (run / "metrics.jsonl").exists()) and time.time() < deadline:
            time.sleep(0.2)  # the engines are up and the first iteration has been logged
        assert info.exists(), "the run never started its engines"
        os.kill(json.loads(info.read_text())["engines"][0]["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=400)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    rows = _metrics(run)
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["cluster/engine_restarts"] == 1
    # whatever call met the death (a sampling call, the cache statistics, a weight sync) was
    # made again by the engine group: nothing reached the rollout engine's own retries
    assert sum(r["rollout/policy_retries"] for r in rows) == 0
