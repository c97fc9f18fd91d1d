"""MDP families for the estimator studies, one registry (``make_mdp("agent", horizon=20)``).

* ``random``: a full tree MDP (state = history) with random logits and random leaf means.
* ``agent``: long episodes whose success hinges on a few uncertain, irreversible decisions; the
  policy is confident elsewhere and an occasional blunder ends the episode with reward 0.
* ``chain``: a walk on a line whose state is the position (state aliasing: many histories reach
  one state; one logit row per position), so GiGPO's anchor-state groups are non-trivial.
* ``trap``: a tiny MDP where the future entropy depends on the current action, built so that
  the non-causal ``topk_backbone`` rule shows a large bias.
* ``budget_trap``: the episode's length reveals its outcome, built so that a budget that drops
  queued forks once spent shows a large bias.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bpo.analysis.mdp import MDPBuilder, TabularMDP
from bpo.registry import Registry

__all__ = ["FAMILIES", "agent", "budget_trap", "chain", "make_mdp", "random_tree", "trap"]

FAMILIES: Registry[Callable[..., TabularMDP]] = Registry("MDP family")


def make_mdp(family: str, **options: Any) -> TabularMDP:
    """Build an MDP of a registered family with the given options."""
    return FAMILIES.get(family)(**options)


def _terminal_mean(rng: np.random.Generator, noise: str) -> float:
    return float(rng.uniform(0.0, 1.0)) if noise == "bernoulli" else float(rng.normal())


@FAMILIES.register("random")
def random_tree(
    seed: int = 0,
    horizon: int = 3,
    actions: int = 3,
    noise: str = "bernoulli",
    step_rewards: bool = False,
    logit_scale: float = 1.0,
    noise_scale: float = 1.0,
) -> TabularMDP:
    """Every history of length < ``horizon`` is a state with ``actions`` actions.

    Leaf means are U(0, 1) (Bernoulli noise) or N(0, 1) (``"gaussian"`` with ``noise_scale``, or
    ``"none"``); with ``step_rewards`` every edge also pays a N(0, 0.3^2) deterministic reward.
    """
    rng = np.random.default_rng(seed)
    b = MDPBuilder(actions)
    frontier = [b.add(0)]
    for t in range(horizon):
        nxt = []
        for s in frontier:
            for a in range(actions):
                last = t + 1 == horizon
                tm = _terminal_mean(rng, noise) if last else 0.0
                s2 = b.add(t + 1, terminal=last, terminal_reward=tm)
                b.link(s, a, s2, float(rng.normal(0.0, 0.3)) if step_rewards else 0.0)
                nxt.append(s2)
        frontier = nxt
    logits = rng.normal(0.0, logit_scale, size=(len(b.param_keys()), actions))
    desc = f"random tree MDP: H={horizon}, A={actions}, {noise} leaves" + (
        ", step rewards" if step_rewards else ""
    )
    return b.build(
        f"random-h{horizon}a{actions}-{noise}" + ("-step" if step_rewards else "") + f"-s{seed}",
        logits,
        noise=noise,
        noise_scale=noise_scale if noise == "gaussian" else 0.0,
        description=desc,
    )


@FAMILIES.register("agent")
def agent(
    seed: int = 0,
    horizon: int = 16,
    decisions: Sequence[int] = (3, 10),
    options: int = 2,
    blunder: float = 0.03,
    noise: str = "bernoulli",
    decision_scale: float = 0.5,
    base: float = 0.9,
    worst: float = 0.1,
    step_cost: float = 0.0,
) -> TabularMDP:
    """An agent task of ``horizon`` steps, decided by a few uncertain irreversible choices.

    * at the steps in ``decisions`` the agent picks one of ``options`` routes; one route keeps
      the chance of success, the others multiply it by a factor in U(``worst``, 0.7); the
      policy is uncertain there (logits N(0, ``decision_scale``^2) per history);
    * at every other step action 0 proceeds and the other actions (total probability
      ``blunder``) are irreversible blunders that end the episode with reward 0;
    * an episode that reaches the horizon succeeds with probability ``base`` times the product
      of its route factors (reward 1 on success for ``"bernoulli"``, the mean for ``"none"``);
    * ``step_cost`` is paid on every step (per-step rewards).

    The state is the history (a tree MDP); it only branches at decisions and blunders, so long
    horizons stay enumerable.
    """
    if options < 2:
        raise ValueError("options must be >= 2")
    bad = [d for d in decisions if not 0 <= d < horizon]
    if bad:
        raise ValueError(f"decision steps {bad} are outside 0..{horizon - 1}")
    if noise == "gaussian":
        raise ValueError("the agent family supports noise 'bernoulli' or 'none'")
    rng = np.random.default_rng(seed)
    dec = sorted(set(int(d) for d in decisions))
    factors = {}
    for d in dec:
        f = rng.uniform(worst, 0.7, size=options)
        f[rng.integers(options)] = 1.0
        factors[d] = f
    proceed = np.log((1.0 - blunder) / (blunder / (options - 1)))
    confident = np.zeros(options)
    confident[0] = proceed
    b = MDPBuilder(options)
    logits: dict[object, np.ndarray] = {}
    frontier = [(b.add(0), 1.0)]
    for t in range(horizon):
        nxt = []
        for s, p in frontier:
            last = t + 1 == horizon
            if t in factors:
                logits[("state", s)] = rng.normal(0.0, decision_scale, size=options)
                for a in range(options):
                    p2 = p * factors[t][a]
                    s2 = b.add(t + 1, terminal=last, terminal_reward=base * p2 if last else 0.0)
                    b.link(s, a, s2, -step_cost if step_cost else 0.0)
                    nxt.append((s2, p2))
            else:
                logits[("state", s)] = confident
                s2 = b.add(t + 1, terminal=last, terminal_reward=base * p if last else 0.0)
                b.link(s, 0, s2, -step_cost if step_cost else 0.0)
                nxt.append((s2, p))
                for a in range(1, options):
                    dead = b.add(t + 1, terminal=True, terminal_reward=0.0)
                    b.link(s, a, dead, -step_cost if step_cost else 0.0)
        frontier = nxt
    dstr = "-".join(str(d) for d in dec) or "none"
    return b.build(
        f"agent-h{horizon}-d{dstr}-o{options}-{noise}" + (f"-c{step_cost:g}" if step_cost else ""),
        logits,
        noise=noise,
        description=(
            f"agent MDP: H={horizon}, uncertain irreversible decisions at steps {dec} "
            f"({options} routes), blunder prob {blunder} elsewhere, {noise} success reward"
        ),
    )


@FAMILIES.register("chain")
def chain(
    seed: int = 0,
    length: int = 5,
    horizon: int = 8,
    noise: str = "bernoulli",
    logit_scale: float = 0.7,
) -> TabularMDP:
    """A walk on positions 0..length-1 (actions left, stay, right) for ``horizon`` steps.

    The state is (step, position) but the policy and the fingerprint see only the position
    (one logit row per position: state aliasing). The terminal reward has mean
    0.1 + 0.8 * position / (length - 1).
    """
    rng = np.random.default_rng(seed)
    b = MDPBuilder(3)
    ids: dict[tuple[int, int], int] = {(0, 0): b.add(0, param_key=0, fingerprint_key=0)}
    for t in range(horizon):
        last = t + 1 == horizon
        for pos in range(length):
            s = ids.get((t, pos))
            if s is None:
                continue
            for a, move in enumerate((-1, 0, 1)):
                p2 = min(length - 1, max(0, pos + move))
                if (t + 1, p2) not in ids:
                    mean = 0.1 + 0.8 * p2 / (length - 1) if last else 0.0
                    ids[(t + 1, p2)] = b.add(
                        t + 1,
                        terminal=last,
                        terminal_reward=mean,
                        param_key=p2,
                        fingerprint_key=p2,
                    )
                b.link(s, a, ids[(t + 1, p2)])
    keys = b.param_keys()
    logits = {k: rng.normal(0.0, logit_scale, size=3) for k in keys}
    return b.build(
        f"chain-l{length}h{horizon}-{noise}-s{seed}",
        logits,
        noise=noise,
        description=f"aliased chain: {length} positions, H={horizon}, policy per position",
    )


@FAMILIES.register("trap")
def trap(k_entropy: float = 0.7) -> TabularMDP:
    """Three steps where the action at step 1 decides the entropy at step 2 (topk's trap).

    Step 0: two actions, uniform. Step 1 (both states): pi = (``k_entropy``, 1 - k_entropy).
    Action 0 leads to a uniform (high-entropy) step-2 state, action 1 to an almost
    deterministic one. Picking the top-1 entropy step of a finished backbone therefore branches
    at step 1 only when the backbone chose action 1 there: its action is no longer an i.i.d.
    sibling. Deterministic leaf rewards.
    """
    b = MDPBuilder(2)
    root = b.add(0)
    logits: dict[object, np.ndarray] = {("state", root): np.zeros(2)}
    lo = np.log(k_entropy / (1 - k_entropy))
    leaf_means = iter([1.0, 0.0, 0.2, 0.6, 0.0, 1.0, 0.9, 0.3])
    for a0 in range(2):
        s1 = b.add(1)
        b.link(root, a0, s1)
        logits[("state", s1)] = np.array([lo, 0.0])
        for a1 in range(2):
            s2 = b.add(2)
            b.link(s1, a1, s2)
            logits[("state", s2)] = np.zeros(2) if a1 == 0 else np.array([0.0, 2.0])
            for a2 in range(2):
                leaf = b.add(3, terminal=True, terminal_reward=next(leaf_means))
                b.link(s2, a2, leaf)
    return b.build("trap", logits, description="future entropy depends on the action (topk trap)")


@FAMILIES.register("budget_trap")
def budget_trap(horizon: int = 8) -> TabularMDP:
    """An episode's length reveals its outcome: action 0 at the root starts a long episode
    that succeeds (reward 1 after ``horizon`` steps), action 1 ends it at once (reward 0).

    A budget that drops queued forks once spent (``budget_mode="engine"``) then keeps or drops
    the forks of a root branch depending on what the backbone's own action did.
    """
    b = MDPBuilder(2)
    root = b.add(0)
    s = b.add(1)
    b.link(root, 0, s)
    b.link(root, 1, b.add(1, terminal=True, terminal_reward=0.0))
    for t in range(2, horizon + 1):
        last = t == horizon
        s2 = b.add(t, terminal=last, terminal_reward=1.0 if last else 0.0)
        b.link(s, 0, s2)
        b.link(s, 1, s2)
        s = s2
    logits = {k: np.zeros(2) for k in b.param_keys()}
    return b.build(f"budget_trap-h{horizon}", logits, description="episode length = outcome")
