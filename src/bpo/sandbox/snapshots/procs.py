"""Process plumbing for the fork server: a message channel over a Unix socket (pickled
messages, file descriptors passed along), ``prctl`` through ctypes, and memory readings from
``/proc``. Linux only."""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import select
import socket
import struct
from typing import Any

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

_HEADER = struct.Struct("!Q")
_PAGE = os.sysconf("SC_PAGE_SIZE")

# Descriptors this process holds for its fork servers (sockets to engine processes, control
# pipes). A freshly forked child closes them all: otherwise it would keep other sandboxes'
# channels open and their processes would never see their owner go away.
PARENT_FDS: dict[int, socket.socket | None] = {}


def prctl(option: int, arg: int) -> None:
    """``prctl(option, arg)`` through libc; OSError on failure."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}, {arg}) failed: {os.strerror(err)}")


def close_inherited(keep: tuple[int, ...] = ()) -> None:
    """In a freshly forked child: close every descriptor in :data:`PARENT_FDS` (sockets are
    detached first so that their Python objects never close a reused number)."""
    for fd, sock in list(PARENT_FDS.items()):
        if fd in keep:
            continue
        if sock is not None:
            sock.detach()
        with contextlib.suppress(OSError):
            os.close(fd)
    PARENT_FDS.clear()


class ChannelClosed(EOFError):
    """The process at the other end of a channel is gone."""


class Channel:
    """Length-prefixed pickled messages over a connected Unix stream socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @classmethod
    def pair(cls) -> tuple[Channel, socket.socket]:
        """A new channel registered in :data:`PARENT_FDS`, and the far end to hand over."""
        near, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        PARENT_FDS[near.fileno()] = near
        return cls(near), far

    def send(self, msg: Any, fds: tuple[int, ...] = ()) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            if fds:
                socket.send_fds(self.sock, [_HEADER.pack(len(data))], list(fds))
                self.sock.sendall(data)
            else:
                self.sock.sendall(_HEADER.pack(len(data)) + data)
        except (BrokenPipeError, ConnectionResetError) as e:
            raise ChannelClosed(str(e)) from e

    def recv(self, timeout: float | None = None) -> tuple[Any, list[int]]:
        """The next message and any descriptors sent with it. TimeoutError when nothing
        arrives within ``timeout`` seconds, ChannelClosed when the peer is gone."""
        if timeout is not None:
            poller = select.poll()
            poller.register(self.sock, select.POLLIN)
            if not poller.poll(max(0, int(timeout * 1000))):
                raise TimeoutError(f"no answer within {timeout} s")
        try:
            head, fds, _, _ = socket.recv_fds(self.sock, _HEADER.size, 4)
        except ConnectionResetError as e:
            raise ChannelClosed(str(e)) from e
        if not head:
            raise ChannelClosed("the other end closed the channel")
        head += self._exactly(_HEADER.size - len(head))
        (n,) = _HEADER.unpack(head)
        return pickle.loads(self._exactly(n)), fds

    def _exactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise ChannelClosed("the other end closed the channel mid-message")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        """Close this end (and forget it in :data:`PARENT_FDS`)."""
        fd = self.sock.fileno()
        if fd >= 0:
            PARENT_FDS.pop(fd, None)
        self.sock.close()

    def drop_in_child(self) -> None:
        """In a forked child: release this inherited end without touching the peer."""
        fd = self.sock.detach()
        if fd >= 0:
            os.close(fd)


def rss_bytes(pid: int | str = "self") -> int:
    """Resident memory of a process (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def private_bytes(pid: int) -> int:
    """Memory only this process maps (Private_Clean + Private_Dirty): what freeing it returns.
    For a frozen fork, the pages the active engine has since rewritten (copy-on-write)."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith((b"Private_Clean:", b"Private_Dirty:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        return 0
    return total
