"""Prefix-aware routing of sampling calls over several inference engines: the router's rules,
and the prefix-cache hit rate it keeps on real rollouts (a tiny transformers model in two
HFPolicy engines, in this process, behind RoutedPolicy; the Ray actors are in
tests/integration/test_cluster.py)."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

from bpo.branching import make_rule
from bpo.cluster.routing import PrefixRouter, RoutedPolicy, add_stats, prefix_hit_rate
from bpo.policy.hf import HFPolicy
from bpo.policy.models import init_model
from bpo.policy.parsing import parse_action
from bpo.policy.prompts import PromptBuilder
from bpo.policy.protocol import SamplingParams
from bpo.rollout import Budget, RolloutConfig, RolloutEngine
from bpo.sandbox import make_env


def test_router_keeps_a_tree_on_its_engine_and_balances_new_trees() -> None:
    r = PrefixRouter(3)
    a, b, c = (1, 2, 3), (1, 2, 4), (9, 9)
    ea, eb, ec = r.route(a), r.route(b), r.route(c)
    assert sorted([ea, eb, ec]) == [0, 1, 2]  # three new trees: one per engine
    assert r.route((*a, 5, 6)) == ea  # a later turn extends its earlier context
    assert r.route(a) == ea  # a fork samples again from the branch node's context
    assert r.route((*b, 7)) == eb and r.route((*c, 1, 2, 3)) == ec
    assert r.route((1, 2)) in range(3)  # a shorter context than any routed: a new tree
    assert r.affine == 4 and r.routed == 8
    r.reset()
    assert r.route((*a, 5, 6)) == 0 and r.affine == 0  # forgotten: routed as a new tree


def test_round_robin_ignores_prefixes() -> None:
    r = PrefixRouter(2, "round_robin")
    assert [r.route((1, 2)) for _ in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="valid: prefix, round_robin"):
        PrefixRouter(2, "random")


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = init_model(tmp_path_factory.mktemp("m"), hidden=64, layers=2, tokenizer="byte", seed=0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), (
        AutoTokenizer.from_pretrained(path)
    )


def _rollouts(policy, tok) -> None:
    engine = RolloutEngine(
        policy, PromptBuilder(tok, max_admissible=8),
        lambda raw, adm: parse_action(raw, adm).text, make_rule("every", k=2, max_branches=2),
        lambda: make_env("toy"),
        RolloutConfig(root_width=1, max_steps=5, budget=Budget("tokens", 300), concurrency=4),
        SamplingParams(max_new_tokens=8, temperature=1.0),
    )  # fmt: skip
    try:
        trees = engine.run([(f"keydoor-{i}", i) for i in range(1, 7)])
    finally:
        engine.close()
    assert len(trees) == 6


def _hit_rate(model, tok, engines: int, routing: str | None) -> float:
    local = lambda calls: [getattr(e, m)(*a) for e, m, a in calls]  # noqa: E731
    if routing is None:
        policy = HFPolicy(model, tok, seed=0)
    else:
        parts = [HFPolicy(model, tok, seed=i) for i in range(engines)]
        policy = RoutedPolicy(parts, tok, parts[0].stop_token_ids, local, routing)
    before = policy.stats()
    _rollouts(policy, tok)
    return prefix_hit_rate(before, policy.stats())


def test_prefix_routing_keeps_the_hit_rate_of_one_engine(model_and_tokenizer) -> None:
    model, tok = model_and_tokenizer
    one = _hit_rate(model, tok, 1, None)
    prefix = _hit_rate(model, tok, 3, "prefix")
    rr = _hit_rate(model, tok, 3, "round_robin")
    assert one > 0.5, one  # agent turns extend their context: most of it is cached
    assert prefix >= 0.97 * one, (prefix, one)
    assert rr < prefix - 0.1, (rr, prefix)  # turns that land elsewhere recompute the prefix


def test_stats_add_up() -> None:
    from bpo.policy.protocol import PolicyStats

    s = PolicyStats(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)
    total = add_stats([s, s])
    assert total.prefill_tokens == 10 and total.cache_hit_tokens == 16
    assert prefix_hit_rate(s, total) == pytest.approx(8 / 13)
    assert prefix_hit_rate(s, s) == 0.0
