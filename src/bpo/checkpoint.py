"""Checkpoints that survive crashes: written atomically, verified on load.

Layout of a run directory's checkpoints::

    checkpoints/
      iter-000003/            one complete checkpoint
        model.safetensors     trainable weights (adapters only with LoRA)
        optimizer.pt          optimizer state
        state.pt              iteration, RNG states, trainer state (torch.save)
        MANIFEST.json         sha256 and size of every file above (written last)

A checkpoint is written into ``iter-XXXXXX.tmp-PID``, every file fsynced, then the directory is
renamed into place and its parent fsynced, so a crash at any moment leaves either the previous
checkpoints or a complete new one. :func:`latest_valid` verifies the manifest and falls back to
the previous good checkpoint when the newest one is partial or corrupt, and says so.

Checkpoints hold CPU tensors whatever device the run trained on, so that they load on a
machine without a GPU; loading returns CPU tensors, which the caller copies onto its model's
device (``Agent.load_trainable_state``, ``optimizer.load_state_dict``).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

__all__ = [
    "CheckpointError",
    "latest_valid",
    "load_checkpoint",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]

MANIFEST = "MANIFEST.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial or corrupt."""


@dataclass(frozen=True)
class Loaded:
    path: Path
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    state: dict[str, Any]
    skipped: tuple[str, ...]
    """Newer checkpoints that were found invalid and skipped (with the reason)."""


def rng_state() -> dict[str, Any]:
    """Python's, NumPy's and torch's global random streams (and CUDA's, once a run uses it)."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def _has_device_tensors(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.device.type != "cpu"
    if isinstance(obj, dict):
        return any(_has_device_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_device_tensors(v) for v in obj)
    return False


def _to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor in its dicts, lists and tuples on the CPU; ``obj`` itself (the
    same bytes once saved) when it holds none elsewhere."""
    if not _has_device_tensors(obj):
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return type(obj)((k, _to_cpu(v)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a NamedTuple
        return type(obj)(*(_to_cpu(v) for v in obj))
    return type(obj)(_to_cpu(v) for v in obj)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file and fsync it.

    Every file goes through Python's file API so that a full disk is an ``OSError`` (ENOSPC):
    safetensors and ``torch.save`` writing a file themselves report it as ``SafetensorError``
    and ``RuntimeError("... unexpected pos ...")``.
    """
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    root: str | Path,
    iteration: int,
    weights: dict[str, torch.Tensor],
    optimizer: dict[str, Any],
    state: dict[str, Any],
    *,
    keep: int = 3,
) -> Path:
    """Write checkpoint ``iteration`` under ``root`` atomically; keep the newest ``keep`` (and
    iteration 0, the policy before RL).

    ``state`` may hold anything ``torch.save`` can store (RNG states included). Tensors on
    another device (a GPU's optimizer state) are saved as CPU tensors. On any error
    (a full disk, say) the partial directory is removed and the previous checkpoints stay.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"iter-{iteration:06d}"
    tmp = root / f"{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        tensors = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
        _write(tmp / "model.safetensors", safetensors_bytes(tensors))
        _write(tmp / "optimizer.pt", _torch_bytes(_to_cpu(optimizer)))
        _write(tmp / "state.pt", _torch_bytes(_to_cpu(state)))
        files = ["model.safetensors", "optimizer.pt", "state.pt"]
        manifest = {
            "iteration": iteration,
            "files": {
                n: {"sha256": _sha256(tmp / n), "bytes": (tmp / n).stat().st_size} for n in files
            },
        }
        _write(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in sorted(p for p in root.glob("iter-*") if ".tmp" not in p.name)[:-keep]:
        if old.name != "iter-000000":  # the warm-started policy, before any RL update, is kept
            shutil.rmtree(old, ignore_errors=True)
    return final


def verify(path: str | Path) -> None:
    """Raise :class:`CheckpointError` naming the problem unless ``path`` is complete and intact."""
    path = Path(path)
    man = path / MANIFEST
    if not man.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST} (a partial checkpoint)")
    try:
        manifest = json.loads(man.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: {MANIFEST} is corrupt ({e})") from None
    for name, meta in manifest.get("files", {}).items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        if f.stat().st_size != meta["bytes"] or _sha256(f) != meta["sha256"]:
            raise CheckpointError(f"{path}: {name} does not match its checksum (corrupt)")


def latest_valid(root: str | Path) -> tuple[Path | None, list[str]]:
    """The newest intact checkpoint under ``root`` and the reasons newer ones were skipped."""
    root = Path(root)
    skipped: list[str] = []
    if not root.is_dir():
        return None, skipped
    for cand in sorted(root.glob("iter-*"), reverse=True):
        if ".tmp" in cand.name:
            skipped.append(f"{cand.name}: an unfinished write (ignored)")
            continue
        try:
            verify(cand)
        except CheckpointError as e:
            skipped.append(str(e))
            continue
        return cand, skipped
    return None, skipped


def load_checkpoint(path: str | Path) -> Loaded:
    """Load a checkpoint directory (verified), or the newest valid one under a ``checkpoints``
    root."""
    path = Path(path)
    skipped: list[str] = []
    if not (path / MANIFEST).exists() and not path.name.startswith("iter-"):
        found, skipped = latest_valid(path)
        if found is None:
            detail = "; ".join(skipped) or "none written yet"
            raise CheckpointError(f"no valid checkpoint under {path} ({detail})")
        path = found
    verify(path)
    weights = load_file(str(path / "model.safetensors"), device="cpu")
    # map_location: a checkpoint written by an older version on a GPU still loads without one
    optimizer = torch.load(path / "optimizer.pt", weights_only=False, map_location="cpu")
    state = torch.load(path / "state.pt", weights_only=False, map_location="cpu")
    return Loaded(path, weights, optimizer, state, tuple(skipped))
