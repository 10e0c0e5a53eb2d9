"""The restore side of attached files (issue 13; split out of attached.py for issue 20): the
:class:`Restorer` that ``Store.restore_files`` streams a cut's attached files into, putting them in
place only once all were read and verified."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import Any, Iterator, Sequence

from ..errors import CkptStoreError, StorageError, UsageError
from .record import NAME_MAX, AttachedFile


class Restorer:
    """Writes attached files under ``to`` as their bytes stream in, and puts them in place only once all
    were read and verified (:meth:`commit`): each goes to a temporary name beside its final one, is
    fsynced, and is renamed over it in ``commit``; ``abort`` removes the temporary files. So a damaged
    shard, a failed read or a crash leaves every file old or new, never torn, and memory stays bounded
    whatever the files' sizes. Directories under ``to`` are entered with ``O_NOFOLLOW``, so a stored path
    can never lead outside ``to``. Each file gets the permission bits the cut recorded, exactly (the
    umask does not apply; a cut saved before modes were kept leaves a replaced file's mode as it was).
    The target's OSErrors (a full disk, EIO, EACCES) are StorageErrors naming the store, the cut and the
    file. Use as a context manager: leaving it without ``commit`` aborts."""

    def __init__(self, files: Sequence[AttachedFile], to: str, *, overwrite: bool, where: dict[str, Any]) -> None:
        self.to, self.where = to, where
        self._dirs: dict[tuple[str, ...], int] = {}  # entered once, fsynced once in commit
        self._temps: list[tuple[int, str, str, str]] = []  # (dir fd, temp name, final name, shown path)
        # The file being written: its fd, the mode end() gives it (None: leave it), its path under ``to``.
        self._fd, self._shown = -1, to
        self._mode: int | None = None
        self._committed = False
        try:
            with self._os_errors("opening the restore target", to):
                os.makedirs(to, exist_ok=True)
                self._dirs[()] = os.open(to, os.O_RDONLY | os.O_DIRECTORY)
                exist = [] if overwrite else [f.path for f in files if _mode_under(self._dirs[()], f.path) is not None]
        except BaseException:
            self.abort()
            raise
        if exist:
            self.abort()
            raise UsageError(f"{len(exist)} file(s) to restore exist under {to}: {exist[:5]}", path=to, **where,
                             hint="pass overwrite=True to replace them")

    def __enter__(self) -> "Restorer":
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._committed:
            self.abort()

    def _os_errors(self, action: str, path: str) -> contextlib.AbstractContextManager[None]:
        return _target_errors(action, path, self.to, self.where)

    def begin(self, rec: AttachedFile) -> None:
        """Starts the file ``rec``: a new temporary file beside where it goes."""
        parts = rec.path.split("/")
        self._shown = shown = os.path.join(self.to, *parts)
        dfd = _enter_dirs(self._dirs, tuple(parts[:-1]), self.to, self.where)
        with self._os_errors("creating the temporary file of a restored file", shown):
            existing = _mode_under(dfd, parts[-1])
            if existing is not None and stat.S_ISDIR(existing):
                raise UsageError(f"cannot restore {shown}: a directory is in the way", path=shown, **self.where)
            self._mode = rec.mode if rec.mode is not None else (
                stat.S_IMODE(existing) if existing is not None and stat.S_ISREG(existing) else None)
            tmp = _temp_name(parts[-1], len(self._temps))
            # Written under 0600 and given its mode in end(), so a 0600 token is never readable by others
            # while it is written; a new file of a cut without modes is 0644 minus the umask, as before.
            self._fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                               0o600 if self._mode is not None else 0o644, dir_fd=dfd)
        self._temps.append((dfd, tmp, parts[-1], shown))

    def write(self, data: memoryview) -> None:
        with self._os_errors("writing a restored file", self._shown):
            done = 0
            while done < len(data):
                done += os.write(self._fd, data[done:])

    def end(self) -> None:
        """The file is complete (not yet verified): given its mode and made durable under its temporary name."""
        fd, self._fd = self._fd, -1
        with self._os_errors("syncing a restored file", self._shown):
            try:
                if self._mode is not None:
                    os.fchmod(fd, self._mode)  # issue 19 item 8: the cut's bits, not 0644 minus the umask
                os.fsync(fd)
            finally:
                os.close(fd)

    def commit(self) -> list[str]:
        """Every file was read and verified: each temporary file replaces its final name, then every
        directory is fsynced. Returns the paths written, in the order they came."""
        for dfd, tmp, name, shown in self._temps:
            with self._os_errors("renaming a restored file into place", shown):
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        with self._os_errors("syncing the restored directories", self.to):
            for fd in self._dirs.values():
                os.fsync(fd)
        self._committed = True
        written = [shown for _, _, _, shown in self._temps]
        self._close()
        return written

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        for dfd, tmp, _name, _shown in self._temps:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
        self._temps.clear()
        self._close()

    def _close(self) -> None:
        for fd in self._dirs.values():
            os.close(fd)
        self._dirs.clear()


def _temp_name(name: str, n: int) -> str:
    """The hidden temporary name beside ``name`` for this process's ``n``-th file, within NAME_MAX bytes:
    the name is cut in bytes, at a character boundary (issue 19 item 4: cut at 200 characters, a legal
    name of 228-255 bytes of multibyte characters gave a temporary name too long to create)."""
    suffix = f".ckptstore-restore-{os.getpid()}-{n}"
    head = os.fsencode(name)[: NAME_MAX - 1 - len(suffix)].decode("utf-8", "ignore")
    return f".{head}{suffix}"


@contextlib.contextmanager
def _target_errors(action: str, path: str, to: str, where: dict[str, Any]) -> Iterator[None]:
    """Turns an OSError of the restore's target ``to`` while doing ``action`` into a StorageError naming
    the store, the cut and ``path`` (issue 19 item 9: a full disk raised a bare OSError naming nothing);
    ckptstore errors pass as they are."""
    try:
        yield
    except CkptStoreError:
        raise
    except OSError as exc:
        hint = _TARGET_HINTS.get(exc.errno or 0, "").format(to=to) or None
        raise StorageError.from_os_error(exc, action, hint=hint, path=path, **where) from exc


#: What to do about the target's refusals (StorageError's own hints speak of the store).
_TARGET_HINTS = {
    **dict.fromkeys((errno.ENOSPC, errno.EDQUOT), "the file system of {to} is full: free space there and restore "
                    "again; every file under it is as it was or as in the cut, never torn"),
    **dict.fromkeys((errno.EACCES, errno.EPERM, errno.EROFS), "{to} is not writable by this process"),
}


def _mode_under(dfd: int, path: str) -> int | None:
    """The ``st_mode`` of ``path`` under the open directory ``dfd`` (a symlink's own), None if absent."""
    try:
        return os.stat(path, dir_fd=dfd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return None


def _enter_dirs(dirs: dict[tuple[str, ...], int], parts: tuple[str, ...], to: str, where: dict[str, Any]) -> int:
    """The open directory ``to/parts...``, made as needed, each level entered with O_NOFOLLOW."""
    if parts in dirs:
        return dirs[parts]
    parent = _enter_dirs(dirs, parts[:-1], to, where)
    shown = os.path.join(to, *parts)
    with _target_errors("creating a directory of restored files", shown, to, where):
        try:
            os.mkdir(parts[-1], 0o777, dir_fd=parent)
        except FileExistsError:
            pass
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
        except OSError as exc:
            if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                raise
            raise UsageError(f"cannot restore into {shown}: not a directory (or a symlink)", path=to,
                             **where) from exc
    dirs[parts] = fd
    return fd


__all__ = ["Restorer"]
