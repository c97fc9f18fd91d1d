"""Drive the real rollout engine (:mod:`bpo.rollout.engine`) with a tabular policy.

The ``mdp`` sandbox wraps the same tabular MDPs as :mod:`bpo.analysis.families`, so a tabular
softmax policy that speaks the engine's token protocol lets the engine grow real trees whose
exact policy gradient is known. :func:`engine_trees` returns them as :class:`SampledTree`
records, ready for the study's estimators and gradient statistics.

Token protocol: the context is ``[0]`` then, per turn, the action's two tokens ``(a + 1,
END)`` and an observation token ``0``; the policy replays the action tokens through the MDP's
transition table to find its state. The two action tokens carry the entropies ``(H(pi(.|s)),
e2)`` with ``e2 = H(pi(.|s))`` or, when the MDP has per-action entropies, ``action_entropy[s,
a]``: the engine's "first" entropy is then the state's, its "mean" depends on the action.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bpo.analysis.mdp import TabularMDP, state_entropy, with_action_entropy
from bpo.analysis.sampling import SampledTree
from bpo.branching import BranchRule
from bpo.policy.protocol import TurnSample

__all__ = ["Prompt", "TabularPolicy", "TokenPrompter", "engine_trees"]

END = 99
"""Second token of every action."""


@dataclass(frozen=True)
class Prompt:
    """The engine's ``PromptState``: the whole context and the tokens a turn appended."""

    ids: tuple[int, ...]
    new_ids: tuple[int, ...]
    reset: bool = False


class TokenPrompter:
    """One observation token per state; the state is recovered from the action tokens."""

    def start(self, instruction: str, observation: str, admissible: Any) -> Prompt:
        return Prompt((0,), (0,))

    def extend(
        self, state: Prompt, action_ids: Sequence[int], observation: str, admissible: Any
    ) -> Prompt:
        return Prompt((*state.ids, *action_ids, 0), (0,))


class TabularPolicy:
    """pi(a|s) = softmax(logits[param_of[s]]), sampling the sandbox's action labels."""

    def __init__(self, mdp: TabularMDP, labels: Sequence[str], rng: np.random.Generator) -> None:
        if len(labels) != mdp.num_actions:
            raise ValueError(f"{len(labels)} labels for {mdp.num_actions} actions")
        self.mdp = mdp
        self.labels = tuple(labels)
        self.rng = rng
        self.pi = mdp.probs()
        self.entropy = state_entropy(mdp)

    def state(self, context: Sequence[int]) -> int:
        s = 0
        for tok in context:
            if 1 <= tok <= self.mdp.num_actions:
                s = int(self.mdp.next_state[s, tok - 1])
        return s

    def sample(self, contexts: Sequence[Sequence[int]], n: int = 1, params: Any = None) -> list:
        out = []
        for ctx in contexts:
            s = self.state(ctx)
            draws = []
            for _ in range(n):
                a = int(self.rng.choice(self.mdp.num_actions, p=self.pi[s]))
                e1 = float(self.entropy[s])
                ae = self.mdp.action_entropy
                e2 = e1 if ae is None else float(ae[s, a])
                lp = math.log(self.pi[s, a])
                draws.append(
                    TurnSample(
                        action_ids=(a + 1, END),
                        logprobs=(lp, 0.0),
                        entropies=(e1, e2),
                        text=self.labels[a],
                        finish_reason="stop",
                        prefill_tokens=len(ctx),
                    )
                )
            out.append(draws)
        return out


def engine_trees(
    task: str,
    seeds: Sequence[int],
    rule: BranchRule,
    config: Any,
    rng: np.random.Generator,
    action_entropy_spread: float | None = None,
) -> tuple[TabularMDP, list[SampledTree], list[Any]]:
    """Grow one tree per seed of an ``mdp`` task with :class:`bpo.rollout.engine.RolloutEngine`.

    ``action_entropy_spread`` gives the policy per-action token entropies
    (:func:`bpo.analysis.mdp.with_action_entropy`), so the engine's "mean" turn entropy depends
    on the sampled action. Returns the task's MDP, the trees as :class:`SampledTree` (states
    replayed from the actions) and the engine's own :class:`bpo.tree.Tree` records.
    """
    from bpo.rollout.engine import RolloutEngine
    from bpo.sandbox import make_env
    from bpo.sandbox.envs.mdp import build_task, labels_of

    mdp = build_task(task)
    labels = labels_of(task)
    acting = (
        mdp if action_entropy_spread is None else with_action_entropy(mdp, action_entropy_spread, 1)
    )
    policy = TabularPolicy(acting, labels, rng)
    engine = RolloutEngine(
        policy,
        TokenPrompter(),
        lambda text, admissible: text,
        rule,
        lambda: make_env("mdp"),
        config,
    )
    try:
        trees = engine.run([(task, int(s)) for s in seeds])
    finally:
        engine.close()
    out = []
    for tree in trees:
        n = len(tree.nodes)
        parents = np.array([node.parent for node in tree.nodes], dtype=np.int64)
        actions = np.full(n, -1, dtype=np.int64)
        rewards = np.zeros(n)
        states = np.zeros(n, dtype=np.int64)
        order = np.argsort([node.step for node in tree.nodes], kind="stable")
        for i in order[1:]:
            turn = tree.nodes[i].turn
            actions[i] = turn.action_ids[0] - 1
            rewards[i] = turn.reward
            states[i] = mdp.next_state[states[parents[i]], actions[i]]
        branches = sum(1 for node in tree.nodes if len(node.children) >= 2)
        out.append(SampledTree(parents, rewards, states, actions, branches))
    return mdp, out, trees
