"""Tabular finite-horizon MDPs with exact values and exact policy gradients.

An MDP here is a time-layered DAG of states with deterministic transitions: every state ``s``
has a step index ``step[s]``, every non-terminal state has the same ``A`` actions, and action
``a`` leads to ``next_state[s, a]`` at step ``step[s] + 1``. When the state is the whole action
history the DAG is a tree (the "tree MDPs"); when several histories reach one state the MDP has
*state aliasing* (a chain or grid position), which is what gives GiGPO non-trivial step groups.

Rewards: a deterministic reward ``step_reward[s, a]`` on every edge plus, on the edge into a
terminal state ``s'``, a terminal reward with mean ``terminal_reward[s']`` that is either exact
(``noise="none"``), Bernoulli (``"bernoulli"``: 1 with probability equal to the mean) or
Gaussian (``"gaussian"``: mean + ``noise_scale`` * N(0, 1)).

Policy: softmax over one logit row per parameter group, ``logits[param_of[s]]``; with one row
per state (tree MDPs) that is "one logit vector per history". The gradient of J with respect
to all logits is exact (a backward pass for V/Q and a forward pass for occupancies)::

    dJ / dlogits[p, b] = sum_{s: param_of[s] = p} rho(s) * pi(b|s) * (Q(s, b) - V(s))

and :func:`enumerate_gradient` recomputes it from the trajectory sum for small MDPs (a check).
The families live in :mod:`bpo.analysis.families`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = [
    "NOISES",
    "Exact",
    "MDPBuilder",
    "TabularMDP",
    "enumerate_gradient",
    "exact",
    "prefix_share",
    "state_entropy",
    "with_action_entropy",
]

NOISES = ("none", "bernoulli", "gaussian")


@dataclass(frozen=True, eq=False)
class TabularMDP:
    """A finite-horizon tabular MDP with deterministic transitions and a study policy."""

    name: str
    next_state: np.ndarray  # [S, A] int64; -1 in terminal rows
    step_reward: np.ndarray  # [S, A] float64; deterministic reward of action a in s
    terminal: np.ndarray  # [S] bool
    terminal_reward: np.ndarray  # [S] float64; mean reward paid on the edge into a terminal s
    step: np.ndarray  # [S] int64; actions taken before reaching s (root = 0)
    param_of: np.ndarray  # [S] int64; logit row of s (-1 for terminal states)
    fingerprint: np.ndarray  # [S] int64; the sandbox-visible identity of s (GiGPO anchors)
    logits: np.ndarray  # [P, A] float64; the policy at which the MDP is studied
    noise: str = "none"
    noise_scale: float = 0.0
    description: str = ""
    action_entropy: np.ndarray | None = None  # [S, A] entropy of each action's own tokens

    def __post_init__(self) -> None:
        s, a = self.next_state.shape
        if self.noise not in NOISES:
            raise ValueError(f"noise must be one of {NOISES}, got {self.noise!r}")
        live = ~self.terminal
        if self.terminal[0]:
            raise ValueError("state 0 (the initial state) must not be terminal")
        nxt = self.next_state[live]
        if np.any(nxt <= np.flatnonzero(live)[:, None]) or np.any(nxt >= s):
            raise ValueError("transitions must go to a state with a larger index (a DAG in order)")
        if np.any(self.step[nxt] != self.step[live][:, None] + 1):
            raise ValueError("every transition must advance the step index by exactly one")
        if np.any(self.param_of[live] < 0) or np.any(self.param_of[live] >= len(self.logits)):
            raise ValueError("param_of must map every live state to a row of logits")
        if self.logits.shape[1] != a:
            raise ValueError(f"logits have {self.logits.shape[1]} columns for {a} actions")
        if self.noise == "bernoulli":
            tr = self.terminal_reward[self.terminal]
            if np.any((tr < 0) | (tr > 1)):
                raise ValueError("Bernoulli terminal rewards need means in [0, 1]")

    @property
    def num_states(self) -> int:
        return int(self.next_state.shape[0])

    @property
    def num_actions(self) -> int:
        return int(self.next_state.shape[1])

    @property
    def num_params(self) -> int:
        """Number of logit rows (the gradient has ``num_params * num_actions`` coordinates)."""
        return int(self.logits.shape[0])

    @property
    def horizon(self) -> int:
        """The largest step index: every episode ends by then."""
        return int(self.step.max())

    def probs(self, logits: np.ndarray | None = None) -> np.ndarray:  # [S, A]
        """pi(a|s) for every state (uniform rows for terminal states, never used)."""
        lg = self.logits if logits is None else logits
        rows = lg[np.maximum(self.param_of, 0)]  # [S, A]
        z = np.exp(rows - rows.max(axis=1, keepdims=True))
        return z / z.sum(axis=1, keepdims=True)

    def with_logits(self, logits: np.ndarray) -> TabularMDP:
        """The same MDP studied at another policy."""
        return TabularMDP(
            self.name,
            self.next_state,
            self.step_reward,
            self.terminal,
            self.terminal_reward,
            self.step,
            self.param_of,
            self.fingerprint,
            np.asarray(logits, dtype=np.float64),
            self.noise,
            self.noise_scale,
            self.description,
            self.action_entropy,
        )

    def reward_variance(self) -> np.ndarray:  # [S]
        """Variance of the terminal reward paid on the edge into each state (0 if not terminal)."""
        m = np.where(self.terminal, self.terminal_reward, 0.0)
        if self.noise == "bernoulli":
            return m * (1.0 - m)
        if self.noise == "gaussian":
            return np.where(self.terminal, self.noise_scale**2, 0.0)
        return np.zeros_like(m)


def state_entropy(mdp: TabularMDP, logits: np.ndarray | None = None) -> np.ndarray:  # [S]
    """Entropy of pi(.|s) in nats (0 at terminal states)."""
    pi = mdp.probs(logits)
    ent = -(pi * np.log(np.clip(pi, 1e-300, 1.0))).sum(axis=1)
    return np.where(mdp.terminal, 0.0, ent)


def with_action_entropy(mdp: TabularMDP, spread: float, seed: int = 0) -> TabularMDP:
    """The MDP with a per-action "turn entropy" ``H(pi(.|s)) * exp(spread * z[s, a])``.

    Stands for an LLM turn's mean token entropy: the first token's entropy is the state's, the
    later tokens' depend on what was sampled, so the entropy a rule sees depends on the action.
    """
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(mdp.next_state.shape)
    ent = state_entropy(mdp)[:, None] * np.exp(spread * z)  # [S, A]
    return dataclasses.replace(mdp, action_entropy=ent, name=f"{mdp.name}-aent{spread:g}")


class Exact(NamedTuple):
    """Exact quantities of an MDP at a policy."""

    j: float  # expected return from the initial state
    grad: np.ndarray  # [P, A] dJ/dlogits
    v: np.ndarray  # [S] V(s) (0 at terminal states)
    q: np.ndarray  # [S, A] Q(s, a) = r(s, a) + E[terminal reward] + V(s') (0 in terminal rows)
    occupancy: np.ndarray  # [S] probability that an episode visits s
    return_var: float  # variance of the episode return (policy and reward noise)
    mean_length: float  # expected number of edges (turns) per episode


def _levels(mdp: TabularMDP) -> list[np.ndarray]:
    order = np.argsort(mdp.step, kind="stable")
    bounds = np.searchsorted(mdp.step[order], np.arange(mdp.horizon + 2))
    return [order[bounds[t] : bounds[t + 1]] for t in range(mdp.horizon + 1)]


def exact(mdp: TabularMDP, logits: np.ndarray | None = None) -> Exact:
    """V, Q, occupancies, J and dJ/dlogits by dynamic programming over the DAG (exact)."""
    pi = mdp.probs(logits)  # [S, A]
    live = ~mdp.terminal
    nxt = np.where(live[:, None], mdp.next_state, 0)  # [S, A], safe indices
    term_mean = np.where(mdp.terminal, mdp.terminal_reward, 0.0)  # [S]
    var_r = mdp.reward_variance()  # [S]
    n, a = mdp.num_states, mdp.num_actions
    v = np.zeros(n)
    w = np.zeros(n)  # E[(return from s)^2]
    q = np.zeros((n, a))
    levels = _levels(mdp)
    for states in reversed(levels):
        s = states[live[states]]
        if not len(s):
            continue
        s2 = nxt[s]  # [m, A]
        imm = mdp.step_reward[s] + term_mean[s2]  # [m, A]
        q[s] = imm + v[s2]
        v[s] = (pi[s] * q[s]).sum(axis=1)
        second = imm**2 + var_r[s2] + 2.0 * imm * v[s2] + w[s2]
        w[s] = (pi[s] * second).sum(axis=1)
    rho = np.zeros(n)
    rho[0] = 1.0
    for states in levels:
        s = states[live[states]]
        if len(s):
            np.add.at(rho, nxt[s].ravel(), (rho[s][:, None] * pi[s]).ravel())
    grad = np.zeros_like(mdp.logits)
    s = np.flatnonzero(live)
    np.add.at(grad, mdp.param_of[s], rho[s][:, None] * pi[s] * (q[s] - v[s][:, None]))
    return Exact(
        j=float(v[0]),
        grad=grad,
        v=v,
        q=q,
        occupancy=rho,
        return_var=float(w[0] - v[0] ** 2),
        mean_length=float(rho[live].sum()),
    )


def prefix_share(mdp: TabularMDP, logits: np.ndarray | None = None) -> np.ndarray:
    """Share of the return's variance explained by the first ``t`` actions, for t = 0..H.

    ``share[t] = Var(E[R | a_1..a_t]) / Var(R)`` (law of total variance): the part of the return
    variance that siblings forked at step t share and that cancels out of their advantage.
    Episodes that ended before t count with their mean return. Needs the accumulated reward to
    be a function of the state (true for tree MDPs and for aliased MDPs without step rewards).
    """
    ex = exact(mdp, logits)
    pi = mdp.probs(logits)
    live = ~mdp.terminal
    acc = np.full(mdp.num_states, np.nan)  # mean reward accumulated on arrival at s
    acc[0] = 0.0
    for states in _levels(mdp):
        s = states[live[states]]
        if not len(s):
            continue
        s2 = mdp.next_state[s]
        val = (
            acc[s][:, None]
            + mdp.step_reward[s]
            + np.where(mdp.terminal[s2], mdp.terminal_reward[s2], 0.0)
        )
        reached = pi[s] > 0
        old = acc[s2]
        clash = reached & ~np.isnan(old) & ~np.isclose(old, val)
        if np.any(clash):
            raise ValueError(
                "the accumulated reward is not a function of the state in this MDP; "
                "prefix_share needs a tree MDP or an aliased MDP without step rewards"
            )
        acc[s2[reached]] = val[reached]
    total = ex.return_var
    out = np.zeros(mdp.horizon + 1)
    if total <= 0:
        return out
    x = np.nan_to_num(acc) + ex.v  # E[R | reached s] (unreached states have occupancy 0)
    for t in range(mdp.horizon + 1):
        frontier = (mdp.step == t) | (mdp.terminal & (mdp.step < t))
        p = ex.occupancy[frontier]
        m = float((p * x[frontier]).sum())
        out[t] = float((p * (x[frontier] - m) ** 2).sum()) / total
    return out


def enumerate_gradient(
    mdp: TabularMDP, logits: np.ndarray | None = None
) -> tuple[float, np.ndarray]:
    """J and dJ/dlogits from the sum over all trajectories (small MDPs only; a cross-check).

    ``grad = sum_tau P(tau) * E[R | tau] * sum_t grad log pi(a_t | s_t)``.
    """
    pi = mdp.probs(logits)
    a_n = mdp.num_actions
    j = 0.0
    grad = np.zeros_like(mdp.logits)
    stack: list[tuple[int, float, float, list[tuple[int, int]]]] = [(0, 1.0, 0.0, [])]
    visited = 0
    while stack:
        s, prob, ret, path = stack.pop()
        if mdp.terminal[s]:
            j += prob * ret
            for ps, pa in path:
                row = mdp.param_of[ps]
                grad[row] -= prob * ret * pi[ps]
                grad[row, pa] += prob * ret
            visited += 1
            if visited > 200_000:
                raise ValueError("too many trajectories to enumerate; use exact() instead")
            continue
        for a in range(a_n):
            s2 = int(mdp.next_state[s, a])
            r = float(mdp.step_reward[s, a])
            if mdp.terminal[s2]:
                r += float(mdp.terminal_reward[s2])
            stack.append((s2, prob * float(pi[s, a]), ret + r, [*path, (s, a)]))
    return j, grad


class MDPBuilder:
    """Build a :class:`TabularMDP` state by state (states must be added parents first)."""

    def __init__(self, num_actions: int) -> None:
        self.a = int(num_actions)
        self.next: list[list[int]] = []
        self.rew: list[list[float]] = []
        self.terminal: list[bool] = []
        self.treward: list[float] = []
        self.step: list[int] = []
        self.param_key: list[object] = []
        self.fp_key: list[object] = []

    def add(
        self,
        step: int,
        *,
        terminal: bool = False,
        terminal_reward: float = 0.0,
        param_key: object = None,
        fingerprint_key: object = None,
    ) -> int:
        """Add a state; ``param_key``/``fingerprint_key`` alias states (default: own identity)."""
        s = len(self.step)
        self.next.append([-1] * self.a)
        self.rew.append([0.0] * self.a)
        self.terminal.append(terminal)
        self.treward.append(float(terminal_reward))
        self.step.append(int(step))
        self.param_key.append(("state", s) if param_key is None else param_key)
        self.fp_key.append(("state", s) if fingerprint_key is None else fingerprint_key)
        return s

    def link(self, s: int, a: int, s2: int, reward: float = 0.0) -> None:
        self.next[s][a] = s2
        self.rew[s][a] = float(reward)

    def build(
        self,
        name: str,
        logits_of: dict[object, np.ndarray] | np.ndarray,
        *,
        noise: str = "none",
        noise_scale: float = 0.0,
        description: str = "",
    ) -> TabularMDP:
        """``logits_of`` maps param keys to logit rows, or is a [P, A] array in key order."""
        term = np.array(self.terminal)
        keys: dict[object, int] = {}
        param_of = np.full(len(self.step), -1, dtype=np.int64)
        for s, key in enumerate(self.param_key):
            if not term[s]:
                param_of[s] = keys.setdefault(key, len(keys))
        if isinstance(logits_of, dict):
            logits = np.array([logits_of[k] for k in keys], dtype=np.float64).reshape(-1, self.a)
        else:
            logits = np.asarray(logits_of, dtype=np.float64).reshape(len(keys), self.a)
        fps: dict[object, int] = {}
        fingerprint = np.array([fps.setdefault(k, len(fps)) for k in self.fp_key], dtype=np.int64)
        return TabularMDP(
            name=name,
            next_state=np.array(self.next, dtype=np.int64).reshape(-1, self.a),
            step_reward=np.array(self.rew, dtype=np.float64).reshape(-1, self.a),
            terminal=term,
            terminal_reward=np.array(self.treward),
            step=np.array(self.step, dtype=np.int64),
            param_of=param_of,
            fingerprint=fingerprint,
            logits=logits,
            noise=noise,
            noise_scale=float(noise_scale),
            description=description,
        )

    def param_keys(self) -> list[object]:
        """Param keys of the live states, in the row order :meth:`build` will use."""
        seen: dict[object, None] = {}
        for s, key in enumerate(self.param_key):
            if not self.terminal[s]:
                seen.setdefault(key, None)
        return list(seen)
