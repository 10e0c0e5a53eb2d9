"""Hand a cut to tools that know only safetensors or torch.save files.

Reading the store and writing the output are two separate trust decisions: ``allow_pickle`` lets the
*read* unpickle values a cut holds (never the default: a planted pickle node must not run), while
``allow_pickle_format`` only permits the *output* format torch.save (a pickle its readers unpickle).
The output is written to a fresh temp file in the target's directory (O_EXCL, never following a
symlink), fsynced and renamed over the target, which must not exist unless ``force``.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from typing import Any, BinaryIO, Callable

from .arrays import describe
from .errors import UnsupportedValue, UsageError
from .format import encode_header, header_dtype
from .store import CutSelector, Store, rank_manifest
from .tree import flatten


def export_cut(store: Store, cut: CutSelector, path: str, *, fmt: str, allow_pickle_format: bool = False,
               allow_pickle: bool = False, force: bool = False, rank: int | None = None) -> dict[str, Any]:
    """Writes one cut (verified on the way) to ``path`` as a single safetensors file (no pickle; the
    non-tensor structure goes into ``__metadata__["ckptstore_tree"]``) or a torch.save file (needs
    ``allow_pickle_format``, since torch.load unpickles; it loads with plain ``torch.load(path)``, whose
    ``weights_only=True`` default refuses numpy objects, so numpy arrays become tensors and numpy
    scalars python scalars: :func:`torch_loadable`).

    ``allow_pickle`` lets the read unpickle the cut's pickled values (only for cuts you trust); it is
    independent of ``allow_pickle_format``. ``path``'s directory must exist; an existing ``path`` is
    refused unless ``force``. A cut of several ranks holds one state per rank: ``rank`` picks the one
    to export (its safetensors metadata then also names ``ckptstore_rank`` and
    ``ckptstore_world_size``); without it such a cut raises ``UsageError`` naming its world size."""
    if fmt not in ("safetensors", "torch"):
        raise UsageError(f"unknown export format {fmt!r}: use safetensors or torch", store=store.url)
    if fmt == "torch" and not allow_pickle_format:
        raise UsageError("the torch format is a pickle that torch.load unpickles; pass --allow-pickle-format "
                         "(allow_pickle_format=True) to export it anyway", store=store.url)
    check_target(path, force=force, store=store.url)
    whole = store.manifest(cut)
    m = rank_manifest(whole, rank, store.url)
    state = store.load(m.cut, allow_pickle=allow_pickle, rank=rank)
    done = {"cut": m.cut, "format": fmt, "path": path, "world_size": whole.world_size, "rank": rank}
    if fmt == "torch":
        import torch

        loadable = torch_loadable(state, (), store=store.url, cut=m.cut)
        write_replacing(path, lambda f: torch.save(loadable, f), force=force, store=store.url)
        return {**done, "tensors": len(m.tensors)}
    tree, leaves = flatten(state)
    items = [describe(leaf) for leaf in leaves]
    meta = {"ckptstore_cut": m.cut, "ckptstore_step": str(m.step), "ckptstore_tree": json.dumps(tree)}
    if whole.world_size > 1:
        meta.update(ckptstore_rank=str(rank), ckptstore_world_size=str(whole.world_size))
    header = encode_header(
        [(it.name, *header_dtype(it.kind, it.dtype, it.shape, it.nbytes), it.nbytes) for it in items], meta)

    def write(f: BinaryIO) -> None:
        f.write(header)
        for it in items:
            f.write(it.data)

    write_replacing(path, write, force=force, store=store.url)
    return {**done, "tensors": len(items)}


def check_target(path: str, *, force: bool, store: str | None = None) -> None:
    """Refuses, before any work, a target whose directory is missing (naming the target, not a temp
    file), a target that is a directory, and an existing target without ``force``."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"cannot export to {path}: its directory {parent} does not exist", store=store, path=path)
    if os.path.isdir(path) and not os.path.islink(path):
        raise UsageError(f"cannot export to {path}: it is a directory", store=store, path=path)
    if os.path.lexists(path) and not force:
        raise UsageError(f"{path} exists; pass --force (force=True) to replace it", store=store, path=path)


def write_replacing(path: str, write: Callable[[BinaryIO], None], *, force: bool, store: str | None = None) -> None:
    """Writes ``path`` through a temp file of our own in the same directory: created with
    O_CREAT|O_EXCL|O_NOFOLLOW (a symlink or file planted under its name is never followed or
    truncated), fsynced, renamed over ``path`` (which replaces a symlink there, never its target) and
    the directory fsynced. The temp file is removed on any failure."""
    check_target(path, force=force, store=store)
    parent = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{os.getpid()}-{secrets.token_hex(6)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        if not force and os.path.lexists(path):  # appeared while we wrote
            raise UsageError(f"{path} exists; pass --force (force=True) to replace it", store=store, path=path)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dfd = os.open(parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def torch_loadable(value: Any, path: tuple[Any, ...], *, store: str | None = None, cut: str | None = None) -> Any:
    """``value`` with what ``torch.load(weights_only=True)`` refuses replaced: a numpy array becomes a
    tensor of the same dtype and shape (native byte order), a numpy scalar the python scalar of its
    ``.item()``; containers are rebuilt with the same types. datetime64/timedelta64 values have no
    torch form and are refused with ``UnsupportedValue`` naming the key path (export them as safetensors)."""
    np = sys.modules.get("numpy")  # a loaded state holds numpy values only if numpy is imported
    if isinstance(value, dict):
        return type(value)((k, torch_loadable(v, path + (k,), store=store, cut=cut)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(torch_loadable(v, path + (i,), store=store, cut=cut) for i, v in enumerate(value))
    if np is None or not isinstance(value, (np.ndarray, np.generic)):
        return value
    if value.dtype.kind in "mMOVUS":
        raise UnsupportedValue(f"numpy {value.dtype} value at {_key(path)!r} has no form torch.load(weights_only=True) "
                               "accepts; export this cut as safetensors", store=store, cut=cut)
    if isinstance(value, np.generic):
        return value.item()
    import torch

    native = value.astype(value.dtype.newbyteorder("="), copy=False)
    if not native.flags.c_contiguous:
        native = native.copy(order="C")
    try:
        return torch.from_numpy(native)
    except TypeError:  # a numpy dtype torch has no tensor for (longdouble)
        raise UnsupportedValue(f"numpy {value.dtype} array at {_key(path)!r} has no torch dtype; export this "
                               "cut as safetensors", store=store, cut=cut) from None


def _key(path: tuple[Any, ...]) -> str:
    return "/".join(str(k) for k in path) or "<root>"
