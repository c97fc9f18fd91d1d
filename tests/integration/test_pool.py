"""SandboxPool on a local Ray: snapshots stay in their actor, a killed actor's snapshot is
rebuilt by replay on another with identical observations, the facade passes the contract
checker, async and batch calls agree with a local sandbox, and nothing leaks."""

from __future__ import annotations

import asyncio
import os
import time

import psutil
import pytest
import ray

from bpo.sandbox import Sandbox, check_sandbox, make_env
from bpo.sandbox.pool import PoolSandbox, SandboxPool, run_sync

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

pytestmark = pytest.mark.ray


def _gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        alive = [
            p
            for p in pids
            if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


@pytest.fixture(scope="module")
def local_ray():
    if ray.is_initialized():  # another module's cluster: use it, leave it running
        yield
        return
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    ray.init(
        num_cpus=2, object_store_memory=200 * 1024**2, include_dashboard=False, log_to_driver=False
    )
    yield
    ray.shutdown()
    leaked = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert _gone(leaked) == [], "processes left behind by ray.shutdown()"


@pytest.fixture
def pool(local_ray):
    with SandboxPool("toy", 2, env_options={"max_steps": 40}, backend="native") as p:
        yield p


def test_restore_falls_back_to_replay_when_the_actor_dies(pool):
    sb, other = pool.open(), pool.open()
    assert isinstance(sb, Sandbox) and sb.backend == "ray:native"
    assert sb.actor_pid != other.actor_pid  # spread over both actors
    sb.reset("keydoor-3", 0)
    for _ in range(3):
        sb.step(sb.expert_action())
    snap = sb.snapshot()
    want, fingerprint = sb.observation(), sb.fingerprint()
    assert want.text == "You take the key."
    rest = ["go east", "unlock door with key", "open door", "go east", "take treasure"]
    first = [sb.step(a) for a in rest]
    assert first[-1].reward == 1.0 and first[-1].terminated

    assert sb.restore(snap) == want  # in the actor that took it
    assert sb.stats().replayed == 0
    assert [sb.step(a) for a in rest] == first

    holder = sb.actor_pid
    ray.kill(sb.actor)
    assert _gone([holder]) == []  # ray.kill returns before the actor is dead
    assert sb.restore(snap) == want  # replayed on the other actor
    assert sb.fingerprint() == fingerprint
    assert sb.actor_pid != holder and sb.stats().replayed == 1 and pool.replaced == 1
    assert [sb.step(a) for a in rest] == first
    assert sb.restore(snap) == want  # still restorable, again by replay
    sb.release(snap)
    assert sb.stats().live == 0
    other.reset("keydoor-0", 0)  # the surviving actor is untouched
    assert other.step("go west").observation.text.startswith("You are in the study.")
    sb.close(), other.close()


def test_pool_sandbox_passes_the_checker(pool):
    report = check_sandbox(pool.open, ["keydoor-0", "keydoor-4"], stress_nodes=20)
    assert report.backend == "ray:native" and len(report.properties) == 7


def test_async_and_batch_calls_match_a_local_sandbox(pool):
    tasks = ["keydoor-0", "keydoor-1", "keydoor-2", "keydoor-3"]
    local = make_env("toy", max_steps=40)
    want = []
    for task in tasks:
        local.reset(task, 1)
        want.append([local.step(local.expert_action()).observation for _ in range(3)])
    local.close()

    async def episode(task: str) -> list:
        sb = await pool.aopen()
        obs = await sb.areset(task, 1)
        seen = []
        for _ in range(3):
            action = await sb.aexpert_action()
            seen.append((await sb.astep(action)).observation)
        assert obs.instruction and (await sb.afingerprint())
        sb.close()
        return seen

    async def all_episodes() -> list:
        return await asyncio.gather(*(episode(t) for t in tasks))

    assert asyncio.run(all_episodes()) == want

    sbs = [pool.open() for _ in tasks]
    pool.reset_many(sbs, tasks, [1] * len(tasks))
    got = [[] for _ in tasks]
    for _ in range(3):
        actions = [sb.expert_action() for sb in sbs]
        for i, r in enumerate(pool.step_many(sbs, actions)):
            got[i].append(r.observation)
    assert got == want
    for sb in sbs:
        sb.close()


def test_fork_backend_in_an_actor_dies_with_it(local_ray):
    with SandboxPool("toy", 1, env_options={}, backend="fork") as pool:
        sb: PoolSandbox = pool.open()
        assert sb.backend == "ray:fork"
        sb.reset("keydoor-0", 0)
        snap = sb.snapshot()
        sb.step("go west")
        assert sb.restore(snap).text.startswith("You are in the pantry.")
        frozen = run_sync(sb._call("frozen_pids"))
        assert len(frozen) == 1 and psutil.pid_exists(frozen[0])
        ray.kill(sb.actor)
        assert _gone(frozen) == []


def test_an_actor_dying_mid_rollout_is_survived_by_the_engine(pool, tmp_path):
    """The rollout engine over pool sandboxes: a Ray actor killed while trees are in flight
    fails the rollout's next step; the engine restarts it from its snapshot, which the pool
    rebuilds by replay on the surviving actor. Every tree completes, whole, with no snapshot
    left."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bpo.branching import make_rule
    from bpo.policy.hf import HFPolicy
    from bpo.policy.models import init_model
    from bpo.policy.parsing import parse_action
    from bpo.policy.prompts import PromptBuilder
    from bpo.policy.protocol import SamplingParams
    from bpo.rollout import Budget, RolloutConfig, RolloutEngine

    path = init_model(tmp_path / "m", hidden=64, layers=2, tokenizer="byte", seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    inner = HFPolicy(AutoModelForCausalLM.from_pretrained(path), tok, seed=0)
    made: list[PoolSandbox] = []

    class Killing:  # kills the first sandbox's actor at the 4th policy call
        calls = 0

        def sample(self, contexts, n=1, params=None):
            Killing.calls += 1
            if Killing.calls == 4:
                ray.kill(made[0].actor)
                _gone([made[0].actor_pid])
            return inner.sample(contexts, n, params)

    def factory():
        made.append(pool.open())
        return made[-1]

    cfg = RolloutConfig(root_width=2, max_steps=6, budget=Budget("tokens", 200), concurrency=2)
    eng = RolloutEngine(
        Killing(), PromptBuilder(tok, max_admissible=8),
        lambda raw, adm: parse_action(raw, adm).text, make_rule("every", k=2, max_branches=2),
        factory, cfg, SamplingParams(max_new_tokens=8, temperature=1.0),
    )  # fmt: skip
    try:
        trees = eng.run([("keydoor-1", 0), ("keydoor-2", 1)])
    finally:
        eng.close()
    assert len(trees) == 2
    assert eng.faults["retries"] >= 1 and eng.faults["failed_rollouts"] == 0
    assert pool.replaced >= 1
    for t in trees:
        assert t.meta["live_snapshots_after"] == 0
        assert all(t.nodes[leaf].terminal for leaf in t.leaves())


def test_code_sandbox_passes_the_checker_in_the_pool(local_ray):
    """The code sandbox's workspaces (overlay servers, jails) live in the actor's process."""
    from bpo.sandbox.envs import code

    task = code.tasks("train")[0]
    with SandboxPool("code", 1, env_options={"max_steps": 8}, backend="native") as p:
        report = check_sandbox(p.open, [task], max_steps=6, stress_nodes=8)
    assert report.backend == "ray:native" and len(report.properties) == 7


def test_web_sandboxes_share_one_shop_in_the_pool(local_ray):
    """Many actors' sandboxes talk to one shop server over HTTP; each has its own session."""
    from bpo.sandbox.envs import web
    from bpo.web.serve import start_server

    url, stop = start_server()
    try:
        tasks = web.tasks("train", url=url)[:2]
        with SandboxPool("web", 2, env_options={"url": url}, backend="native") as p:
            report = check_sandbox(p.open, tasks, max_steps=6, stress_nodes=8)
    finally:
        stop()
    assert report.backend == "ray:native" and len(report.properties) == 7
