"""Snapshot backends (DESIGN section 8) and :func:`make_sandbox`, which wraps an engine in one.

| backend  | how a snapshot is kept                         | for                                   |
| -------- | ---------------------------------------------- | ------------------------------------- |
| native   | the engine's ``get_state()`` value             | engines implementing ``NativeState``  |
| replay   | nothing: reset + replay the prefix, verified   | any deterministic engine              |
| pickle   | a pickle of ``get_state()`` or of the engine   | small pure-Python engines             |
| fork     | a frozen forked copy of the engine process     | any in-process engine, C state too    |

``auto`` picks ``native`` when the engine implements
:class:`~bpo.sandbox.protocol.NativeState`, else ``replay``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bpo.registry import Registry
from bpo.sandbox.protocol import Engine, NativeState, Sandbox
from bpo.sandbox.snapshots.fork import ForkSandbox
from bpo.sandbox.snapshots.local import LocalSandbox, NativeStore, PickleStore, ReplayStore
from bpo.sandbox.snapshots.replay import rebuild, replay

__all__ = ["BACKENDS", "ForkSandbox", "LocalSandbox", "make_sandbox", "rebuild", "replay"]

EngineFactory = Callable[[], Engine]
BACKENDS: Registry[Callable[..., Sandbox]] = Registry("snapshot backend")
"""``name -> build(engine_factory, **options) -> Sandbox``."""


@BACKENDS.register("native")
def _native(engine_factory: EngineFactory) -> Sandbox:
    engine = engine_factory()
    if not isinstance(engine, NativeState):
        engine.close()
        raise ValueError(
            f"backend 'native' needs an engine with get_state()/set_state(); "
            f"{type(engine).__name__} has none: use backend 'replay', 'fork' or 'pickle'"
        )
    return LocalSandbox(engine, NativeStore())


@BACKENDS.register("replay")
def _replay(engine_factory: EngineFactory) -> Sandbox:
    return LocalSandbox(engine_factory(), ReplayStore())


@BACKENDS.register("pickle")
def _pickle(engine_factory: EngineFactory, mode: str = "auto") -> Sandbox:
    store = PickleStore(mode)
    return LocalSandbox(engine_factory(), store)


@BACKENDS.register("fork")
def _fork(engine_factory: EngineFactory, **options: Any) -> Sandbox:
    return ForkSandbox(engine_factory, **options)


@BACKENDS.register("auto")
def _auto(engine_factory: EngineFactory) -> Sandbox:
    engine = engine_factory()
    store = NativeStore() if isinstance(engine, NativeState) else ReplayStore()
    return LocalSandbox(engine, store)


def make_sandbox(
    engine_factory: EngineFactory, backend: str = "auto", **backend_options: Any
) -> Sandbox:
    """Build an engine with ``engine_factory`` and wrap it in the ``backend`` snapshot backend.

    Options: ``pickle``: ``mode`` ("auto", "state", "engine"); ``fork``: ``step_timeout``
    (seconds), ``memory_budget`` (bytes or None), ``start_timeout`` (seconds). The fork
    backend calls the factory in its engine process, the others in this process.
    """
    build = BACKENDS.get(backend)
    if "step_timeout" in backend_options and backend != "fork":
        raise ValueError(
            f"step_timeout needs backend='fork' (got {backend!r}): only an engine in its own "
            "process can be stopped in the middle of a step"
        )
    try:
        return build(engine_factory, **backend_options)
    except TypeError as e:
        if "unexpected keyword argument" not in str(e):
            raise
        raise TypeError(
            f"backend {backend!r}: {e}; see make_sandbox's docstring for the "
            "options of each backend"
        ) from None
