"""Workspaces for the code sandbox: a directory tree an agent changes through sandboxed
commands, with exact snapshots.

* :class:`~bpo.sandbox.workspace.overlay.OverlayWorkspace`: overlayfs layer stack, about 2 ms
  per snapshot or restore whatever the workspace's size (root only); the default.
* :class:`~bpo.sandbox.workspace.tarball.TarWorkspace`: tar+zstd archives, portable, about
  330 ms per 50 MB.
* :class:`~bpo.sandbox.workspace.jail.Jail`: how every command runs (bubblewrap and limits).

Both workspaces offer ``path`` (where this process reads and writes the files), ``run``,
``snapshot`` / ``restore`` / ``release`` (opaque, immutable states that restore any number of
times), ``info`` and ``close``.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from bpo.sandbox.workspace.jail import CommandResult, Jail, JailError, Limits
from bpo.sandbox.workspace.overlay import OverlayWorkspace, WorkspaceError, overlay_supported
from bpo.sandbox.workspace.tarball import TarWorkspace

__all__ = [
    "KINDS",
    "CommandResult",
    "Jail",
    "JailError",
    "Limits",
    "OverlayWorkspace",
    "TarWorkspace",
    "Workspace",
    "WorkspaceError",
    "open_workspace",
    "overlay_supported",
]

KINDS = ("auto", "overlay", "tar")


class Workspace(Protocol):
    kind: str
    path: os.PathLike[str]

    def run(self, command: str, limits: Limits | None = None) -> CommandResult: ...

    def snapshot(self) -> Any: ...

    def restore(self, state: Any) -> None: ...

    def release(self, state: Any) -> None: ...

    def info(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def open_workspace(
    base: str | os.PathLike[str], kind: str = "auto", limits: Limits | None = None
) -> Workspace:
    """A workspace starting from a copy of ``base`` (never modified). ``kind``: "overlay",
    "tar", or "auto" (overlay where it can be mounted, else tar)."""
    if kind not in KINDS:
        raise ValueError(f"unknown workspace kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    if kind == "overlay" or (kind == "auto" and overlay_supported()):
        return OverlayWorkspace(base, limits)
    return TarWorkspace(base, limits)
