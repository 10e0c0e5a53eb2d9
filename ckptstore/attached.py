"""Files that belong to a cut (issue 13): a config, a tokenizer, a data-loader journal, copied with it.

``save``/``maybe_cut``/``cut`` take ``files=``: paths of files or directories, or a mapping of names to
paths. Each file is read at capture time, while the loop waits, so the cut never holds a later step's
bytes; its bytes become a 1-D ``uint8`` array of the cut named ``~files/<path>`` (a name no state can
have: state array names escape ``~`` as ``~0``), written, hashed and verified like every other array,
and the manifest lists it in ``attached`` (``path``, ``rank``, ``nbytes``, ``mode``). ``Store.restore_files``
puts them back under a directory of the caller's choice, each with the permission bits it had.

Stored paths are relative POSIX paths: a file is stored under its base name, a directory's files under
the directory's base name (``files=["cfg.yaml", "ledger/"]`` gives ``cfg.yaml`` and ``ledger/...``), a
mapping's under its keys. A path is refused on parse (and so on restore) unless every component is
a plain name (not empty, ``.`` or ``..``, no backslash, no control character): a hostile manifest
cannot make ``restore_files`` write outside its target.

What is attached: regular files, following a symlink to one. A directory is walked without following
symlinked directories; a symlink to a directory, a FIFO, a socket or a device is refused, all such in
one error. A file that changes size while it is read is refused (the cut would hold a torn copy).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from dataclasses import dataclass
from typing import Annotated, Any, Iterable, Iterator, Mapping, Sequence, Union

from pydantic import AfterValidator, Field, SerializerFunctionWrapHandler, field_validator, model_serializer

from .arrays import ArrayItem
from .errors import CkptStoreError, StorageError, UnsupportedValue, UsageError
from .models import StrictModel

#: The prefix of the array names that hold attached files.
FILES_PREFIX = "~files/"
#: Longest stored path, in bytes (UTF-8); each component at most NAME_MAX.
MAX_PATH_BYTES = 4000  # its array name (``~files/`` + path) stays within a manifest's 4096
NAME_MAX = 255
#: Most files one cut may carry (each is a manifest record and an array).
MAX_FILES = 100_000
#: The mode bits a cut keeps of a file: read, write and execute for owner, group and others. Setuid,
#: setgid and sticky are dropped at capture and refused on parse (issue 19 item 8): a restore must never
#: make a set-id program out of a checkpoint, which may come from another user or machine.
MODE_BITS = 0o777

#: What ``files=`` takes: a path, several, or {stored path: source path}.
FilesArg = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]], Mapping[str, Union[str, "os.PathLike[str]"]]]


_CONTROL_OR_BACKSLASH = re.compile(r"[\x00-\x1f\x7f\\]")


def check_path(p: str) -> str:
    """``p`` when it is a relative POSIX path of plain components; ValueError otherwise."""
    if not isinstance(p, str) or not p:
        raise ValueError("an attached file's path must be a non-empty string")
    if len(p.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise ValueError(f"attached path {p[:60]!r}... is longer than {MAX_PATH_BYTES} bytes")
    if _CONTROL_OR_BACKSLASH.search(p):
        raise ValueError(f"attached path {p!r} holds a control character or a backslash")
    for part in p.split("/"):
        if part in ("", ".", ".."):
            raise ValueError(f"attached path {p!r} is not a relative path of plain names")
        if len(part.encode("utf-8", "surrogatepass")) > NAME_MAX:
            raise ValueError(f"attached path {p!r} has a component longer than {NAME_MAX} bytes")
    return p


AttachedPath = Annotated[str, AfterValidator(check_path)]


class AttachedFile(StrictModel):
    """A file of a cut: its bytes are the ``uint8`` array :func:`array_name` of rank ``rank``."""

    path: AttachedPath
    rank: int = Field(default=0, ge=0)
    nbytes: int = Field(ge=0)
    #: The file's permission bits at the cut (``MODE_BITS`` of them), restored exactly; None in cuts
    #: saved before modes were kept (issue 19 item 8), whose restore keeps a replaced file's own mode.
    mode: int | None = None

    @field_validator("mode")
    @classmethod
    def _permission_bits(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MODE_BITS:
            raise ValueError(f"attached file mode {v:#o} is not permission bits (0o0 to {MODE_BITS:#o}; "
                             "setuid, setgid and sticky are never kept)")
        return v

    @model_serializer(mode="wrap")
    def _without_unknown_mode(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        doc = handler(self)
        if doc.get("mode", 0) is None:  # a record of an older cut: written back as it was read
            del doc["mode"]
        return doc

    @property
    def array(self) -> str:
        return array_name(self.path)


def array_name(path: str) -> str:
    return FILES_PREFIX + path


def check_listing(files: Iterable[tuple[int, str]]) -> None:
    """ValueError unless the (rank, path) pairs are unique and no path is also another's directory of
    the same rank (``a`` and ``a/b``: a restore could not write both)."""
    seen: set[tuple[int, str]] = set()
    dirs: set[tuple[int, str]] = set()
    for rank, path in files:
        key = (rank, path)
        if key in seen:
            raise ValueError(f"attached path {path!r} is listed twice" + (f" for rank {rank}" if rank else ""))
        seen.add(key)
        parts = path.split("/")
        for i in range(1, len(parts)):
            dirs.add((rank, "/".join(parts[:i])))
    clash = sorted(p for r, p in seen & dirs)
    if clash:
        raise ValueError(f"attached path {clash[0]!r} is both a file and a directory")


# --------------------------------------------------------------------------------------- capture side
@dataclass
class Source:
    """A file opened for attaching: ``path`` is its stored path, ``origin`` where it was read."""

    path: str
    origin: str
    fd: int
    nbytes: int
    mode: int = 0o644

    def describe(self) -> tuple[str, str, str, tuple[int, ...], int]:
        """(name, kind, dtype, shape, nbytes) of its array, as ``writer.capture.describe_leaf``."""
        return array_name(self.path), "numpy", "|u1", (self.nbytes,), self.nbytes

    def read_into(self, buf: memoryview, *, where: dict[str, Any]) -> None:
        """Reads the whole file into ``buf`` (``nbytes`` long); refuses a file whose size changed since
        it was opened (the copy would be torn)."""
        done = 0
        while done < self.nbytes:
            n = os.preadv(self.fd, [buf[done:self.nbytes]], done)
            if n == 0:
                raise UsageError(f"attached file {self.origin} shrank while it was read ({done} of {self.nbytes} "
                                 "bytes)", **where, hint="attach files nothing writes during the cut")
            done += n
        if os.pread(self.fd, 1, self.nbytes):
            raise UsageError(f"attached file {self.origin} grew while it was read (past {self.nbytes} bytes)",
                             **where, hint="attach files nothing writes during the cut")

    def item(self, *, where: dict[str, Any]) -> ArrayItem:
        """The file's bytes, read now, as an array ready for ``write_shards`` (``Store.save``)."""
        buf = bytearray(self.nbytes)
        self.read_into(memoryview(buf), where=where)
        name, kind, dtype, shape, nbytes = self.describe()
        return ArrayItem(name, kind, dtype, shape, nbytes, memoryview(buf))

    def record(self, rank: int = 0) -> AttachedFile:
        # The path was checked when the file was opened; a manifest or rank record built from these
        # records validates them all again when it is parsed.
        return AttachedFile.model_construct(path=self.path, rank=rank, nbytes=self.nbytes, mode=self.mode)


def _entries(files: FilesArg) -> list[tuple[str | None, str]]:
    """(stored name or None for "the base name", source path) for each entry of ``files=``."""
    if isinstance(files, Mapping):
        return [(str(k), os.fspath(v)) for k, v in files.items()]
    if isinstance(files, (str, os.PathLike)):
        return [(None, os.fspath(files))]
    if isinstance(files, (list, tuple)):
        return [(None, os.fspath(f)) for f in files]
    raise UsageError(f"files= takes a path, a list of paths or a mapping of names to paths, not {type(files).__name__}")


def open_sources(files: FilesArg | None, *, where: dict[str, Any]) -> list[Source]:
    """Opens every file ``files=`` names (directories walked), in a stable order. Raises
    ``UnsupportedValue`` listing every entry that is not a regular file, and ``UsageError`` for a missing
    path, an unusable stored name, or two files with one stored path. Nothing is left open on error."""
    if files is None:
        return []
    found: list[tuple[str, str]] = []  # (stored path, source path)
    refused: list[str] = []
    for name, src in _entries(files):
        base = name if name is not None else os.path.basename(os.path.normpath(src))
        try:
            st = os.stat(src)
        except FileNotFoundError:
            raise UsageError(f"attached file {src} does not exist", **where) from None
        except OSError as exc:
            raise UsageError(f"attached file {src} cannot be read: {exc.strerror}", **where) from exc
        if stat.S_ISDIR(st.st_mode):
            found.extend(_walk(src, base, refused))
        elif stat.S_ISREG(st.st_mode):
            found.append((base, src))
        else:
            refused.append(f"{src}: {_kind(st.st_mode)}")
    if refused:
        raise UnsupportedValue(f"cannot attach {len(refused)} path(s), only regular files and directories of them:\n"
                               + "\n".join(f"  {r}" for r in refused[:20])
                               + (f"\n  ... and {len(refused) - 20} more" if len(refused) > 20 else ""), **where)
    if len(found) > MAX_FILES:
        raise UsageError(f"files= names {len(found)} files; a cut carries at most {MAX_FILES}", **where)
    sources: list[Source] = []
    try:
        for stored, src in found:
            try:
                check_path(stored)
            except ValueError as exc:
                raise UsageError(f"cannot attach {src}: {exc}", **where) from None
            fd = os.open(src, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            sources.append(Source(stored, src, fd, 0))
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # replaced between the walk and the open
                raise UnsupportedValue(f"cannot attach {src}: {_kind(st.st_mode)}", **where)
            sources[-1].nbytes, sources[-1].mode = st.st_size, stat.S_IMODE(st.st_mode) & MODE_BITS
        try:
            check_listing((0, s.path) for s in sources)
        except ValueError as exc:
            raise UsageError(f"files=: {exc}", **where,
                             hint="name the files with a mapping {stored path: source path}") from None
    except BaseException:
        close_sources(sources)
        raise
    return sources


def _walk(root: str, base: str, refused: list[str]) -> list[tuple[str, str]]:
    """(stored path, source path) of every regular file under ``root``, sorted; what is not a regular
    file (or a directory to walk) is added to ``refused``. One ``scandir`` per directory: the entry
    types come from it, so a plain file costs no ``stat`` here (its size comes from ``fstat`` once open)."""
    out: list[tuple[str, str]] = []
    stack = [(root, base)]
    while stack:
        path, prefix = stack.pop()
        with os.scandir(path) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append((e.path, f"{prefix}/{e.name}"))
                elif e.is_file(follow_symlinks=True):
                    out.append((f"{prefix}/{e.name}", e.path))
                elif e.is_symlink() and e.is_dir(follow_symlinks=True):
                    refused.append(f"{e.path}: a symlink to a directory")
                else:
                    refused.append(f"{e.path}: {_kind(e.stat().st_mode)}")
            except OSError as exc:
                refused.append(f"{e.path}: {exc.strerror}")
    return sorted(out)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def close_sources(sources: Iterable[Source]) -> None:
    for s in sources:
        try:
            os.close(s.fd)
        except OSError:
            pass


# --------------------------------------------------------------------------------------- restore side
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


__all__ = ["AttachedFile", "FILES_PREFIX", "MODE_BITS", "FilesArg", "Source", "array_name", "check_path",
           "open_sources", "close_sources", "Restorer"]
