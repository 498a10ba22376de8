"""The same-host payload path: tensor bytes through a shared-memory ring, headers on the websocket.

Each side of a connection owns one ring for what it sends: an anonymous,
sealed ``memfd`` (never a file in ``/dev/shm``), mapped by its owner. Right
after the websocket is authenticated the owner offers it to the peer as
``{host, boot, pid, fd, size, nonce}``; the peer opens it through
``/proc/<pid>/fd/<fd>`` only if it runs on the same host (same hostname and
boot id), the link is one of ours and the first bytes hold the nonce (so a
recycled pid or another host's numbers can never be mistaken for it), maps
it read-only and accepts. The owner then closes its descriptor: from then on
only the two mappings keep the memory, and the kernel frees it when both
processes have unmapped it or died, whichever way they die. Nothing is ever
named in a file system, so nothing can be left behind.

A payload placed in the ring travels as a small frame (header plus the
offset and the ring position after it); the receiver copies it out before
handing the message on, in wire order, and tells the owner now and then how
far it has read (``release``). When the ring has no room the frame goes on
the socket as before; a sender that may wait asks for a release first
(``want``): everything sent before that request has been read by the time
the peer sees it, so the answer frees the whole ring.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import socket
from functools import cache
from typing import Any, Final

import numpy as np

from ._errors import DecodeError

__all__ = ["PeerRing", "SendRing", "host_identity"]

_PREFIX: Final = "dniasync-ring"
_BASE: Final = 64
"""Ring bytes before the data: the nonce."""
_ALIGN: Final = 64
_NONCE_BYTES: Final = 16
_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_MAX_RING: Final = 1 << 34


@cache
def host_identity() -> tuple[str, str]:
    """(hostname, boot id): two processes whose identities differ are never on one host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot


def available() -> bool:
    """This platform can share memory this way (Linux: memfd, seals, /proc)."""
    return hasattr(os, "memfd_create") and bool(host_identity()[1])


class SendRing:
    """The ring this node writes payloads for one peer into."""

    def __init__(self, size: int, label: str) -> None:
        if not 4 * _ALIGN <= size <= _MAX_RING:
            raise ValueError(f"shared-memory ring of {size} bytes is out of range")
        self.capacity = size - size % _ALIGN
        self.max_payload = self.capacity // 2
        self.nonce = secrets.token_bytes(_NONCE_BYTES)
        fd = os.memfd_create(f"{_PREFIX} {label}"[:240], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, _BASE + self.capacity)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)  # the peer maps it: it may never shrink under it
            self._map = mmap.mmap(fd, _BASE + self.capacity)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        self._view = memoryview(self._map)
        self._view[:_NONCE_BYTES] = self.nonce
        self.head = 0
        """Bytes ever placed (a position on the unrolled ring), skipped tails included."""
        self.released = 0
        """The position up to which the peer has read everything."""
        self.accepted = False
        self.wanted = False
        """A ``want`` is out and its ``release`` has not come back."""

    def offer(self) -> dict[str, Any]:
        host, boot = host_identity()
        assert self._fd is not None
        return {
            "host": host, "boot": boot, "pid": os.getpid(), "fd": self._fd,
            "size": _BASE + self.capacity, "nonce": self.nonce.hex(),
        }

    def accept(self, nonce: Any) -> bool:
        """The peer mapped the ring: close the descriptor (nobody else can open it now)."""
        if nonce != self.nonce.hex() or self._fd is None:
            return False
        os.close(self._fd)
        self._fd = None
        self.accepted = True
        return True

    @property
    def in_flight(self) -> int:
        return self.head - self.released

    def has_room(self, nbytes: int) -> bool:
        cap = self.capacity
        pos = self.head % cap
        skip = cap - pos if pos + nbytes > cap else 0
        return skip + nbytes + (-nbytes % _ALIGN) <= cap - (self.head - self.released)

    def place(self, buffers: list[memoryview | bytes], nbytes: int) -> tuple[int, int] | None:
        """Copy a payload in; (offset in the ring, position after it), or None if there is no room."""
        cap = self.capacity
        pos = self.head % cap
        skip = cap - pos if pos + nbytes > cap else 0
        size = nbytes + (-nbytes % _ALIGN)
        if skip + size > cap - (self.head - self.released):
            return None
        offset = _BASE + (0 if skip else pos)
        view = self._view
        at = offset
        for buf in buffers:
            n = len(buf)
            view[at : at + n] = buf
            at += n
        self.head += skip + size
        return offset, self.head

    def release(self, mark: Any) -> bool:
        """The peer has read up to ``mark``; False if that cannot be true."""
        if type(mark) is not int or not self.released <= mark <= self.head:
            return False
        self.released = mark
        self.wanted = False
        return True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        _unmap(self._view, self._map)


class PeerRing:
    """The peer's ring, mapped read-only here."""

    def __init__(self, view: memoryview, mapped: mmap.mmap) -> None:
        self._view = view
        self._map = mapped
        self.capacity = len(mapped) - _BASE
        self.consumed = 0
        self.acked = 0

    @classmethod
    def open(cls, offer: Any) -> PeerRing:
        """Map the ring a peer offered; ``ValueError`` saying why not (then the socket carries all)."""
        if type(offer) is not dict:
            raise ValueError("malformed offer")
        host, boot = host_identity()
        if offer.get("host") != host or offer.get("boot") != boot:
            raise ValueError("the peer runs on another host")
        pid, fd, size, nonce = offer.get("pid"), offer.get("fd"), offer.get("size"), offer.get("nonce")
        if not (type(pid) is int and type(fd) is int and pid > 0 and fd >= 0):
            raise ValueError("malformed offer")
        if not (type(size) is int and 4 * _ALIGN + _BASE <= size <= _MAX_RING + _BASE and size % _ALIGN == 0):
            raise ValueError(f"ring size {size!r} out of range")
        if type(nonce) is not str or len(nonce) != 2 * _NONCE_BYTES:
            raise ValueError("malformed nonce")
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if not os.readlink(path).startswith(f"/memfd:{_PREFIX} "):
                raise ValueError("the offered descriptor is not a dniasync ring")
            handle = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise ValueError(f"cannot open the offered ring: {exc.strerror}") from None
        try:
            if os.fstat(handle).st_size != size:
                raise ValueError("the offered ring has another size")
            if fcntl.fcntl(handle, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
                raise ValueError("the offered ring is not sealed")
            mapped = mmap.mmap(handle, size, prot=mmap.PROT_READ)
        except OSError as exc:
            raise ValueError(f"cannot map the offered ring: {exc.strerror}") from None
        finally:
            os.close(handle)
        view = memoryview(mapped)
        if bytes(view[:_NONCE_BYTES]).hex() != nonce:
            _unmap(view, mapped)
            raise ValueError("the offered ring does not hold the offered nonce")
        return cls(view, mapped)

    def take(self, offset: int, nbytes: int, mark: int) -> memoryview:
        """Copy a payload out of the ring; the frame said the ring is read up to ``mark`` after it."""
        if not (_BASE <= offset and offset + nbytes <= _BASE + self.capacity):
            raise DecodeError(f"shared-memory payload [{offset}, +{nbytes}) is outside the ring")
        if not self.consumed < mark <= self.consumed + self.capacity:
            raise DecodeError(f"shared-memory position {mark} does not follow {self.consumed}")
        out = np.empty(nbytes, dtype=np.uint8)  # no zero-fill: every byte is written
        payload = memoryview(out.data)
        payload[:] = self._view[offset : offset + nbytes]
        self.consumed = mark
        return payload

    def ack_due(self) -> bool:
        """Enough has been read since the last release to tell the owner."""
        return self.consumed - self.acked >= self.capacity // 4

    def close(self) -> None:
        _unmap(self._view, self._map)


def _unmap(view: memoryview, mapped: mmap.mmap) -> None:
    try:
        view.release()
        mapped.close()
    except BufferError:  # a slice still lives (a copy in progress elsewhere): unmapped when it goes
        pass
