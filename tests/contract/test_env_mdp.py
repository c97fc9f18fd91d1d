"""The ``mdp`` sandbox: contract check on every local backend, tasks, and agreement with the
tabular MDP it wraps (transitions, calibrated success draws, expert = argmax of exact Q)."""

from __future__ import annotations

import numpy as np
import pytest

from bpo.analysis.mdp import exact
from bpo.sandbox import check_sandbox, list_tasks, make_env
from bpo.sandbox.envs.mdp import build_task

TASKS = ["agent-1", "chain-2", "random-3"]


@pytest.mark.parametrize("backend", ["auto", "native", "replay", "pickle", "fork"])
def test_mdp_sandbox_passes_the_contract_check(backend):
    report = check_sandbox(lambda: make_env("mdp", backend), TASKS)
    assert [p.name for p in report.properties][-1] == "tree"
    assert report.snapshots > 0 and report.restores > 0


def test_task_splits_and_errors():
    train, valid, test = (list_tasks("mdp", s) for s in ("train", "valid", "test"))
    assert len(train) == 180 and len(valid) == 60 and len(test) == 60
    assert not set(train) & set(test) and "agent-60" in valid
    assert list_tasks("mdp", "test", families=("chain",))[0] == "chain-80"
    with pytest.raises(ValueError, match="valid splits: train, valid, test"):
        list_tasks("mdp", "dev")
    with pytest.raises(ValueError, match="family one of random, agent, chain, trap, budget_trap"):
        build_task("grid-1")


def test_steps_follow_the_mdp_and_invalid_text_changes_nothing():
    mdp = build_task("chain-2")
    with make_env("mdp") as sb:
        obs = sb.reset("chain-2", 0)
        assert obs.admissible == ("go left", "stay", "go right") and "position 0" in obs.text
        state = 0
        fp = sb.fingerprint()
        res = sb.step("fly away")
        assert res.observation.text.startswith("Nothing happens.") and sb.fingerprint() != fp
        assert res.info["mdp_state"] == state and res.reward == 0
        for a in [2, 2, 1, 0, 2, 2, 2, 2]:
            res = sb.step(obs.admissible[a])
            state = int(mdp.next_state[state, a])
            assert res.info["mdp_state"] == state
            assert res.info["anchor"] == int(mdp.fingerprint[state])
        assert res.terminated and res.observation.done and mdp.terminal[state]
        assert res.reward in (0.0, 1.0)
        again = sb.step("stay")
        assert again.reward == 0 and again.terminated


def test_success_draws_are_calibrated_over_seeds():
    mdp = build_task("agent-1")
    with make_env("mdp") as sb:
        rewards = []
        for seed in range(1500):
            sb.reset("agent-1", seed)
            state, total = 0, 0.0
            while not mdp.terminal[state]:
                res = sb.step("option 1")  # always action 0: proceed, first route
                state = int(mdp.next_state[state, 0])
                total += res.reward
            rewards.append(total)
    p = float(mdp.terminal_reward[state])
    assert 0.05 < p < 0.95
    se = np.sqrt(p * (1 - p) / len(rewards))
    assert abs(np.mean(rewards) - p) < 4 * se


def test_expert_action_is_the_argmax_of_the_exact_q():
    mdp = build_task("random-3")
    q = exact(mdp).q
    with make_env("mdp") as sb:
        sb.reset("random-3", 0)
        assert sb.expert_action() == ("choose a", "choose b", "choose c")[int(np.argmax(q[0]))]
