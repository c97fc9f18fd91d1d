"""Learner: packed (token forest) log-probs and gradients equal the independent computation;
one update changes every trainable parameter."""

import itertools

import numpy as np
import pytest
import torch

from bpo.learner import Learner, LearnerConfig, NonFiniteError, token_logprobs
from bpo.logprobs import row_chunks
from bpo.packing import choose_layout, chunk_rows, layout_costs, pack_forest, pack_paths
from bpo.testing import random_tree, tiny_causal_lm
from bpo.token_terms import gae_terms
from bpo.tree import Tree, Turn

VOCAB = 64


tiny = tiny_causal_lm


def edge_logps(model, packed):
    logp, _, sel = token_logprobs(model, packed)
    out = {}
    for lp, s in zip(logp, sel, strict=True):
        out.setdefault(packed.edges[packed.actions.edge[s]], []).append(lp)
    return {k: torch.stack(v) for k, v in out.items()}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_forest_equals_independent_paths(arch, attn):
    rng = np.random.default_rng(1)
    trees = [random_tree(rng), random_tree(rng, prefix=5, k=2, depth=3)]
    model = tiny(arch, attn)
    forest = edge_logps(model, pack_forest(trees, max_row_tokens=10_000))
    assert pack_paths(trees).attention_mask is None  # right-padded causal rows: no mask
    paths = edge_logps(model, pack_paths(trees))
    assert forest.keys() == paths.keys()
    for key in forest:
        torch.testing.assert_close(forest[key], paths[key], atol=1e-5, rtol=1e-5)
    # and both equal a plain causal forward of one path, with no custom mask at all
    t = trees[0]
    leaf = t.leaves()[-1]
    ctx = t.context(t.nodes[leaf].parent)
    act = list(t.nodes[leaf].turn.action_ids)
    ids = torch.tensor([ctx + act])
    logits = model(input_ids=ids).logits[0, len(ctx) - 1 : -1]
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(act)[:, None]).squeeze(-1)
    torch.testing.assert_close(forest[(0, leaf)], ref, atol=1e-5, rtol=1e-5)


def test_forest_gradients_equal_independent():
    rng = np.random.default_rng(2)
    trees = [random_tree(rng)]
    grads = []
    for pack in (pack_forest, pack_paths):
        model = tiny()
        logp, _, _ = token_logprobs(model, pack(trees))
        logp.sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_forest_computes_each_prefix_once():
    rng = np.random.default_rng(3)
    trees = [random_tree(rng, prefix=100, k=4, depth=2)]
    forest, paths = pack_forest(trees), pack_paths(trees)
    unique = sum(len(n.obs_ids) + (len(n.turn.action_ids) if n.turn else 0) for n in trees[0].nodes)
    assert forest.computed_tokens == unique
    assert paths.computed_tokens > 3 * unique / 2
    assert choose_layout(trees) == "forest"


def test_context_reset_is_honoured():
    rng = np.random.default_rng(4)
    t = random_tree(rng, depth=3, k=2, reset_at=0)
    model = tiny()
    got = edge_logps(model, pack_forest([t]))
    assert got.keys() == edge_logps(model, pack_paths([t])).keys()
    for k, v in edge_logps(model, pack_paths([t])).items():
        torch.testing.assert_close(v, got[k], atol=1e-5, rtol=1e-5)
    for (_, node), lp in got.items():
        parent = t.nodes[node].parent
        ctx = t.context(parent)
        act = list(t.nodes[node].turn.action_ids)
        logits = model(input_ids=torch.tensor([ctx + act])).logits[0, len(ctx) - 1 : -1]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(act)[:, None]).squeeze(-1)
        torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("aggregation", ["tree", "token_mean", "sequence_mean"])
def test_one_update_changes_every_parameter(aggregation):
    rng = np.random.default_rng(5)
    trees = [random_tree(rng), random_tree(rng)]
    model = tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    learner = Learner(model, LearnerConfig(lr=1e-2, aggregation=aggregation, minibatches=2))
    m = learner.update(trees, "bpo")
    assert learner.updates == 2
    assert np.isfinite(m["loss/total"]) and m["learner/grad_norm"] > 0
    for n, p in model.named_parameters():
        assert not torch.equal(before[n], p.detach()), f"{n} did not change"


def test_nonfinite_update_is_skipped():
    rng = np.random.default_rng(6)
    trees = [random_tree(rng)]
    bad = trees[0].nodes[1].turn
    trees[0].nodes[1].turn = Turn(
        bad.action_ids,
        (float("nan"),) * len(bad.action_ids),
        bad.entropies,
        "a",
        bad.reward,
        bad.terminated,
    )
    model = tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    learner = Learner(model, LearnerConfig(lr=1e-2, max_bad_steps=3))
    m = learner.update(trees, "bpo")
    assert m["learner/skipped_nonfinite"] == 1.0 and learner.updates == 0
    for n, p in model.named_parameters():
        assert torch.equal(before[n], p.detach())


def test_nonfinite_updates_in_a_row_stop_with_the_cause():
    rng = np.random.default_rng(6)
    trees = [random_tree(rng)]
    bad = trees[0].nodes[1].turn
    trees[0].nodes[1].turn = Turn(bad.action_ids, (float("nan"),) * len(bad.action_ids),
                                  bad.entropies, "a", bad.reward, bad.terminated)  # fmt: skip
    learner = Learner(tiny(), LearnerConfig(lr=1e-2, max_bad_steps=3, epochs=2))
    learner.update(trees, "bpo")  # 2 bad steps: skipped, counted
    assert learner.bad_in_a_row == 2
    with pytest.raises(NonFiniteError, match=r"3 non-finite updates in a row \(loss nan"):
        learner.update(trees, "bpo")


def test_ppo_value_head_learns_returns():
    rng = np.random.default_rng(7)
    trees = [random_tree(rng, k=3, depth=2) for _ in range(2)]
    model = tiny()
    learner = Learner(model, LearnerConfig(lr=3e-2, epochs=1), critic=True)
    assert "value_head.weight" in dict(model.named_parameters())
    first = learner.update(trees, "ppo")
    for _ in range(30):
        last = learner.update(trees, "ppo")
    assert last["loss/value"] < 0.5 * first["loss/value"]
    # with the head's values, advantages are exactly GAE of the tree
    from bpo import estimators

    packed = learner.pack(trees)
    cfg = learner.config
    terms, _ = gae_terms(model, trees, packed, max_row_tokens=cfg.max_row_tokens,
                         gamma=cfg.gamma, lam=cfg.gae_lambda)  # fmt: skip
    hid = []
    with torch.no_grad():
        _, _, sel = token_logprobs(model, packed, slice(0, packed.num_rows), hidden=hid)
        v = model.value_head(hid[0]).squeeze(-1)
    values = np.zeros(len(trees[0]))
    for k, s in enumerate(sel):
        t, node = packed.edges[packed.actions.edge[s]]
        if t == 0:
            values[trees[0].nodes[node].parent] = v[k].item()
    adv, _ = estimators.gae(trees[0].parents(), trees[0].rewards(), values, gamma=1.0, lam=0.95)
    np.testing.assert_allclose(terms[0].advantage, adv, atol=1e-5)


def test_ppo_needs_a_critic():
    model = tiny()
    with pytest.raises(ValueError, match="critic=True"):
        Learner(model, LearnerConfig()).update([random_tree(np.random.default_rng(0))], "ppo")


def test_gradient_is_the_update_direction_without_a_step():
    rng = np.random.default_rng(8)
    trees = [random_tree(rng)]
    model = tiny()
    learner = Learner(model, LearnerConfig(lr=1e-2, max_grad_norm=1e9))
    before = [p.detach().clone() for p in model.parameters()]
    g = learner.gradient(trees, "bpo")
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert g.numel() == sum(p.numel() for p in model.parameters()) and g.norm() > 0
    # plain SGD with the same batch moves the weights by -lr * g
    sgd = Learner(model, LearnerConfig(lr=1e-2, max_grad_norm=1e9))
    sgd.optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    sgd.update(trees, "bpo")
    moved = torch.cat(
        [(p.detach() - b).reshape(-1) for p, b in zip(model.parameters(), before, strict=True)]
    )
    torch.testing.assert_close(moved, -1e-2 * g, atol=1e-6, rtol=1e-4)


def test_forest_shares_rows_up_to_the_largest_tree():
    rng = np.random.default_rng(8)
    trees = [random_tree(rng, prefix=40, k=3, depth=2)]
    trees += [random_tree(rng, prefix=3, k=2, depth=1) for _ in range(2)]
    packed = pack_forest(trees, max_row_tokens=10_000)
    assert packed.num_rows == 2  # the two small trees share the second row
    assert packed.input_ids.shape[1] == sum(
        len(n.obs_ids) + (len(n.turn.action_ids) if n.turn else 0) for n in trees[0].nodes
    )
    model = tiny()
    forest, paths = edge_logps(model, packed), edge_logps(model, pack_paths(trees))
    assert forest.keys() == paths.keys()
    for key in paths:
        torch.testing.assert_close(forest[key], paths[key], atol=1e-5, rtol=1e-5)


def test_rows_end_at_their_last_scored_token_longest_first():
    rng = np.random.default_rng(9)
    trees = [random_tree(rng, prefix=30, k=3, depth=2), random_tree(rng, prefix=4, k=2, depth=3)]
    for t in trees:  # a final observation after every leaf: nothing reads it
        for leaf in t.leaves():
            t.nodes[leaf].obs_ids += tuple(rng.integers(1, VOCAB, 7).tolist())
    for packed in (pack_paths(trees), pack_forest(trees)):
        lengths = packed.row_lengths
        assert list(lengths) == sorted(lengths, reverse=True)
        assert packed.input_ids.shape[1] == lengths[0]
        for r, n in enumerate(lengths):  # the row's last token is a scored action token
            assert n - 1 == max(p for p, row in zip(packed.actions.pred, packed.actions.row,
                                                      strict=True) if row == r) + 1  # fmt: skip
    assert pack_forest(trees).computed_tokens < sum(
        len(n.obs_ids) + (len(n.turn.action_ids) if n.turn else 0) for t in trees for n in t.nodes
    )


@pytest.mark.parametrize("layout", ["forest", "paths"])
def test_row_chunks_padded_to_their_own_width_give_the_same_logprobs(layout):
    rng = np.random.default_rng(10)
    trees = [random_tree(rng, prefix=int(rng.integers(2, 40)), k=2, depth=2) for _ in range(5)]
    pack = pack_paths if layout == "paths" else (lambda ts: pack_forest(ts, max_row_tokens=50))
    packed = pack(trees)
    model = tiny()
    whole = edge_logps(model, packed)  # one chunk, padded to the longest row
    chunks = row_chunks(packed, 60)
    assert len(chunks) > 2 and chunks[0].start == 0 and chunks[-1].stop == packed.num_rows
    assert all(a.stop == b.start for a, b in itertools.pairwise(chunks))
    for c in chunks:  # within the budget, unless one row alone exceeds it
        width = int(packed.row_lengths[c].max())
        assert (c.stop - c.start) * width <= 60 or c.stop - c.start == 1
    widths = {int(packed.row_lengths[c].max()) for c in chunks}
    assert len(widths) > 1  # the later chunks are narrower than the first
    parts: dict = {}
    for c in chunks:
        logp, _, sel = token_logprobs(model, packed, c)
        for lp, s in zip(logp, sel, strict=True):
            parts.setdefault(packed.edges[packed.actions.edge[s]], []).append(lp)
    assert parts.keys() == whole.keys()
    for key in whole:
        torch.testing.assert_close(torch.stack(parts[key]), whole[key], atol=1e-5, rtol=1e-5)


def test_chunk_rows_and_layout_costs():
    assert chunk_rows([], 10) == []
    assert chunk_rows([20, 4, 3, 3, 2], 10) == [slice(0, 1), slice(1, 3), slice(3, 5)]
    rng = np.random.default_rng(11)
    shared = [random_tree(rng, prefix=200, k=4, depth=2)]  # a long prompt, short branches
    costs = layout_costs(shared, pair_cost=1e-3, max_row_tokens=2048)
    assert costs["forest"] < costs["paths"] and choose_layout(shared, 1e-3, 2048) == "forest"
    group = Tree("g")  # GRPO's group: 8 long episodes that share a 2-token prompt
    group.add_root([1, 2])
    for _ in range(8):
        u = group.add_child(0, Turn((3, 4), (-0.1, -0.1), (0.5, 0.5), "a", 0.0), [5] * 300)
        group.add_child(u, Turn((6,), (-0.1,), (0.5,), "a", 1.0, terminated=True), [])
    costs = layout_costs([group], pair_cost=1e-3, max_row_tokens=2048)
    assert costs["paths"] < costs["forest"] and choose_layout([group], 1e-3, 2048) == "paths"


def test_warmup_ramps_the_learning_rate_linearly():
    rng = np.random.default_rng(3)
    trees = [random_tree(rng), random_tree(rng)]
    cfg = LearnerConfig(lr=1e-3, warmup_updates=4, minibatches=2)
    learner = Learner(tiny(), cfg)
    seen = []
    for _ in range(3):
        seen.append(learner.update(trees, "bpo")["learner/lr"])
    # updates 1-2, 3-4, 5-6: the lr of the last step of each iteration
    assert seen == pytest.approx([1e-3 * 2 / 4, 1e-3, 1e-3])
    with pytest.raises(ValueError, match="warmup_updates"):
        LearnerConfig(warmup_updates=-1)


def test_lr_schedules_decay_towards_zero_over_the_run_after_the_warmup():
    model = tiny()
    for schedule, after_warmup in [
        ("constant", [1.0, 1.0, 1.0, 1.0]),
        ("linear", [1.0, 0.75, 0.5, 0.25]),
        ("cosine", [1.0, 0.5 * (1 + np.cos(np.pi / 4)), 0.5, 0.5 * (1 + np.cos(3 * np.pi / 4))]),
    ]:
        cfg = LearnerConfig(lr=1.0, warmup_updates=2, lr_schedule=schedule)
        learner = Learner(model, cfg, total_updates=6)
        seen = []
        for u in range(7):  # one past the run's end stays at the end's rate
            learner.updates = u
            seen.append(learner.lr_now())
        end = after_warmup[-1] if schedule == "constant" else 0.0
        assert seen == pytest.approx([0.5, 1.0, *after_warmup, end]), schedule
    learner = Learner(model, LearnerConfig(lr_schedule="linear"))
    with pytest.raises(ValueError, match="total_updates"):
        learner.lr_now()
    with pytest.raises(ValueError, match="valid: constant, linear, cosine"):
        LearnerConfig(lr_schedule="step")


def test_kl_to_the_reference_is_zero_until_the_policy_moves():
    rng = np.random.default_rng(4)
    trees = [random_tree(rng)]
    model = tiny()
    ref = tiny()
    ref.load_state_dict(model.state_dict())
    learner = Learner(model, LearnerConfig(lr=1e-2, kl_coef=0.1, epochs=2), ref_model=ref)
    m = learner.update(trees, "bpo")
    # epoch 1 at the reference (KL 0), epoch 2 after one step (KL > 0): the mean is > 0
    assert m["loss/kl"] > 0
    with pytest.raises(ValueError, match="reference model"):
        Learner(tiny(), LearnerConfig(kl_coef=0.1))


def test_the_reference_is_forwarded_once_per_update_not_per_epoch():
    rng = np.random.default_rng(5)
    trees = [random_tree(rng) for _ in range(4)]
    calls = []
    ref = tiny()
    ref.register_forward_hook(lambda *_: calls.append(1))
    cfg = LearnerConfig(lr=1e-2, kl_coef=0.1, epochs=3, minibatches=2, layout="paths")
    learner = Learner(tiny(), cfg, ref_model=ref)
    learner.update(trees, "bpo")
    assert len(calls) == 2  # one row chunk per minibatch, once for all three epochs
    assert learner._ref_logp is None  # nothing kept between updates
    learner.update(trees, "bpo")
    assert len(calls) == 4
