"""Fault injection for soak tests and chaos runs: a sandbox wrapper that makes ``step`` raise,
return a malformed result or hang, makes ``restore`` fail, or kills the sandbox for good, at a
configured rate (seeded). ``sandbox.faults`` in a run's config turns it on for ``bpo train``
(RELIABILITY.md has the soak); production runs leave it off.

Written here (no library injects faults at this protocol) so that the failures look like real
ones to the rollout engine: a hang is a real sleep followed by the timeout error a backend with
a step timeout (fork server, Ray pool) raises; a dead sandbox fails every later call, including
``restore`` and ``reset``.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

from bpo.sandbox.protocol import SandboxError

__all__ = ["FAULT_KINDS", "FaultConfig", "FaultInjector", "soak_overrides"]

FAULT_KINDS = ("raise", "malformed", "hang", "restore", "die")


@dataclass(frozen=True)
class FaultConfig:
    rate: float = 0.0
    """Chance per ``step`` (and per ``restore`` for the "restore" kind) of one fault."""
    kinds: tuple[str, ...] = ("raise", "malformed", "restore", "die")
    """Which faults to draw from (uniformly): see FAULT_KINDS."""
    hang_seconds: float = 0.2
    seed: int = 0
    counts: dict[str, int] = field(default_factory=dict, compare=False)
    """Faults injected so far, by kind (shared by every wrapper made from this config)."""

    def __post_init__(self) -> None:
        bad = [k for k in self.kinds if k not in FAULT_KINDS]
        if bad or not self.kinds:
            raise ValueError(f"unknown fault kinds {bad}; valid: {', '.join(FAULT_KINDS)}")
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"fault rate must be in [0, 1], got {self.rate}")


class FaultInjector:
    """Wraps a sandbox; every other attribute is the wrapped sandbox's."""

    _made = 0

    def __init__(self, inner: Any, config: FaultConfig) -> None:
        FaultInjector._made += 1
        self.inner = inner
        self.config = config
        self._rng = random.Random(config.seed * 1_000_003 + FaultInjector._made)
        self._dead = False

    def _draw(self, allowed: tuple[str, ...]) -> str | None:
        kinds = [k for k in self.config.kinds if k in allowed]
        if not kinds or self._rng.random() >= self.config.rate:
            return None
        kind = self._rng.choice(kinds)
        self.config.counts[kind] = self.config.counts.get(kind, 0) + 1
        return kind

    def _alive(self) -> None:
        if self._dead:
            raise SandboxError("injected fault: the sandbox is dead")

    def reset(self, task: str, seed: int) -> Any:
        self._alive()
        return self.inner.reset(task, seed)

    def step(self, action: str) -> Any:
        self._alive()
        kind = self._draw(("raise", "malformed", "hang", "die"))
        if kind == "die":
            self._dead = True
            raise SandboxError("injected fault: the sandbox died")
        if kind == "raise":
            raise SandboxError("injected fault: step raised")
        if kind == "hang":
            time.sleep(self.config.hang_seconds)
            raise SandboxError(f"injected fault: step hung past {self.config.hang_seconds} s")
        res = self.inner.step(action)
        return None if kind == "malformed" else res

    def restore(self, snapshot: Any) -> Any:
        self._alive()
        if self._draw(("restore",)):
            raise SandboxError("injected fault: restore failed")
        return self.inner.restore(snapshot)

    def snapshot(self) -> Any:
        self._alive()
        return self.inner.snapshot()

    def release(self, snapshot: Any) -> None:
        self.inner.release(snapshot)  # bookkeeping works on a dead sandbox, as in LocalSandbox

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def soak_overrides(rate: float) -> list[str]:
    """``bpo train`` overrides of a soak run: every fault kind at ``rate`` per call, short hangs,
    and a fault bound loose enough that the injected rate alone never stops the run."""
    return [
        f"sandbox.faults.rate={rate}", "sandbox.faults.hang_seconds=0.05",
        f"sandbox.faults.kinds=[{','.join(FAULT_KINDS)}]", "run.max_fault_frac=0.5",
    ]  # fmt: skip
