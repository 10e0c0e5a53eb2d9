"""The shared-memory block: created once, prefaulted, reused for every cut, freed at close.

The block is a file on /dev/shm that is **unlinked the moment it is created**: the trainer keeps its
file descriptor and hands it to the writer process over a Unix socket (SCM_RIGHTS). No name exists
for it, so nothing can outlive the two processes: when both are gone, SIGKILL included, the kernel frees
the memory. (A name in /dev/shm would need a live process to unlink it, and a trainer killed between
creating a block and handing it over would leak one.)

It lives on /dev/shm rather than memfd on purpose: /dev/shm is the size-limited mount containers
configure, so ``posix_fallocate`` fails there with ENOSPC when the state does not fit, which becomes a
clear ``ShmTooSmall`` naming the setting, never SIGBUS mid-copy and never the OOM killer.

/dev/shm is shared by every user of the machine: a ``ckptstore-<pid>-*`` name there may be someone
else's. Only names provably ours (our uid, a dead pid, a regular file) are ever removed, and a name
already taken is skipped for a fresh one, so another user's file never stops a Checkpointer.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import stat

from .errors import ShmTooSmall

SHM_DIR = "/dev/shm"
PREFIX = "ckptstore-"


class Block:
    """A mapped shared-memory file. ``view`` is a writable memoryview of all of it; ``fd`` is what the
    writer process attaches."""

    def __init__(self, name: str, size: int, fd: int, owner: bool, backed: int | None = None) -> None:
        self.name = name
        self.size = size
        self.fd = fd
        self.owner = owner
        self.backed = size if backed is None else backed  # bytes reserved (posix_fallocate) and prefaulted
        self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.view = memoryview(self.map)

    @classmethod
    def create(cls, size: int, *, prefault: bool = True, backed: int | None = None) -> "Block":
        """A new block of ``size`` bytes. Only the first ``backed`` bytes (default: all; rounded up to
        1 MiB) are reserved with posix_fallocate and prefaulted now; the rest is headroom that
        :meth:`ensure` reserves when a cut first needs it, so headroom costs no memory until used."""
        reap_stale()
        name, fd = _create_unlinked()
        path = os.path.join(SHM_DIR, name)
        upto = size if backed is None else min(size, _round_up(backed, BACK_STEP))
        try:
            os.ftruncate(fd, size)
            _reserve(fd, 0, upto, path)
        except BaseException:
            os.close(fd)
            raise
        block = cls(name, size, fd, owner=True, backed=upto)
        if prefault:
            block.prefault(0, upto)
        return block

    def ensure(self, nbytes: int) -> None:
        """Reserves (posix_fallocate: ``ShmTooSmall``, never SIGBUS) and prefaults the block up to
        ``nbytes`` (rounded up to 1 MiB, at most its size) if that part is not backed yet."""
        if nbytes <= self.backed:
            return
        upto = min(self.size, _round_up(nbytes, BACK_STEP))
        _reserve(self.fd, self.backed, upto - self.backed, os.path.join(SHM_DIR, self.name))
        self.prefault(self.backed, upto)
        self.backed = upto

    @classmethod
    def attach(cls, fd: int, size: int, name: str = "attached") -> "Block":
        """Maps a block received as a file descriptor (the writer process's side); takes the fd."""
        if os.fstat(fd).st_size < size:
            os.close(fd)
            raise ValueError(f"shared block {name} is smaller than {size} bytes")
        return cls(name, size, fd, owner=False)

    def prefault(self, start: int = 0, stop: int | None = None) -> None:
        """Touches every page of [start, stop) once (first touch of fresh memory is slow on this VM
        class, and would otherwise be paid by the first capture)."""
        stop = self.size if stop is None else stop
        step = 64 << 20
        # A memoryview: slicing the bytes itself would copy the last partial chunk into a malloc'd buffer
        # (up to 64 MiB) that glibc's raised mmap threshold keeps resident in the heap afterwards.
        zeros = memoryview(bytes(min(step, max(stop - start, 0))))
        for pos in range(start, stop, step):
            end = min(pos + step, stop)
            self.view[pos:end] = zeros[: end - pos]

    def close(self) -> None:
        """Unmaps and closes the descriptor. Idempotent."""
        try:
            self.view.release()
        except Exception:  # noqa: BLE001 - exported views may still exist; the map closes with them
            pass
        try:
            self.map.close()
        except BufferError:
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


BACK_STEP = 1 << 20


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _reserve(fd: int, offset: int, length: int, path: str) -> None:
    """posix_fallocate, with a full /dev/shm turned into ``ShmTooSmall`` naming the setting."""
    if length <= 0:
        return
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise ShmTooSmall(
                f"/dev/shm cannot hold the state: {offset + length} bytes needed, {shm_free_bytes()} free",
                path=path,
                hint="raise the shared-memory limit (docker run --shm-size=<state size + 10%>; in "
                "Kubernetes mount an emptyDir with medium: Memory at /dev/shm)",
            ) from None
        raise


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


#: Names tried before giving up: a collision needs a file of another user (or an earlier process of
#: our pid) under the very name we drew, so a second draw is practically always free.
NAME_ATTEMPTS = 8


def _create_unlinked() -> tuple[str, int]:
    """A fresh /dev/shm file of our own, opened O_EXCL|O_NOFOLLOW and unlinked at once; returns its
    name and descriptor. A name already taken (another user's file, which we may not remove, or a
    symlink) is never opened or removed: we draw another (issue 10, item 13)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(NAME_ATTEMPTS):
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            continue
        os.unlink(path)  # from here on only file descriptors keep it alive
        return name, fd
    raise FileExistsError(errno.EEXIST, f"{NAME_ATTEMPTS} fresh names in {SHM_DIR} were all taken", SHM_DIR)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_stale() -> list[str]:
    """Removes names that a process of ours killed in the microseconds between create and unlink left.
    Only names provably ours are removed: a regular file (never a symlink) owned by our uid whose pid
    is dead. Anything else (another user's file, a live pid, a name we may not unlink) is skipped
    silently: someone else's leftover never stops a Checkpointer (issue 10, item 13)."""
    removed = []
    uid = os.geteuid()
    for name in _names():
        try:
            pid = int(name[len(PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if not 0 < pid < 2**31:  # os.kill(0) is our process group; a huge pid is no process (OverflowError)
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or _pid_alive(pid):
            continue
        try:
            os.unlink(path)
        except OSError:  # gone already, or not ours to remove after all (EPERM, EACCES, EROFS)
            continue
        removed.append(name)
    return removed


def _names() -> list[str]:
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX))
    except FileNotFoundError:
        return []


def leftover_segments(pid: int | None = None) -> list[str]:
    """Blocks made by ckptstore (by one pid, if given) that still exist: names in /dev/shm, or
    unlinked blocks some process still holds open or mapped (found through /proc). For leak checks."""
    tag = PREFIX if pid is None else f"{PREFIX}{pid}-"
    found = {n for n in _names() if n.startswith(tag)}
    marker = f"{SHM_DIR}/{tag}"
    for proc in os.listdir("/proc"):
        if not proc.isdigit():
            continue
        for sub in ("fd", "map_files"):
            base = f"/proc/{proc}/{sub}"
            try:
                entries = os.listdir(base)
            except OSError:
                continue
            for entry in entries:
                try:
                    target = os.readlink(f"{base}/{entry}")
                except OSError:
                    continue
                if target.startswith(marker):
                    found.add(target[len(SHM_DIR) + 1:].split(" ", 1)[0])
    return sorted(found)
