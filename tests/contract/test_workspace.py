"""Workspace snapshots are exact: content, modes, timestamps, symlinks, hard links, empty
directories and a real .git, through many snapshots, restores, merges and releases; and they
leave nothing behind (layers, mounts, the server process) even when the client is killed."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bpo.sandbox.workspace import OverlayWorkspace, TarWorkspace, open_workspace, overlay_supported

KINDS = ["tar", pytest.param("overlay", marks=pytest.mark.skipif(
    not overlay_supported(), reason="overlayfs needs root and bwrap here; the tar kind runs"))]  # fmt: skip


def tree_state(root: Path) -> dict[str, tuple]:
    """Everything the workspace promises to keep, per path (not atime, not directory sizes,
    which differ between filesystems)."""
    out: dict[str, tuple] = {}
    inodes: dict[tuple[int, int], str] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in sorted(dirs + files) + ([] if dirpath != str(root) else ["."]):
            p = os.path.join(dirpath, name) if name != "." else str(root)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p), st.st_mtime_ns)
            elif os.path.isdir(p):
                out[rel] = ("dir", st.st_mode, st.st_mtime_ns)
            else:
                first = inodes.setdefault((st.st_dev, st.st_ino), rel)  # hard-link groups
                digest = hashlib.sha256(Path(p).read_bytes()).hexdigest()
                out[rel] = ("file", st.st_mode, st.st_mtime_ns, st.st_size, digest, first)
    return out


@pytest.fixture()
def base(tmp_path: Path) -> Path:
    b = tmp_path / "base"
    (b / "pkg" / "sub").mkdir(parents=True)
    (b / "empty" / "deeper").mkdir(parents=True)
    (b / "pkg" / "__init__.py").write_text("VALUE = 1\n")
    (b / "pkg" / "sub" / "mod.py").write_text("def f(x):\n    return x + 1\n")
    (b / "run.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(b / "run.sh", 0o755)
    (b / "secret.txt").write_text("private\n")
    os.chmod(b / "secret.txt", 0o600)
    (b / "big.bin").write_bytes(os.urandom(1 << 20))
    (b / "ünï côdé.txt").write_text("names\n")
    os.symlink("pkg/sub/mod.py", b / "link_to_mod")
    os.symlink("does/not/exist", b / "dangling")
    os.link(b / "pkg" / "__init__.py", b / "hardlink.py")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "GIT_AUTHOR_DATE": "2020-01-01T00:00:00Z",
           "GIT_COMMITTER_DATE": "2020-01-01T00:00:00Z"}  # fmt: skip
    for argv in (["git", "init", "-q", "-b", "main"], ["git", "add", "-A"],
                 ["git", "commit", "-q", "-m", "base"]):  # fmt: skip
        subprocess.run(argv, cwd=b, env=env, check=True)
    for i, p in enumerate(sorted(b.rglob("*"), key=str)):  # distinct, old timestamps
        if not p.is_symlink():
            os.utime(
                p, ns=(1_500_000_000_000_000_000 + i * 1_000_001, 1_500_000_000_000_000_000 + i)
            )
    os.utime(b, ns=(1_400_000_000_000_000_000, 1_400_000_000_000_000_000))
    return b


MUTATE_1 = """
set -e
echo 'VALUE = 2' > pkg/__init__.py
rm -r empty/deeper
mkdir -p new/dir && echo data > new/dir/f.txt
mv pkg/sub pkg/moved
chmod 640 run.sh
touch -d '2001-02-03 04:05:06' secret.txt
ln -sf run.sh link_to_mod
git -c user.name=a -c user.email=a@a add -A && git -c user.name=a -c user.email=a@a commit -q -m one
"""

MUTATE_2 = """
set -e
rm -rf pkg new .git/refs
echo overwritten > big.bin
mkdir empty2
"""


@pytest.mark.parametrize("kind", KINDS)
def test_snapshots_are_exact(base: Path, kind: str) -> None:
    want0 = tree_state(base)
    with open_workspace(base, kind) as ws:
        root = Path(ws.path)
        assert tree_state(root) == want0
        s0 = ws.snapshot()
        res = ws.run(MUTATE_1)
        assert res.ok, res.output
        (root / "direct.txt").write_text("written by the engine\n")
        want1 = tree_state(root)
        assert want1 != want0
        s1 = ws.snapshot()
        assert ws.run(MUTATE_2).ok
        s2 = ws.snapshot()
        want2 = tree_state(root)
        for state, want in [(s0, want0), (s1, want1), (s2, want2), (s1, want1), (s0, want0)]:
            ws.restore(state)
            assert tree_state(root) == want
            ws.run("echo scribble > pkg_x; rm -rf .git")  # changes after a restore never leak
        ws.restore(s1)
        assert ws.run("git status --porcelain && git log --oneline | wc -l").output.split() == [
            "??",
            "direct.txt",
            "2",
        ]
        assert tree_state(base) == want0, "the base directory was modified"
        for s in (s0, s1, s2):
            ws.release(s)
        with pytest.raises(Exception, match="released"):
            ws.restore(s1)
    assert tree_state(base) == want0


@pytest.mark.skipif(not overlay_supported(), reason="overlayfs needs root and bwrap here")
def test_overlay_merges_deep_stacks_and_collects_layers(base: Path) -> None:
    with OverlayWorkspace(base, max_depth=4) as ws:
        root = Path(ws.path)
        states, wants = [], []
        for i in range(13):
            (root / f"f{i}.txt").write_text(str(i))
            if i % 3 == 0:
                os.unlink(root / "big.bin") if (root / "big.bin").exists() else None
            states.append(ws.snapshot())
            wants.append(tree_state(root))
        info = ws.info()
        assert info["merges"] >= 2 and info["depth"] < 4
        for i in (12, 0, 5, 12, 7):
            ws.restore(states[i])
            assert tree_state(root) == wants[i]
        for s in states:
            ws.release(s)
        info = ws.info()
        assert info["live_refs"] == 0
        assert info["layers"] <= 4, info  # the current stack's layers and upper only
        server_root = Path(str(ws.path)).parent
    assert not Path(str(server_root).split("/root", 1)[1]).exists()


@pytest.mark.skipif(not overlay_supported(), reason="overlayfs needs root and bwrap here")
def test_killed_client_leaves_no_mounts_layers_or_server(base: Path, tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import os, sys, time
        from bpo.sandbox.workspace import OverlayWorkspace
        ws = OverlayWorkspace({str(base)!r})
        (ws.path / "x").write_text("x")
        s = ws.snapshot()
        print(ws._proc.pid, str(ws.path).split("/root", 1)[1], flush=True)
        time.sleep(600)
    """)
    client = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert client.stdout is not None
    server_pid, merged = client.stdout.readline().split()
    layer_root = Path(merged).parent
    assert layer_root.is_dir()
    client.send_signal(signal.SIGKILL)
    client.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (
        Path(f"/proc/{server_pid}").exists() or layer_root.exists()
    ):
        time.sleep(0.05)
    assert not Path(f"/proc/{server_pid}").exists(), "the workspace server outlived its client"
    assert not layer_root.exists(), "layers left on disk"
    assert str(layer_root) not in Path("/proc/self/mountinfo").read_text()


def test_tar_workspace_cleans_up(base: Path) -> None:
    ws = TarWorkspace(base)
    root = Path(ws.path).parent
    s = ws.snapshot()
    assert Path(s.archive).exists() and s.nbytes > 0
    ws.close()
    assert not root.exists()


def test_bad_base_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="not a directory"):
        open_workspace(tmp_path / "missing", "tar")
    with pytest.raises(ValueError, match="valid kinds"):
        open_workspace(tmp_path, "zfs")
