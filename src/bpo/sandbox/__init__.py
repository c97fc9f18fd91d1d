"""Sandboxes: environments with snapshots (DESIGN section 2 and 8).

* :func:`make_sandbox` wraps an :class:`Engine` in a snapshot backend;
* :func:`make_env` / :func:`list_tasks` build registered environments (``ENVS``);
* :func:`check_sandbox` checks the contract (determinism, exact restores, ...);
* ``bpo.sandbox.pool.SandboxPool`` runs sandboxes in Ray actors (imported on use).
"""

from __future__ import annotations

import inspect
from typing import Any

from bpo.sandbox.check import CheckReport, SandboxCheckError, check_sandbox
from bpo.sandbox.protocol import (
    Engine,
    EnvSpec,
    NativeState,
    Observation,
    Sandbox,
    SandboxError,
    Snapshot,
    SnapshotError,
    SnapshotStats,
    StepResult,
)
from bpo.sandbox.snapshots import BACKENDS, make_sandbox, rebuild

__all__ = [
    "BACKENDS",
    "CheckReport",
    "Engine",
    "EnvSpec",
    "NativeState",
    "Observation",
    "Sandbox",
    "SandboxCheckError",
    "SandboxError",
    "SandboxPool",
    "Snapshot",
    "SnapshotError",
    "SnapshotStats",
    "StepResult",
    "check_sandbox",
    "env_spec",
    "list_tasks",
    "make_env",
    "make_sandbox",
    "rebuild",
]


def env_spec(name: str) -> EnvSpec:
    """The registered environment ``name``; unknown names list the valid ones."""
    from bpo.sandbox.envs import load_all

    return load_all().get(name)


def make_env(name: str, backend: str = "auto", **options: Any) -> Sandbox:
    """A sandbox of the registered environment ``name`` with snapshot ``backend``."""
    spec = env_spec(name)
    params = inspect.signature(spec.make).parameters
    takes_backend = "backend" in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
    )
    if takes_backend:
        return spec.make(backend=backend, **options)
    if backend != "auto":
        raise ValueError(
            f"environment {name!r} does not let you choose its snapshot backend "
            f"(its make() takes no 'backend'); drop backend={backend!r}"
        )
    return spec.make(**options)


def list_tasks(name: str, split: str, **options: Any) -> list[str]:
    """Task names of environment ``name`` in ``split`` ("train", "valid" or "test")."""
    return list(env_spec(name).tasks(split, **options))


def __getattr__(attr: str) -> Any:
    if attr == "SandboxPool":  # needs ray: imported on first use
        from bpo.sandbox.pool import SandboxPool

        return SandboxPool
    raise AttributeError(f"module 'bpo.sandbox' has no attribute {attr!r}")
