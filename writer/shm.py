"""The shared-memory block: created once, prefaulted, reused for every cut, unlinked at close.

The block is a file in /dev/shm that the trainer maps and the writer process attaches by name.
Space is reserved with posix_fallocate when it is created, so a /dev/shm too small for the state fails
there with a clear ``ShmTooSmall`` (naming the container setting), never with SIGBUS mid-copy.
Python's multiprocessing.shared_memory is not used: its resource tracker unlinks segments that another
process attached to when that process exits.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets

from .errors import ShmTooSmall

SHM_DIR = "/dev/shm"
PREFIX = "ckptstore-"


class Block:
    """A mapped shared-memory file. ``view`` is a writable memoryview of all of it."""

    def __init__(self, name: str, size: int, fd: int, owner: bool) -> None:
        self.name = name
        self.size = size
        self._fd = fd
        self.owner = owner
        self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.view = memoryview(self.map)
        os.close(fd)
        self._fd = -1

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    @classmethod
    def create(cls, size: int, *, prefault: bool = True) -> "Block":
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                    free = shm_free_bytes()
                    raise ShmTooSmall(
                        f"/dev/shm cannot hold the state: {size} bytes needed, {free} free",
                        path=path,
                        hint="raise the shared-memory limit (docker run --shm-size=<state size + 10%>, or a "
                        "larger /dev/shm mount in Kubernetes: an emptyDir with medium Memory)",
                    ) from None
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        block = cls(name, size, fd, owner=True)
        if prefault:
            block.prefault()
        return block

    @classmethod
    def attach(cls, name: str, size: int) -> "Block":
        if "/" in name or not name.startswith(PREFIX):
            raise ValueError(f"refusing shared-memory name {name!r}")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        return cls(name, size, fd, owner=False)

    def prefault(self) -> None:
        """Touches every page once (first touch of fresh memory is slow on this VM class, and costs the
        capture otherwise)."""
        step = 64 << 20
        zeros = bytes(min(step, self.size))
        for start in range(0, self.size, step):
            end = min(start + step, self.size)
            self.view[start:end] = zeros[: end - start]

    def close(self) -> None:
        """Unmaps; the owner also unlinks the name. Idempotent."""
        try:
            self.view.release()
        except Exception:  # noqa: BLE001 - exported views may still exist; the map closes with them
            pass
        try:
            self.map.close()
        except BufferError:
            pass
        if self.owner:
            unlink(self.name)
            self.owner = False


def unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def leftover_segments(pid: int | None = None) -> list[str]:
    """Blocks in /dev/shm made by ckptstore (of one pid, if given), for leak checks."""
    pre = PREFIX if pid is None else f"{PREFIX}{pid}-"
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(pre))
    except FileNotFoundError:
        return []
