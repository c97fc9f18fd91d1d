"""Shipped environments. Each module registers an :class:`~bpo.sandbox.protocol.EnvSpec` in
:data:`ENVS` at import and imports its third-party engine lazily (inside functions), so that
listing environments is cheap and a missing engine is reported only when it is used."""

from __future__ import annotations

import importlib

from bpo.registry import Registry
from bpo.sandbox.protocol import EnvSpec

ENVS: Registry[EnvSpec] = Registry("environment")

# Modules that register environments; add a new environment's module here.
_MODULES = ("toy", "textworld", "scienceworld", "twx", "alfworld", "mdp", "code", "web")


def load_all() -> Registry[EnvSpec]:
    """Import every environment module (cheap) and return the registry."""
    for mod in _MODULES:
        importlib.import_module(f"bpo.sandbox.envs.{mod}")
    return ENVS
