"""Branch rules: decisions on hand-made branch points, causality labels and registry errors."""

import pytest

from bpo.branching import BRANCH_RULES, BranchPoint, make_rule


def test_registry_lists_rules_and_rejects_unknown():
    expected = {
        "entropy_quantile",
        "entropy_threshold",
        "every",
        "fixed_depths",
        "random",
        "tail",
        "none",
        "topk_backbone",
    }
    assert expected <= set(BRANCH_RULES.names())
    with pytest.raises(KeyError, match=r"valid names: .*entropy_quantile"):
        make_rule("entropy")


def test_entropy_threshold_and_limits():
    rule = make_rule("entropy_threshold", k=3, threshold=1.0, max_branches=1)
    assert rule.decide(BranchPoint(step=0, entropy=0.5)) == 1
    assert rule.decide(BranchPoint(step=1, entropy=1.5)) == 3
    assert rule.decide(BranchPoint(step=2, entropy=1.5, branches_so_far=1)) == 1
    assert rule.decide(BranchPoint(step=2, entropy=1.5, depth=1)) == 1  # forks do not branch
    assert rule.decide(BranchPoint(step=2, entropy=1.5, budget_left=0.0)) == 1


def test_entropy_quantile_uses_only_the_past():
    rule = make_rule("entropy_quantile", k=2, quantile=0.5, min_history=4)
    # no history yet: never branch during the first min_history decisions
    decisions = [rule.decide(BranchPoint(step=i, entropy=e)) for i, e in enumerate([1, 2, 3, 4])]
    assert decisions == [1, 1, 1, 1]
    # now the median of [1, 2, 3, 4] = 2.5 is the threshold
    assert rule.decide(BranchPoint(step=4, entropy=3.0)) == 2
    assert rule.decide(BranchPoint(step=5, entropy=2.0)) == 1
    rule.end_iteration()
    # next iteration: threshold from the previous iteration's history only
    assert rule.threshold == pytest.approx(2.5)  # median of [1, 2, 3, 4, 3, 2]
    assert rule.decide(BranchPoint(step=0, entropy=2.6)) == 2
    assert rule.decide(BranchPoint(step=1, entropy=2.4)) == 1
    assert rule.decide(BranchPoint(step=2, entropy=2.5)) == 2  # ties with the quantile branch


def test_fixed_depths_every_none():
    fixed = make_rule("fixed_depths", k=4, steps=[0, 3])
    assert [fixed.decide(BranchPoint(step=s, entropy=0.0)) for s in range(5)] == [4, 1, 1, 4, 1]
    every = make_rule("every", k=2)
    assert every.decide(BranchPoint(step=7, entropy=0.0)) == 2
    assert make_rule("none").decide(BranchPoint(step=0, entropy=9.0)) == 1


def test_random_and_tail_are_seeded():
    a = make_rule("random", k=2, p=0.5, seed=3)
    b = make_rule("random", k=2, p=0.5, seed=3)
    pts = [BranchPoint(step=s, entropy=0.0) for s in range(50)]
    da = [a.decide(p) for p in pts]
    assert da == [b.decide(p) for p in pts]
    assert 10 < sum(d == 2 for d in da) < 40
    tail = make_rule("tail", k=2, p_max=1.0, power=1.0, horizon=11, seed=0)
    assert tail.decide(BranchPoint(step=0, entropy=0.0)) == 1  # probability 0 at t=0
    assert tail.decide(BranchPoint(step=10, entropy=0.0)) == 2  # probability 1 at t=H-1
    with pytest.raises(ValueError, match="needs a horizon"):
        make_rule("tail").decide(BranchPoint(step=1, entropy=0.0))


def test_noncausal_ablation_is_labelled_and_selects_top_entropy():
    rule = make_rule("topk_backbone", k=3, b=2)
    assert rule.causal is False
    pts = [BranchPoint(step=s, entropy=e) for s, e in enumerate([0.1, 2.0, 0.3, 1.5, 1.9])]
    assert rule.select(pts) == {1: 3, 4: 3}
    with pytest.raises(TypeError, match="not causal"):
        rule.decide(pts[0])
    assert all(
        make_rule(n).causal for n in BRANCH_RULES.names() if n not in ("topk_backbone", "tail")
    )


def test_bad_options():
    with pytest.raises(ValueError, match="integer >= 2"):
        make_rule("every", k=1)
    with pytest.raises(ValueError, match=r"quantile must be in \(0, 1\)"):
        make_rule("entropy_quantile", quantile=1.5)
