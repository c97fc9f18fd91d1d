"""Losses: values and gradients against a float64 reference written out token by token."""

import math

import pytest
import torch

from bpo.losses import aggregate, kl_k3, policy_loss


def _reference(logp, old, adv, mask, w, seg, clip, num_trees, mode):
    """Plain-Python float64 PPO-clip surrogate with per-token weights."""
    total, wsum = 0.0, 0.0
    per_seg: dict[int, list[float]] = {}
    for i in range(len(logp)):
        if not mask[i]:
            continue
        ratio = math.exp(logp[i] - old[i])
        clipped = min(max(ratio, 1 - clip), 1 + clip)
        loss = max(-adv[i] * ratio, -adv[i] * clipped)
        total += w[i] * loss
        wsum += w[i]
        per_seg.setdefault(seg[i], []).append(w[i] * loss)
    if mode == "tree":
        return total / num_trees
    if mode == "token_mean":
        return total / wsum
    return sum(sum(v) / len(v) for v in per_seg.values()) / num_trees


@pytest.mark.parametrize("mode", ["tree", "token_mean", "sequence_mean"])
def test_policy_loss_value_and_grad_match_float64_reference(mode):
    g = torch.Generator().manual_seed(0)
    n = 40
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    logp = (old + 0.4 * torch.randn(n, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, generator=g) > 0.2).to(torch.float64)
    seg = torch.arange(n) // 7
    w = (1.0 / (1 + seg)).to(torch.float64)
    out = policy_loss(
        logp.float(),
        old.float(),
        adv.float(),
        mask.float(),
        w.float(),
        clip_low=0.2,
        aggregation=mode,
        num_trees=3,
        segment_ids=seg,
    )
    ref = _reference(
        logp.tolist(),
        old.tolist(),
        adv.tolist(),
        mask.tolist(),
        w.tolist(),
        seg.tolist(),
        0.2,
        3,
        mode,
    )
    assert out.loss.item() == pytest.approx(ref, rel=1e-5, abs=1e-6)
    # gradient: finite differences of the float64 reference
    (grad,) = torch.autograd.grad(out.loss, logp)
    eps = 1e-6
    for i in range(0, n, 5):
        lp = logp.detach().tolist()
        lp[i] += eps
        up = _reference(
            lp, old.tolist(), adv.tolist(), mask.tolist(), w.tolist(), seg.tolist(), 0.2, 3, mode
        )
        lp[i] -= 2 * eps
        dn = _reference(
            lp, old.tolist(), adv.tolist(), mask.tolist(), w.tolist(), seg.tolist(), 0.2, 3, mode
        )
        assert grad[i].item() == pytest.approx((up - dn) / (2 * eps), abs=1e-4)


def test_on_policy_gradient_is_weighted_advantage():
    # At ratio 1 the surrogate's gradient w.r.t. logp is -w * A / num_trees per action token.
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 3.0])
    w = torch.tensor([0.5, 0.25, 1.0])
    mask = torch.tensor([1.0, 1.0, 0.0])
    out = policy_loss(logp, logp.detach(), adv, mask, w, num_trees=2)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([-0.25, 0.25, 0.0]))
    assert out.clip_frac.item() == 0.0
    assert out.ratio_mean.item() == pytest.approx(1.0)


def test_clipping_stops_gradient_beyond_the_trust_region():
    old = torch.zeros(2)
    logp = torch.tensor([0.5, -0.5], requires_grad=True)  # ratios e^0.5 > 1.2, e^-0.5 < 0.8
    adv = torch.tensor([1.0, -1.0])
    out = policy_loss(logp, old, adv, torch.ones(2), num_trees=1)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.zeros(2))
    assert out.clip_frac.item() == 1.0


def test_kl_k3_and_entropy_terms():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    ent = torch.tensor([0.7, 0.3])
    out = policy_loss(
        logp,
        logp.detach(),
        torch.zeros(2),
        torch.ones(2),
        ref_logp=ref,
        kl_coef=0.1,
        entropy=ent,
        entropy_coef=0.01,
        aggregation="token_mean",
    )
    k3 = [math.exp(r) - r - 1 for r in (-0.5, 1.0)]
    assert out.kl.item() == pytest.approx(sum(k3) / 2, rel=1e-6)
    assert out.entropy.item() == pytest.approx(0.5, rel=1e-6)
    assert out.loss.item() == pytest.approx(0.1 * sum(k3) / 2 - 0.01 * 0.5, rel=1e-5)
    assert kl_k3(ref, ref).abs().max().item() == 0.0


def test_dual_clip_bounds_negative_advantages():
    old = torch.zeros(1)
    logp = torch.tensor([2.0])  # ratio e^2 ~ 7.4
    out = policy_loss(logp, old, torch.tensor([-1.0]), torch.ones(1), dual_clip=3.0, num_trees=1)
    assert out.pg_loss.item() == pytest.approx(3.0)


def test_errors_name_the_problem():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="shape mismatch"):
        policy_loss(x, torch.zeros(2), x, x)
    with pytest.raises(ValueError, match="valid: tree, token_mean, sequence_mean"):
        aggregate(x, x, x, "mean", num_trees=1)
    with pytest.raises(ValueError, match="needs num_trees"):
        aggregate(x, x, x, "tree")
    with pytest.raises(ValueError, match="needs segment_ids"):
        aggregate(x, x, x, "sequence_mean", num_trees=1)
