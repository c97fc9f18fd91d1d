"""An executable check of the sandbox contract (the Gymnasium ``env_checker`` pattern).

:func:`check_sandbox` runs two fresh sandboxes side by side over a few tasks and checks, in
order: determinism, exact restores, one snapshot restored many times, snapshots isolated from
later steps, release (and errors for released/foreign handles), invalid actions as
observations, and a random snapshot/restore/step tree whose every node is compared with a
replay from reset. A failure raises :class:`SandboxCheckError` naming the property, what
differed, and the likely cause. ``bpo check-sandbox`` is the command line
(:mod:`bpo.sandbox.check_cli`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bpo.sandbox.check_properties import GARBAGE, PROPERTIES, Properties, SandboxCheckError
from bpo.sandbox.protocol import Sandbox

__all__ = ["GARBAGE", "CheckReport", "PropertyResult", "SandboxCheckError", "check_sandbox"]


@dataclass(frozen=True)
class PropertyResult:
    name: str
    seconds: float
    checked: str
    """What was exercised, in words (tasks, steps, snapshots)."""


@dataclass(frozen=True)
class CheckReport:
    """What :func:`check_sandbox` checked, and how long it took."""

    backend: str
    tasks: tuple[str, ...]
    seed: int
    properties: tuple[PropertyResult, ...]
    steps: int
    snapshots: int
    restores: int
    mean_snapshot_ms: float
    mean_restore_ms: float
    seconds: float

    def render(self) -> str:
        """A readable markdown report."""
        lines = [
            f"sandbox check: backend {self.backend}, {len(self.tasks)} task(s) "
            f"({', '.join(self.tasks[:4])}{', ...' if len(self.tasks) > 4 else ''}), "
            f"seed {self.seed}",
            "",
            "| property | result | seconds | checked |",
            "| --- | --- | ---: | --- |",
        ]
        lines += [f"| {p.name} | ok | {p.seconds:.3f} | {p.checked} |" for p in self.properties]
        lines += [
            "",
            f"{self.steps} steps, {self.snapshots} snapshots, {self.restores} restores;"
            f" mean snapshot {self.mean_snapshot_ms:.3f} ms, mean restore "
            f"{self.mean_restore_ms:.3f} ms; {self.seconds:.2f} s in all",
        ]
        return "\n".join(lines)


def check_sandbox(
    factory: Callable[[], Sandbox],
    tasks: Sequence[str],
    *,
    seed: int = 0,
    max_steps: int = 30,
    stress_nodes: int = 40,
    rng_seed: int = 0,
) -> CheckReport:
    """Check the sandbox contract on two fresh sandboxes from ``factory`` over ``tasks``.

    Returns a :class:`CheckReport`; raises :class:`SandboxCheckError` (an AssertionError) at
    the first property that fails, naming it and its likely cause.
    """
    if not tasks:
        raise ValueError("check_sandbox needs at least one task")
    t_start = time.perf_counter()
    a = factory()
    try:
        b = factory()
    except BaseException:
        a.close()
        raise
    try:
        c = Properties(a, b, tasks, seed, max_steps, stress_nodes, rng_seed)
        results = []
        for name, method in PROPERTIES:
            c.prop = name
            t0 = time.perf_counter()
            try:
                checked = getattr(c, method)()
            except SandboxCheckError:
                raise
            except Exception as e:
                raise SandboxCheckError(name, f"the sandbox raised {e!r}") from e
            results.append(PropertyResult(name, time.perf_counter() - t0, checked))
        st = a.stats()
        return CheckReport(
            backend=str(getattr(a, "backend", type(a).__name__)),
            tasks=tuple(tasks),
            seed=seed,
            properties=tuple(results),
            steps=c.steps,
            snapshots=st.taken,
            restores=st.restored,
            mean_snapshot_ms=1e3 * st.snapshot_seconds / max(st.taken, 1),
            mean_restore_ms=1e3 * st.restore_seconds / max(st.restored, 1),
            seconds=time.perf_counter() - t_start,
        )
    finally:
        a.close()
        b.close()
