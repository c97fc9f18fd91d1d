"""The budget's cost model: estimates come from recent iterations' finished trees only, and
its state survives a checkpoint."""

import json

import pytest

from bpo.rollout.budget import Compute, CostModel


def _finish(costs: CostModel, tokens: int, turns: int, width: int = 2) -> None:
    for _ in range(width):
        costs.observe(turns, tokens // width, turns)
    c = Compute(generated_tokens=tokens, sandbox_steps=turns * width, leaves=width,
                episodes=width)  # fmt: skip
    costs.observe_tree(c, wanted=width, root_width=width)


def test_costs_follow_the_policy_not_the_whole_run():
    costs = CostModel(max_steps=12, max_new_tokens=10, history=2)
    assert costs.root_child_cost("tokens") is None  # no finished tree yet
    assert costs.turns_from(0) == 6.0  # half the step limit
    for _ in range(3):  # early iterations: long, expensive episodes
        _finish(costs, tokens=400, turns=10)
        costs.end_iteration()
    for it in range(3):  # the policy got efficient: cheap episodes
        _finish(costs, tokens=40, turns=2)
        if it == 0:  # this iteration's tree and the 2 iterations before it: mixed
            assert 20 < costs.root_child_cost("tokens") < 200
        costs.end_iteration()
    # only the last 2 finished iterations and the current (empty) one count now
    assert costs.root_child_cost("tokens") == pytest.approx(20.0)
    assert costs.turns_from(0) == pytest.approx(2.0)
    costs.end_iteration()  # an iteration with no finished tree forgets nothing
    assert costs.root_child_cost("tokens") == pytest.approx(20.0)


def test_state_round_trips_through_json_and_reads_old_checkpoints():
    costs = CostModel(max_steps=12, max_new_tokens=10)
    _finish(costs, tokens=100, turns=4)
    costs.end_iteration()
    _finish(costs, tokens=60, turns=3)
    again = CostModel(max_steps=12, max_new_tokens=10)
    again.load_state_dict(json.loads(json.dumps(costs.state_dict())))
    assert again.trees == costs.trees and again.lengths == costs.lengths
    assert again.root_child_cost("steps") == costs.root_child_cost("steps")
    old = {"lengths": [4, 4], "per_turn": [12.5, 12.5], "trees": [[100, 8, 2, 2, 2, 2]]}
    again.load_state_dict(old)  # a checkpoint written before the per-iteration record
    assert again.lengths == [4, 4] and again.root_child_cost("tokens") == pytest.approx(50.0)
