"""Leaks of the rollout path: snapshots, processes, sandbox handles, memory, file descriptors.

* after every tree, zero live snapshots (``tree.meta["live_snapshots_after"]``) on every path
  of the engine that takes or drops snapshots (causal rules, nested forks, the non-causal
  ablation that releases the states it does not pick, the hard budget that drops queued forks,
  fork-backend evictions under a memory budget), and after an engine dies in the middle of
  ``run()`` (the trees in flight are dropped, their snapshots released);
* the fork backend: after ``RolloutEngine.close()`` no child process of this process is left
  (zombies included), the fork servers and engine processes are gone, every sandbox handle is
  closed, and the file descriptors are back to what they were; the same for the JVM of
  TextWorld-Express;
* a soak of 1,000 small trees on the ``mdp`` env with the real RolloutEngine, PromptBuilder
  and parser: resident memory (after ``malloc_trim``, see :func:`_rss`) grows by less than
  ``RSS_BOUND`` = 8 MB between tree 100 and tree 1,000, and open file descriptors, threads and
  child processes stay constant. It runs with :class:`UniformTestPolicy` (a test policy, 4-8 s)
  and with a tiny random HFPolicy (``slow``: 70-85 s here). Measured here: +0.4 MB and
  +3.0 MB. The bound is tight on purpose: an engine that kept a reference to every finished
  tree grew by 12.8 MB over the same 900 trees, which a 50 MB bound would not catch.
"""

from __future__ import annotations

import ctypes
import gc
import math
import os
import random
import signal
from collections.abc import Callable, Sequence
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

from bpo.branching import make_rule
from bpo.policy.parsing import parse_action
from bpo.policy.prompts import PromptBuilder
from bpo.policy.protocol import SamplingParams, TurnSample
from bpo.policy.vocab import byte_tokenizer
from bpo.rollout import Budget, RolloutConfig, RolloutEngine
from bpo.sandbox import SandboxError, list_tasks, make_env
from bpo.sandbox.envs.mdp import labels_of

RSS_BOUND = 8 * 2**20
"""Resident memory the soak may gain between tree 100 and tree 1,000 (bytes; see the module
docstring for the measurements behind it)."""
SOAK_TREES = 1_000
SOAK_BATCH = 10  # trees per RolloutEngine.run (one iteration), all in flight together


class UniformTestPolicy:
    """A TEST POLICY, not a model: each action is drawn uniformly, with a fixed seed, from a
    fixed list of action texts. For one ``mdp`` family the list is exactly the admissible set
    of every live state, so this is the uniform policy over admissible actions.

    Implements the ``sample()`` contract of :class:`bpo.policy.protocol.Policy` that the rollout
    engine uses: ``result[i][j]`` is a :class:`TurnSample` whose ids are the tokenizer's ids of
    the action text; the log-prob of the choice (log 1/K) sits on the first token, the other
    tokens get 0 (they are determined by the choice); entropy log K on the first token, else 0.
    """

    def __init__(self, tokenizer: object, actions: Sequence[str], seed: int = 0) -> None:
        self.actions = tuple(actions)
        self.rng = random.Random(seed)
        encode = tokenizer.encode  # type: ignore[attr-defined]
        self.ids = [tuple(encode(a, add_special_tokens=False)) for a in self.actions]

    def sample(
        self,
        contexts: Sequence[Sequence[int]],
        n: int | Sequence[int] = 1,
        params: SamplingParams | None = None,
    ) -> list[list[TurnSample]]:
        k = len(self.actions)
        counts = [n] * len(contexts) if isinstance(n, int) else list(n)
        out = []
        for ctx, m in zip(contexts, counts, strict=True):
            row = []
            for j in range(m):
                a = self.rng.randrange(k)
                ids = self.ids[a]
                rest = (0.0,) * (len(ids) - 1)
                row.append(
                    TurnSample(
                        ids,
                        (-math.log(k), *rest),
                        (math.log(k), *rest),
                        self.actions[a],
                        "stop",
                        len(ctx) if j == 0 else 0,
                    )
                )
            out.append(row)
        return out


# -- process and descriptor readings -------------------------------------------------------


def _children() -> set[int]:
    """Child processes of this process (zombies included: they are children until reaped)."""
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            pids |= {int(p) for p in (task / "children").read_text().split()}
        except OSError:  # a thread that just ended
            continue
    return pids


def _exists(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _rss() -> int:
    """Resident memory of this process in bytes, after a garbage collection and after glibc's
    ``malloc_trim(0)`` has returned free heap pages to the system, so that the reading is memory
    in use rather than allocator fragmentation (the tiny-HFPolicy soak: +43 MB untrimmed, about
    +3 MB trimmed, over the same 900 trees)."""
    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only
    if trim is not None:
        trim(0)
    return _status("VmRSS") * 1024


# -- engine --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def _engine(
    policy: object,
    tokenizer: object,
    factory: Callable[[], object],
    rule: object,
    *,
    root_width: int = 2,
    budget: Budget | None = None,
    max_steps: int = 12,
    concurrency: int = 8,
    max_new_tokens: int = 8,
) -> RolloutEngine:
    cfg = RolloutConfig(
        root_width=root_width,
        max_steps=max_steps,
        budget=budget or Budget("tokens", 100_000),
        concurrency=concurrency,
    )
    return RolloutEngine(
        policy,  # type: ignore[arg-type]
        PromptBuilder(tokenizer, max_admissible=8),
        lambda raw, adm: parse_action(raw, adm).text,
        rule,  # type: ignore[arg-type]
        factory,  # type: ignore[arg-type]
        cfg,
        SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0),
    )


def _agent_tasks(n: int, offset: int = 0) -> list[tuple[str, int]]:
    tasks = list_tasks("mdp", "train", families=("agent",))
    return [(tasks[(offset + i) % len(tasks)], offset + i) for i in range(n)]


ENGINE_PATHS = {
    "every-nested": dict(rule=("every", dict(k=3, max_branches=3, max_depth=2))),
    "group": dict(rule=("none", {}), root_width=6),
    "random": dict(rule=("random", dict(k=2, p=0.5, seed=1, max_depth=2))),
    "topk-ablation": dict(rule=("topk_backbone", dict(k=2, b=2))),
    "hard-budget": dict(
        rule=("every", dict(k=4, max_depth=3)),
        budget=Budget("steps", 10, mode="hard", truncate=True),
    ),
    "expected-budget": dict(rule=("every", dict(k=4, max_depth=3)), budget=Budget("steps", 15)),
}


CASES = [(path, "auto") for path in ENGINE_PATHS] + [
    ("every-nested", "fork"),  # fork: evictions under the memory budget, restores by replay
    ("hard-budget", "fork"),
]


@pytest.mark.parametrize(("path", "backend"), CASES)
def test_no_live_snapshots_after_any_tree(tokenizer, path, backend):
    spec = dict(ENGINE_PATHS[path])
    name, options = spec.pop("rule")
    made: list[object] = []

    def factory():
        # a fork memory budget of 1 byte evicts every frozen copy but the newest: the evicted
        # ones restore by replay and must still be released
        sb = make_env("mdp", backend, **({"memory_budget": 1} if backend == "fork" else {}))
        made.append(sb)
        return sb

    policy = UniformTestPolicy(tokenizer, labels_of("agent-0"), seed=3)
    eng = _engine(policy, tokenizer, factory, make_rule(name, **options), **spec)
    trees = []
    try:
        for it in range(2):
            batch = eng.run(_agent_tasks(6, offset=6 * it))
            assert [t.meta["live_snapshots_after"] for t in batch] == [0] * 6
            for sb in made:
                assert sb.stats().live == 0 and sb.stats().live_bytes == 0
            trees += batch
    finally:
        eng.close()
    # the path under test was taken
    assert sum(t.meta["compute"].snapshots for t in trees) > 0
    if path == "hard-budget":  # queued forks were dropped (and their snapshots released)
        assert any(len(n.children) < n.branch_k for t in trees for n in t.nodes)
    if backend == "fork":
        assert sum(sb.stats().evicted for sb in made) > 0


def test_fork_backend_leaves_no_process_descriptor_or_handle(tokenizer):
    children, fds = _children(), _fds()
    made: list[object] = []

    def factory():
        sb = make_env("mdp", "fork")
        made.append(sb)
        return sb

    policy = UniformTestPolicy(tokenizer, labels_of("agent-0"), seed=5)
    eng = _engine(policy, tokenizer, factory, make_rule("every", k=2, max_depth=2), concurrency=4)
    pids: set[int] = set()
    try:
        for it in range(2):
            trees = eng.run(_agent_tasks(6, offset=6 * it))
            assert all(t.meta["live_snapshots_after"] == 0 for t in trees)
            for sb in made:
                pids |= {sb.server_pid, sb.engine_pid, *sb.frozen_pids()}  # type: ignore[attr-defined]
        assert len(made) == 4 and len(_children() - children) == 4  # one fork server each
    finally:
        eng.close()
    assert _children() - children == set(), "child processes (or zombies) left after close()"
    assert [p for p in pids if p and _exists(p)] == [], "engine processes outlived close()"
    assert _fds() == fds, "file descriptors left open after close()"
    for sb in made:
        with pytest.raises(SandboxError, match="closed"):
            sb.reset("agent-0", 0)


def test_fork_backend_cleans_up_after_an_engine_is_killed(tokenizer):
    """An engine process killed mid-run: close() still reaps everything."""
    children, fds = _children(), _fds()
    sb = make_env("mdp", "fork")
    try:
        sb.reset("agent-1", 0)
        snap = sb.snapshot()
        os.kill(sb.engine_pid, signal.SIGKILL)
        with pytest.raises(SandboxError):
            sb.step("option 1")
        sb.restore(snap)  # a fresh engine process from the frozen copy
        sb.step("option 1")
        sb.release(snap)
        assert sb.stats().live == 0
    finally:
        sb.close()
    assert _children() - children == set()
    assert _fds() == fds


class KillingTestPolicy(UniformTestPolicy):
    """A TEST POLICY: :class:`UniformTestPolicy` that SIGKILLs the engine process of
    ``victim()`` (a fork-backend sandbox) at its ``at``-th ``sample`` call, i.e. while trees are
    in flight and hold snapshots."""

    def __init__(self, tokenizer: object, actions: Sequence[str], at: int, victim) -> None:
        super().__init__(tokenizer, actions)
        self.at, self.victim, self.calls = at, victim, 0

    def sample(self, contexts, n=1, params=None):
        self.calls += 1
        if self.calls == self.at:
            os.kill(self.victim().engine_pid, signal.SIGKILL)
        return super().sample(contexts, n, params)


def test_an_engine_dying_mid_run_is_survived_without_leaks(tokenizer):
    """A fork-server sandbox's engine process killed mid-run: the rollout in flight fails and
    is started again from its snapshot (a frozen fork that outlived the engine), so both trees
    complete. Nothing leaks: no snapshot after the trees, no process left after close()."""
    children = _children()
    made: list[object] = []

    def factory():
        sb = make_env("mdp", "fork")
        made.append(sb)
        return sb

    # always "option 1" (never a blunder that ends the episode early): at the 5th call both
    # trees are on their backbone and hold two snapshots each (the root, one branch node)
    policy = KillingTestPolicy(tokenizer, ("option 1",), at=5, victim=lambda: made[0])
    eng = _engine(
        policy, tokenizer, factory, make_rule("every", k=2, max_branches=2), concurrency=2
    )
    try:
        trees = eng.run(_agent_tasks(2))
        assert [t.task for t in trees] == [t for t, _ in _agent_tasks(2)]
        assert eng.faults["retries"] >= 1 and eng.faults["failed_rollouts"] == 0
        assert sum(t.meta["compute"].retries for t in trees) == eng.faults["retries"]
        assert [t.meta["live_snapshots_after"] for t in trees] == [0, 0]
        for t in trees:  # the undone rollout left no partial path: every leaf is terminal
            assert all(t.nodes[leaf].terminal for leaf in t.leaves())
        trees = eng.run(_agent_tasks(2, offset=2))  # the pool works as before
        assert len(trees) == 2 and eng.faults["retries"] == 0
        assert [t.meta["live_snapshots_after"] for t in trees] == [0, 0]
    finally:
        eng.close()
    assert _children() - children == set()


@pytest.mark.env
def test_jvm_sandboxes_leave_no_process(tokenizer):
    """TextWorld-Express runs in a JVM child process: replay snapshots, trees, then close()."""
    children, fds = _children(), _fds()
    made: list[object] = []

    def factory():
        sb = make_env("twx")
        made.append(sb)
        return sb

    actions = ("look around", "inventory", "move north", "move east", "take coin", "xyzzy")
    policy = UniformTestPolicy(tokenizer, actions, seed=7)
    eng = _engine(
        policy,
        tokenizer,
        factory,
        make_rule("every", k=2, max_branches=2),
        max_steps=6,
        concurrency=2,
    )
    try:
        trees = eng.run([("coin/seed=1", 0), ("coin/seed=2", 0), ("coin/seed=3", 0)])
        assert [t.meta["live_snapshots_after"] for t in trees] == [0, 0, 0]
        assert len(_children() - children) == 2  # one JVM per sandbox
    finally:
        eng.close()
    assert _children() - children == set(), "a JVM outlived close()"
    assert _fds() == fds


# -- soak ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_policy(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bpo.policy.hf import HFPolicy
    from bpo.policy.models import init_model

    path = init_model(tmp_path_factory.mktemp("tiny"), hidden=64, layers=2, tokenizer="byte")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    return HFPolicy(model, tok, seed=0), tok


def _soak(eng: RolloutEngine, families: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """Run SOAK_TREES trees; return {reading: (value after tree 100, value after the last)}."""
    tasks = list_tasks("mdp", "train", families=families)
    readings: dict[str, tuple[int, int]] = {}
    at_100: dict[str, int] = {}
    children = _children()
    for start in range(0, SOAK_TREES, SOAK_BATCH):
        batch = [(tasks[(start + i) % len(tasks)], start + i) for i in range(SOAK_BATCH)]
        trees = eng.run(batch)
        live = [t.meta["live_snapshots_after"] for t in trees]
        assert live == [0] * SOAK_BATCH, f"live snapshots after trees {start}..: {live}"
        if start + SOAK_BATCH == 100:
            at_100 = {"rss": _rss(), "fds": _fds(), "threads": _status("Threads")}
    end = {"rss": _rss(), "fds": _fds(), "threads": _status("Threads")}
    assert _children() == children
    for key in at_100:
        readings[key] = (at_100[key], end[key])
    return readings


def _check_soak(readings: dict[str, tuple[int, int]]) -> None:
    rss0, rss1 = readings["rss"]
    growth = rss1 - rss0
    print(
        f"soak: RSS {rss0 / 2**20:.1f} MB after tree 100, {rss1 / 2**20:.1f} MB after tree "
        f"{SOAK_TREES} (growth {growth / 2**20:+.1f} MB); fds {readings['fds']}, "
        f"threads {readings['threads']}"
    )
    assert growth < RSS_BOUND, f"RSS grew by {growth / 2**20:.1f} MB between tree 100 and 1,000"
    assert readings["fds"][0] == readings["fds"][1], f"open file descriptors: {readings['fds']}"
    assert readings["threads"][0] == readings["threads"][1], f"threads: {readings['threads']}"


def test_soak_1000_trees_uniform_test_policy(tokenizer):
    policy = UniformTestPolicy(tokenizer, labels_of("agent-0"), seed=11)
    eng = _engine(
        policy,
        tokenizer,
        lambda: make_env("mdp"),
        make_rule("every", k=2, max_branches=2),
        concurrency=SOAK_BATCH,
    )
    try:
        _check_soak(_soak(eng, ("agent",)))
    finally:
        eng.close()


@pytest.mark.slow
def test_soak_1000_trees_tiny_hf_policy(hf_policy):
    """The real policy (prefix cache included). Its random text rarely names an action, so
    episodes end by truncation after ``max_steps``; kept short (3 turns, 4 tokens) for time."""
    policy, tok = hf_policy
    eng = _engine(
        policy,
        tok,
        lambda: make_env("mdp"),
        make_rule("every", k=2, max_branches=1),
        max_steps=3,
        max_new_tokens=4,
        concurrency=SOAK_BATCH,
    )
    try:
        _check_soak(_soak(eng, ("random", "agent", "chain")))
    finally:
        eng.close()
