"""The capture side of attached files (issue 13; split out of attached.py for issue 20): the paths of
``files=`` opened at capture time (:func:`open_sources`), each a :class:`Source` read whole into the cut
while the loop waits, refused if it changes size while it is read."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ..arrays import ArrayItem
from ..errors import UnsupportedValue, UsageError
from .record import MAX_FILES, MODE_BITS, AttachedFile, FilesArg, array_name, check_listing, check_path


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


__all__ = ["Source", "close_sources", "open_sources"]
