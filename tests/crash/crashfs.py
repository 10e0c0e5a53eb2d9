"""CrashFS: an in-memory storage backend that records every operation and can materialize what a disk
could hold after a power loss at any point of that log.

Model (POSIX, as ext4 with default options behaves in the worst case):
- a file's data is durable only as of its last fsync; data written after that may be lost;
- a directory entry (create, rename, unlink, mkdir, rmdir) is durable only as of the parent directory's
  last fsync; an entry made after it may be undone, a removal after it may be undone.

``materialize(i, k, dest)`` builds, in a real directory, the disk after a crash right after operation
``i``, where the kernel had written back everything up to operation ``k`` (``k = 0``: nothing that was
not fsynced survives; ``0 < k <= i``: an arbitrary prefix of the non-durable operations survived).
Each directory and each file independently takes its newest fsynced state in ``(k, i]``, else its state
at ``k``.

Knobs break the fsync discipline on purpose (``skip_dir_fsync``, ``skip_file_fsync``), to show that the
tests catch a missing fsync.
"""

from __future__ import annotations

import io
import itertools
import os
from dataclasses import dataclass
from typing import BinaryIO

from ckptstore import layout
from ckptstore.storage import Entry, Sink, Storage

DIR = "<dir>"


@dataclass
class Op:
    kind: str  # write | fsync-file | fsync-dir | create | rename | unlink | mkdir | rmdir
    target: str
    ns: dict[str, object]  # path -> inode id (int) or DIR, after the op
    data: dict[int, bytes]  # inode -> content, after the op


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


class CrashSink(Sink):
    def __init__(self, fs: "CrashFS", rel: str) -> None:
        self.fs, self.rel = fs, rel
        self.inode = fs._create(rel)

    def write(self, data: memoryview | bytes) -> None:
        self.fs._append(self.inode, bytes(data))

    def close(self) -> None:
        self.fs._fsync_file(self.inode)

    def abort(self) -> None:
        if self.rel in self.fs.ns:
            self.fs._unlink(self.rel)


class CrashFS(Storage):

    def __init__(self, *, skip_dir_fsync: bool = False, skip_file_fsync: bool = False) -> None:
        self.url = "crashfs://store"
        self.ns: dict[str, object] = {"": DIR}
        self.data: dict[int, bytes] = {}
        self.ops: list[Op] = [Op("start", "", dict(self.ns), {})]
        self._inodes = itertools.count(1)
        self.skip_dir_fsync = skip_dir_fsync
        self.skip_file_fsync = skip_file_fsync

    # recording ------------------------------------------------------------------------------------
    def _record(self, kind: str, target: str) -> None:
        self.ops.append(Op(kind, target, dict(self.ns), dict(self.data)))

    def _need_dir(self, path: str) -> None:
        if self.ns.get(path) != DIR:
            raise FileNotFoundError(2, "No such directory", path)

    def _create(self, rel: str) -> int:
        self._need_dir(_parent(rel))
        if rel in self.ns:
            raise FileExistsError(17, "File exists", rel)
        inode = next(self._inodes)
        self.ns[rel] = inode
        self.data[inode] = b""
        self._record("create", rel)
        return inode

    def _append(self, inode: int, data: bytes) -> None:
        self.data[inode] = self.data[inode] + data
        self._record("write", str(inode))

    def _fsync_file(self, inode: int) -> None:
        if not self.skip_file_fsync:
            self._record("fsync-file", str(inode))

    def _fsync_dir(self, path: str) -> None:
        if not self.skip_dir_fsync:
            self._record("fsync-dir", path)

    def _unlink(self, rel: str) -> None:
        inode = self.ns.pop(rel)
        assert inode != DIR
        self._record("unlink", rel)

    # the Storage verbs -----------------------------------------------------------------------------
    def write_durably(self, rel: str, data: bytes) -> None:
        tmp = f"{_parent(rel)}/{layout.tmp_name(rel.rsplit('/', 1)[-1])}".lstrip("/")
        inode = self._create(tmp)
        self._append(inode, bytes(data))
        self._fsync_file(inode)
        self.ns[rel] = self.ns.pop(tmp)
        self._record("rename", rel)
        self._fsync_dir(_parent(rel))

    def open_sink(self, rel: str) -> Sink:
        return CrashSink(self, rel)

    def _file(self, rel: str) -> bytes:
        inode = self.ns.get(rel)
        if inode is None or inode == DIR:
            raise FileNotFoundError(2, "No such file", rel)
        return self.data[inode]  # type: ignore[index]

    def read_bytes(self, rel: str) -> bytes:
        return self._file(rel)

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        return self._file(rel)[start:end]

    def open_reader(self, rel: str) -> BinaryIO:
        return io.BytesIO(self._file(rel))

    def size(self, rel: str) -> int:
        return len(self._file(rel))

    def exists(self, rel: str) -> bool:
        return rel in self.ns

    def list_dir(self, rel: str) -> list[Entry]:
        if self.ns.get(rel) != DIR:
            return []
        prefix = f"{rel}/" if rel else ""
        out = []
        for path, v in self.ns.items():
            if path and path.startswith(prefix) and "/" not in path[len(prefix):]:
                out.append(Entry(path[len(prefix):], v == DIR, 0 if v == DIR else len(self.data[v])))  # type: ignore[index]
        return sorted(out, key=lambda e: e.name)

    def make_dir(self, rel: str) -> None:
        if self.ns.get(rel) == DIR:
            return
        self._need_dir(_parent(rel))
        self.ns[rel] = DIR
        self._record("mkdir", rel)
        self._fsync_dir(_parent(rel))

    def delete(self, rel: str, *, durable: bool = True) -> None:
        if rel not in self.ns:
            return
        self._unlink(rel)
        if durable:
            self._fsync_dir(_parent(rel))

    def remove_dir(self, rel: str) -> None:
        if self.ns.get(rel) != DIR:
            return
        if any(p.startswith(rel + "/") for p in self.ns):
            raise OSError(39, "Directory not empty", rel)
        del self.ns[rel]
        self._record("rmdir", rel)
        self._fsync_dir(_parent(rel))

    def sync_dir(self, rel: str) -> None:
        self._fsync_dir(rel)

    # crash materialization -------------------------------------------------------------------------
    def disk_after(self, i: int, k: int) -> dict[str, bytes | None]:
        """The post-crash disk (see the module docstring) as {path: content, or None for a directory}."""
        assert 0 <= k <= i < len(self.ops)
        base = self.ops[k]

        def newest_fsync(kind: str, target: str) -> Op | None:
            for j in range(i, k, -1):
                op = self.ops[j]
                if op.kind == kind and op.target == target:
                    return op
            return None

        def children(d: str) -> dict[str, object]:
            src = newest_fsync("fsync-dir", d) or base
            prefix = f"{d}/" if d else ""
            return {p[len(prefix):]: v for p, v in src.ns.items()
                    if p and p.startswith(prefix) and "/" not in p[len(prefix):]}

        def content(inode: int) -> bytes:
            src = newest_fsync("fsync-file", str(inode)) or base
            return src.data.get(inode, b"")

        out: dict[str, bytes | None] = {}

        def build(d: str) -> None:
            for name, v in children(d).items():
                path = f"{d}/{name}" if d else name
                if v == DIR:
                    out[path] = None
                    build(path)
                else:
                    out[path] = content(v)  # type: ignore[arg-type]

        build("")
        return out

    @staticmethod
    def write_disk(disk: dict[str, bytes | None], dest: str) -> None:
        os.makedirs(dest, exist_ok=True)
        for path, data in sorted(disk.items()):
            full = os.path.join(dest, *path.split("/"))
            if data is None:
                os.makedirs(full, exist_ok=True)
            else:
                with open(full, "wb") as f:
                    f.write(data)
