"""Spread sampling calls over several inference engines so that each engine's prefix cache
keeps serving the trees it started.

An agent's turn ``t + 1`` context is its turn ``t`` context plus the action and the new
observation (prompts are append-only, :mod:`bpo.policy.prompts`), and a fork's context is its
branch node's context. So the engine that served a tree's earlier contexts already holds the
KV of every later context's longest prefix, and sending the later ones elsewhere recomputes it.
:class:`PrefixRouter` remembers which engine each routed context went to and sends a new context
to the engine of its longest routed prefix, exact at token level; a context with no routed
prefix (a new tree) goes to the engine with the fewest trees. This is the cache-aware routing
of SGLang's router, specialised to append-only agent prompts, where "longest routed prefix"
can be found by hashing the context at the lengths already routed instead of keeping a radix
tree of every engine's cache.

:class:`RoutedPolicy` is a :class:`bpo.policy.protocol.Policy` over engine handles (Ray actors
in :mod:`bpo.cluster.roles`, or plain objects in tests): one ``sample`` call is split by route,
the engines run their parts at once, and the results come back in request order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from bpo.policy.protocol import PolicyStats, SamplingParams, TurnSample

__all__ = ["PrefixRouter", "RoutedPolicy", "add_stats", "prefix_hit_rate"]


class PrefixRouter:
    """Which engine a context goes to (see the module docstring).

    ``mode="round_robin"`` ignores prefixes: context ``i`` of the router's life goes to engine
    ``i % engines`` (the baseline the hit rate is compared with)."""

    MAX_ENTRIES = 200_000
    """Routed prefixes remembered; beyond this the memory is dropped (new trees only lose
    their affinity, never correctness)."""

    def __init__(self, engines: int, mode: str = "prefix") -> None:
        if engines < 1:
            raise ValueError(f"engines must be >= 1, got {engines}")
        if mode not in ("prefix", "round_robin"):
            raise ValueError(f"routing mode {mode!r} is not valid; valid: prefix, round_robin")
        self.engines, self.mode = engines, mode
        self.reset()

    def reset(self) -> None:
        """Forget every route (the engines' caches were dropped: new weights)."""
        self._owner: dict[int, dict[tuple[int, ...], int]] = {}  # length -> prefix -> engine
        self._trees = [0] * self.engines
        self._count = 0
        self.routed = 0
        self.affine = 0
        """Contexts sent to the engine of a routed prefix (the rest started trees)."""

    def route(self, context: Sequence[int]) -> int:
        ctx = tuple(context)
        self.routed += 1
        if self.mode == "round_robin":
            self._count += 1
            return (self._count - 1) % self.engines
        engine = None
        for length in sorted((n for n in self._owner if n <= len(ctx)), reverse=True):
            engine = self._owner[length].get(ctx[:length])
            if engine is not None:
                self.affine += 1
                break
        if engine is None:
            engine = min(range(self.engines), key=lambda e: (self._trees[e], e))
            self._trees[engine] += 1
        if sum(len(d) for d in self._owner.values()) >= self.MAX_ENTRIES:
            self._owner.clear()
        self._owner.setdefault(len(ctx), {})[ctx] = engine
        return engine


def add_stats(stats: Sequence[PolicyStats]) -> PolicyStats:
    """The sum of several policies' counters."""
    fields = [f.name for f in dataclasses.fields(PolicyStats)]
    return PolicyStats(**{f: sum(getattr(s, f) for s in stats) for f in fields})


def prefix_hit_rate(before: PolicyStats, after: PolicyStats) -> float:
    """Share of the context tokens requested between two stats snapshots that the prefix cache
    served (cache hits over hits + prefilled tokens); 0 when nothing was requested."""
    hit = after.cache_hit_tokens - before.cache_hit_tokens
    computed = after.prefill_tokens - before.prefill_tokens
    return hit / (hit + computed) if hit + computed > 0 else 0.0


class RoutedPolicy:
    """A policy whose ``sample`` calls are served by several engines, routed by prefix.

    ``engines`` are handles with ``sample``, ``release``, ``clear_cache`` and ``stats`` methods;
    ``call(handles_and_calls)`` runs ``[(engine, method, args), ...]`` at once and returns their
    results in order (Ray: submit every ``.remote`` then one ``ray.get``; tests: in a loop)."""

    def __init__(
        self,
        engines: Sequence[Any],
        tokenizer: Any,
        stop_token_ids: Sequence[int],
        call: Callable[[list[tuple[Any, str, tuple]]], list[Any]],
        routing: str = "prefix",
    ) -> None:
        self.engines = list(engines)
        self.tokenizer = tokenizer
        self._stop = tuple(stop_token_ids)
        self._call = call
        self.router = PrefixRouter(len(self.engines), routing)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self._stop

    def sample(
        self,
        contexts: Sequence[Sequence[int]],
        n: int | Sequence[int] = 1,
        params: SamplingParams | None = None,
    ) -> list[list[TurnSample]]:
        ns = [int(n)] * len(contexts) if isinstance(n, int) else [int(k) for k in n]
        if len(ns) != len(contexts):
            raise ValueError(f"n has {len(ns)} entries for {len(contexts)} contexts")
        parts: dict[int, list[int]] = {}
        for i, ctx in enumerate(contexts):
            parts.setdefault(self.router.route(ctx), []).append(i)
        order = sorted(parts)
        calls = [
            (self.engines[e], "sample",
             ([list(contexts[i]) for i in parts[e]], [ns[i] for i in parts[e]], params))
            for e in order
        ]  # fmt: skip
        out: list[list[TurnSample]] = [[] for _ in contexts]
        for e, result in zip(order, self._call(calls), strict=True):
            for i, samples in zip(parts[e], result, strict=True):
                out[i] = samples
        return out

    def release(self, contexts: Sequence[Sequence[int]]) -> None:
        self._call([(e, "release", ([list(c) for c in contexts],)) for e in self.engines])

    def clear_cache(self) -> None:
        self._call([(e, "clear_cache", ()) for e in self.engines])
        self.router.reset()

    def stats(self) -> PolicyStats:
        return add_stats(self._call([(e, "stats", ()) for e in self.engines]))
