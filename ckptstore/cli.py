"""The ``ckptstore`` command: parse, call one library function, render a table or ``--json``.

Exit codes (one table, :data:`EXIT_CODES`): 0 all is well; 1 a problem was found in the store
(a failed audit, damaged data, a broken LATEST); 2 the command could not run (bad arguments, no store,
the store locked by a writer, the file system refusing). No traceback reaches the user for a
ckptstore error; ``--debug`` shows one.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Sequence

from . import __version__, layout
from .errors import CkptStoreError, CutNotFound, DataError, StorageError, StoreLocked, UsageError
from .info import CutInfo
from .manifest import Manifest
from .retention import KeepEvery, KeepFinal, KeepLast, KeepTagged, Policy
from .selection import select_manifest
from .store import Store, leftover_json, open_for_repair, rank_manifest

EXIT_OK, EXIT_PROBLEM, EXIT_CANNOT_RUN = 0, 1, 2

#: Exception class -> exit code, most specific first.
EXIT_CODES: list[tuple[type[BaseException], int]] = [
    (UsageError, EXIT_CANNOT_RUN),
    (StoreLocked, EXIT_CANNOT_RUN),
    (StorageError, EXIT_CANNOT_RUN),
    (DataError, EXIT_PROBLEM),
    (CkptStoreError, EXIT_CANNOT_RUN),
]


def exit_code_for(exc: BaseException) -> int:
    for cls, code in EXIT_CODES:
        if isinstance(exc, cls):
            return code
    return EXIT_CANNOT_RUN


# ------------------------------------------------------------------------------------------ render
def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


class Progress:
    """A byte-progress line on stderr, only when stderr is a terminal."""

    def __init__(self, total: int, label: str) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.label = label
        self.enabled = sys.stderr.isatty()
        self._last = -1

    def __call__(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        pct = min(100, int(100 * self.done / self.total))
        if pct != self._last:
            self._last = pct
            bar = "#" * (pct // 4)
            sys.stderr.write(f"\r{self.label} [{bar:<25}] {pct:3d}% {human_bytes(self.done)}/{human_bytes(self.total)}")
            sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled and self._last >= 0:
            sys.stderr.write("\n")


def emit(args: argparse.Namespace, doc: Any, text: str) -> None:
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
    else:
        print(text)


CUT_HEADERS = ["step", "cut", "state", "tags", "size", "tensors", "ranks", "created (UTC)"]


def _cut_rows(cuts: Sequence[CutInfo], latest: str | None) -> list[list[Any]]:
    return [
        [c.step, c.id, ("LATEST " if c.id == latest else "") + ("final" if c.final else ""), ",".join(c.tags),
         human_bytes(c.nbytes), c.tensors, c.world_size, c.created_at.strftime("%Y-%m-%d %H:%M:%S")]
        for c in cuts
    ]


def _file_ranks(m: Manifest) -> dict[str, int]:
    """File name -> the rank it belongs to."""
    return {f.name: f.rank for f in m.files}


def _rank_counts(m: Manifest) -> list[dict[str, int]]:
    """Per rank: its files, tensors and stored bytes."""
    counts = [{"rank": r, "files": 0, "tensors": 0, "nbytes": 0} for r in range(m.world_size)]
    ranks = _file_ranks(m)
    for f in m.files:
        counts[f.rank]["files"] += 1
        counts[f.rank]["nbytes"] += f.nbytes
    for t in m.tensors:
        counts[ranks[t.file]]["tensors"] += 1
    return counts


def _cli_rank_part(m: Manifest, rank: int | None, url: str, what: str) -> Manifest:
    """Rank ``rank``'s part of a cut for a command that works on one rank's state (``what``); a one-line
    UsageError (exit 2) naming the world size when a cut of several ranks comes without ``--rank``."""
    if rank is None and m.world_size > 1:
        raise UsageError(f"cut {m.cut} holds the state of {m.world_size} ranks (world size {m.world_size}); "
                         f"pass --rank R (0 to {m.world_size - 1}) to {what} one rank's part", store=url, cut=m.cut)
    return rank_manifest(m, rank, url)


_NUMPY_KINDS = {"f": "float", "i": "int", "u": "uint", "b": "bool", "c": "complex", "m": "timedelta", "M": "datetime"}


def _dtype_label(kind: str, dtype: str) -> str:
    """One naming for both kinds of arrays: ``torch.float32``, ``numpy.float32`` (the manifest keeps
    numpy's ``dtype.str``, ``<f4``, which says the byte order too)."""
    if kind == "torch":
        return f"torch.{dtype}"
    code, size = dtype[1:2], dtype[2:].split("[")[0]
    base = _NUMPY_KINDS.get(code)
    if base is None or not size.isdigit():
        return f"numpy.{dtype}"
    if base == "bool":
        return "numpy.bool"
    unit = dtype[dtype.index("["):] if "[" in dtype else ""
    order = " (big-endian)" if dtype.startswith(">") else ""
    bits = int(size) * 8 if base in ("float", "int", "uint", "complex") else ""
    return f"numpy.{base}{bits}{'64' if not bits else ''}{unit}{order}"


def _selector(s: str | None) -> str | int:
    """A cut argument: "latest", a step, or a cut id. Anything else is a bad argument (exit 2), not
    damage found in the store (exit 1)."""
    if s is None or s == "latest":
        return "latest"
    if s.isdigit():
        return int(s)
    if not layout.is_cut_id(s):
        raise UsageError(f"refusing cut name {s!r}: give 'latest', a step number or a cut id "
                         "(step-<12 digits>-<8 hex>)")
    return s


# ---------------------------------------------------------------------------------------- commands
def cmd_ls(args: argparse.Namespace) -> int:
    with Store.open(args.url, readonly=True) as store:
        cls = store.classify()
        cuts = [cls.info(m) for m in cls.committed]
        latest = cls.latest.cut if cls.latest else None
        doc = {"store": store.url, "latest": latest, "latest_problem": cls.latest_problem,
               "cuts": [c.to_json() for c in cuts],
               "leftovers": [{"cut": lo.cut, "kind": lo.kind, "paths": lo.paths} for lo in cls.leftovers]}
        text = table(CUT_HEADERS, _cut_rows(cuts, latest))
        if cls.latest_problem:
            text += f"\n! {cls.latest_problem} (run `ckptstore repair {store.url}`)"
        if cls.leftovers:
            text += f"\n{len(cls.leftovers)} leftover(s) of interrupted work; `ckptstore gc` removes them"
        emit(args, doc, text)
        return EXIT_PROBLEM if cls.latest_problem else EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    with Store.open(args.url, readonly=True) as store:
        cls = store.classify()
        m = select_manifest(cls, _selector(args.cut), store.url)
        info = cls.info(m)
        # --rank R: the files and tensors listed are rank R's only (the cut's totals stay in the doc)
        part = m if args.rank is None else rank_manifest(m, args.rank, store.url)
        counts = _rank_counts(m)
        doc: dict[str, Any] = {**info.to_json(), "latest": cls.latest is not None and cls.latest.cut == m.cut,
                               "writer": m.writer.model_dump(), "metadata": m.metadata,
                               "ranks": counts, "rank": args.rank,
                               "files": [f.model_dump() for f in part.files],
                               "attached": [a.model_dump() for a in part.attached]}
        lines = [
            f"cut       {m.cut}", f"step      {m.step}", f"final     {'yes' if info.final else 'no'}",
            f"latest    {'yes' if doc['latest'] else 'no'}", f"tags      {', '.join(m.tags) or '-'}",
            f"size      {human_bytes(info.nbytes)} in {len(m.files)} file(s), {len(m.tensors) - len(m.attached)} "
            f"tensor(s)" + (f" and {len(m.attached)} attached file(s)" if m.attached else ""),
            f"ranks     {m.world_size}",
            *[f"{'rank ' + str(c['rank']):<9} {human_bytes(c['nbytes'])} in {c['files']} file(s), "
              f"{c['tensors']} tensor(s)" for c in counts if m.world_size > 1 and args.rank in (None, c["rank"])],
            f"created   {m.created_at}", f"writer    {m.writer.host} pid {m.writer.pid} ({m.writer.mode}, "
            f"ckptstore {m.writer.ckptstore_version})",
        ]
        if m.attached:
            whose = "" if args.rank is None else f" (rank {args.rank}: {len(part.attached)})"
            lines.append(f"attached  {len(m.attached)} file(s), {human_bytes(sum(a.nbytes for a in m.attached))}"
                         f"{whose}: restore with `ckptstore restore-files`")
        if m.metadata:
            lines.append(f"metadata  {json.dumps(m.metadata)}")
        if args.files and part.attached:
            lines.append("")
            lines.append(table(["rank", "path", "bytes"], [[a.rank, a.path, a.nbytes] for a in part.attached]))
        if args.tensors:
            ranks = _file_ranks(m)
            tensors = sorted(part.tensors, key=lambda t: (ranks[t.file], t.name))
            doc["tensors"] = [{"rank": ranks[t.file], "name": t.name, "kind": t.kind, "dtype": t.dtype,
                               "dtype_name": _dtype_label(t.kind, t.dtype), "shape": t.shape, "nbytes": t.nbytes,
                               "file": t.file, "blake3": t.blake3} for t in tensors]
            rows = [[t.name, _dtype_label(t.kind, t.dtype), list(t.shape), t.nbytes, t.file] for t in tensors]
            lines.append("")
            if m.world_size > 1:  # names repeat across ranks: say whose each one is
                lines.append(table(["rank", "name", "dtype", "shape", "bytes", "file"],
                                   [[ranks[t.file], *row] for t, row in zip(tensors, rows)]))
            else:
                lines.append(table(["name", "dtype", "shape", "bytes", "file"], rows))
        emit(args, doc, "\n".join(lines))
        return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    with Store.open(args.url, readonly=True) as store:
        cut = None if args.cut is None else _selector(args.cut)
        manifests = store.classify().committed if cut is None else [store.manifest(cut)]
        progress = Progress(sum(m.nbytes for m in manifests), "verify")
        report = store.verify(cut, progress=progress)
        progress.finish()
        by_id = {m.cut: m for m in manifests}
        world_sizes = {c: by_id[c].world_size if c in by_id else None for c in report.cuts_checked}
        doc = report.to_json()
        doc["world_sizes"] = world_sizes  # cut -> how many ranks' state it holds (None: manifest unreadable)
        for f, fd in zip(report.findings, doc["findings"]):
            fd["rank"] = _finding_rank(by_id, f.cut, f.path)
        several = any((w or 1) > 1 for w in world_sizes.values())
        if several:  # which rank's file is damaged matters
            rows = [[f.severity, f.kind, f.cut or "-", "-" if fd["rank"] is None else fd["rank"], f.path or "-",
                     f.message] for f, fd in zip(report.findings, doc["findings"])]
            headers = ["severity", "kind", "cut", "rank", "file", "message"]
        else:
            rows = [[f.severity, f.kind, f.cut or "-", f.path or "-", f.message] for f in report.findings]
            headers = ["severity", "kind", "cut", "file", "message"]
        ranked = ""
        if several:
            sizes = sorted({w for w in world_sizes.values() if w and w > 1})
            ranked = " (" + ", ".join(f"{sum(1 for w in world_sizes.values() if w == n)} with {n} ranks"
                                      for n in sizes) + ")"
        summary = (f"{'OK' if report.ok else 'PROBLEMS FOUND'}: {len(report.cuts_checked)} cut(s){ranked}, "
                   f"{report.files_checked} file(s), {human_bytes(report.bytes_hashed)} hashed, "
                   f"{len(report.errors)} error(s), {len(report.findings) - len(report.errors)} notice(s)")
        text = (table(headers, rows) + "\n" if rows else "") + summary
        emit(args, doc, text)
        return EXIT_OK if report.ok else EXIT_PROBLEM


def _finding_rank(by_id: dict[str, Manifest], cut: str | None, path: str | None) -> int | None:
    """The rank whose file a finding is about (None when it is not about one of a cut's shard files)."""
    m = by_id.get(cut) if cut is not None else None
    if m is None or not path:
        return None
    return _file_ranks(m).get(path.rsplit("/", 1)[-1])


def _policy(args: argparse.Namespace) -> Policy:
    parts: list[Policy] = []
    for flag, value in (("--keep-last", args.keep_last), ("--keep-every", args.keep_every)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value} (prune never removes the LATEST cut; "
                             "to keep fewer cuts, lower the number, not below 1)")
    if args.keep_last is not None:
        parts.append(KeepLast(args.keep_last))
    if args.keep_every is not None:
        parts.append(KeepEvery(args.keep_every))
    if args.keep_tag:
        parts.append(KeepTagged(*args.keep_tag))
    if args.keep_final:
        parts.append(KeepFinal())
    if not parts:
        raise UsageError("prune needs at least one of --keep-last, --keep-every, --keep-tag, --keep-final")
    policy = parts[0]
    for p in parts[1:]:
        policy = policy | p
    return policy


def cmd_prune(args: argparse.Namespace) -> int:
    policy = _policy(args)
    # A dry run opens without recovery: it must not delete a crash's leftovers either (issue 10, item 2).
    with Store.open(args.url, recover=not args.dry_run) as store:
        removed = store.prune(policy, dry_run=args.dry_run, verify_kept=not args.no_verify)
        verb = "would remove" if args.dry_run else "removed"
        doc = {"dry_run": args.dry_run, "removed": [c.to_json() for c in removed],
               "kept": [c.to_json() for c in store.cuts() if c.id not in {r.id for r in removed}],
               "removed_at_open": [leftover_json(lo) for lo in store.recovered]}
        text = f"{verb} {len(removed)} cut(s)"
        if removed:
            text = table(CUT_HEADERS, _cut_rows(removed, None)) + "\n" + text
        if store.recovered:
            text += f"\nrecovery at open removed {len(store.recovered)} leftover(s) of interrupted work: " + \
                ", ".join(p for lo in store.recovered for p in lo.paths)
        emit(args, doc, text)
        return EXIT_OK


def cmd_rm(args: argparse.Namespace) -> int:
    # A dry run opens without recovery: it must not delete a crash's leftovers either (issue 10, item 2).
    with Store.open(args.url, recover=not args.dry_run) as store:
        removed = store.remove(_selector(args.cut), dry_run=args.dry_run, verify_kept=not args.no_verify)
        verb = "would remove" if args.dry_run else "removed"
        doc = {"dry_run": args.dry_run, "removed": removed.to_json(),
               "removed_at_open": [leftover_json(lo) for lo in store.recovered]}
        emit(args, doc, f"{verb} cut {removed.id} (step {removed.step})")
        return EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    # Opened without recovery, so the dry run deletes nothing and the real run reports every removal
    # (recovery is this very gc) (issue 10, item 2).
    with Store.open(args.url, recover=False) as store:
        report = store.gc(dry_run=args.dry_run)
        verb = "would remove" if args.dry_run else "removed"
        rows = [[lo.kind, lo.cut or "-", ", ".join(lo.paths)] for lo in report.removed]
        text = (table(["kind", "cut", "paths"], rows) + "\n" if rows else "") + f"{verb} {len(report.removed)} leftover(s)"
        if report.foreign:
            text += f"\nleft alone {len(report.foreign)} foreign entr(ies): {', '.join(report.foreign)}"
        emit(args, report.to_json(), text)
        return EXIT_OK


def cmd_repair(args: argparse.Namespace) -> int:
    store = open_for_repair(args.url)
    try:
        cls = store.classify()
        progress = Progress(sum(m.nbytes for m in cls.committed), "repair")
        info = store.repair(progress=progress)
        progress.finish()
        store.gc()
        doc = {"latest": None if info is None else info.to_json()}
        text = "store is empty; LATEST removed" if info is None else f"LATEST -> {info.id} (step {info.step})"
        emit(args, doc, text)
        return EXIT_OK
    finally:
        store.close()


def cmd_resume_info(args: argparse.Namespace) -> int:
    from .selection import choose_cut

    with Store.open(args.url, readonly=True) as store:
        cls = store.classify()
        try:
            info, skipped = choose_cut(store.storage, cls, fallback=True)
        except CutNotFound as exc:
            info, skipped = None, {"*": exc.message}
        latest = cls.latest.cut if cls.latest is not None else None
        healthy = cls.latest_problem is None and (info is None and not cls.committed or info is not None and info.id == latest)
        doc = {"store": store.url, "resume_step": info.step if info else None, "cut": info.id if info else None,
               "finished": bool(info.final) if info else False, "healthy": healthy, "latest": latest,
               "world_size": info.world_size if info else None,
               "latest_problem": cls.latest_problem,
               "skipped": [{"cut": c, "reason": r} for c, r in skipped.items()]}
        if info is None:
            text = "empty store: start from scratch" if not cls.committed else "no committed cut verifies"
        else:
            ranks = f"world size {info.world_size}; " if info.world_size > 1 else ""
            text = (f"resume from step {info.step} ({info.id}); run {'finished' if info.final else 'interrupted'}; "
                    f"{ranks}LATEST {'healthy' if healthy else 'NOT healthy'}")
        for c, r in skipped.items():
            text += f"\n  skipped {c}: {r}"
        emit(args, doc, text)
        return EXIT_OK if healthy else EXIT_PROBLEM


def cmd_diff(args: argparse.Namespace) -> int:
    with Store.open(args.url, readonly=True) as store:
        a, b = store.manifest(_selector(args.cut_a)), store.manifest(_selector(args.cut_b))
        a, b = _cli_rank_part(a, args.rank, store.url, "diff"), _cli_rank_part(b, args.rank, store.url, "diff")
        ta = {t.name: (t.blake3, t.dtype, tuple(t.shape)) for t in a.tensors}
        tb = {t.name: (t.blake3, t.dtype, tuple(t.shape)) for t in b.tensors}
        doc = {"a": a.cut, "b": b.cut, "rank": args.rank,
               "changed": sorted(n for n in ta.keys() & tb.keys() if ta[n] != tb[n]),
               "unchanged": sorted(n for n in ta.keys() & tb.keys() if ta[n] == tb[n]),
               "added": sorted(tb.keys() - ta.keys()), "removed": sorted(ta.keys() - tb.keys())}
        same = not (doc["changed"] or doc["added"] or doc["removed"])
        rows = [[kind, n] for kind in ("changed", "added", "removed") for n in doc[kind]]
        text = (table(["change", "tensor"], rows) + "\n" if rows else "") + (
            ("" if args.rank is None else f"rank {args.rank}: ")
            + f"{len(doc['changed'])} changed, {len(doc['unchanged'])} unchanged, {len(doc['added'])} added, "
            f"{len(doc['removed'])} removed")
        emit(args, doc, text)
        return EXIT_OK if same else EXIT_PROBLEM


def cmd_export(args: argparse.Namespace) -> int:
    from .export import export_cut

    with Store.open(args.url, readonly=True) as store:
        m = store.manifest(_selector(args.cut))
        _cli_rank_part(m, args.rank, store.url, "export")  # the CLI's word for a missing --rank
        doc = export_cut(store, m.cut, args.to, fmt=args.format, allow_pickle_format=args.allow_pickle_format,
                         allow_pickle=args.allow_pickle, force=args.force, rank=args.rank)
        whose = f" rank {doc['rank']} of {doc['world_size']}" if doc["world_size"] > 1 else ""
        emit(args, doc,
             f"exported {doc['cut']}{whose} ({doc['tensors']} tensors) to {doc['path']} as {doc['format']}")
        return EXIT_OK


def cmd_restore_files(args: argparse.Namespace) -> int:
    with Store.open(args.url, readonly=True) as store:
        m = store.manifest(_selector(args.cut))
        _cli_rank_part(m, args.rank, store.url, "restore-files")
        written = store.restore_files(m.cut, to=args.to, rank=args.rank, overwrite=not args.no_overwrite)
        doc = {"cut": m.cut, "step": m.step, "rank": args.rank, "to": args.to, "written": written}
        emit(args, doc, "\n".join([*written, f"restored {len(written)} file(s) of cut {m.cut} under {args.to}"]))
        return EXIT_OK


# ------------------------------------------------------------------------------------------ parser
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptstore", description="Audit, list and maintain ckptstore stores.")
    p.add_argument("--version", action="version", version=f"ckptstore {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.add_argument("url", help="store path or fsspec URL")
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        sp.set_defaults(fn=fn)
        return sp

    add("ls", cmd_ls, "list committed cuts (and leftovers)")
    sp = add("show", cmd_show, "show one cut (default: latest)")
    sp.add_argument("cut", nargs="?", default=None, help="'latest', a cut id or a step")
    sp.add_argument("--tensors", action="store_true", help="list the cut's tensors (with their rank)")
    sp.add_argument("--rank", type=int, default=None, help="list only this rank's files and tensors")
    sp.add_argument("--files", action="store_true", help="list the files attached to the cut (files=)")
    sp = add("verify", cmd_verify, "re-hash every committed cut and report findings (exit 1 on problems)")
    sp.add_argument("--cut", default=None, help="verify only this cut ('latest', an id or a step)")
    sp = add("prune", cmd_prune, "remove cuts a retention policy does not keep")
    sp.add_argument("--keep-last", type=int, default=None, metavar="N", help="keep the N cuts with the highest steps")
    sp.add_argument("--keep-every", type=int, default=None, metavar="K", help="keep every cut whose step is a multiple of K")
    sp.add_argument("--keep-tag", action="append", default=[], metavar="TAG", help="keep cuts tagged TAG (repeatable)")
    sp.add_argument("--keep-final", action="store_true", help="keep cuts marked final")
    sp.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    sp.add_argument("--no-verify", action="store_true",
                    help="do not verify the newest kept cut before removing others (see docs/cli.md)")
    sp = add("rm", cmd_rm, "remove one committed cut, under prune's rules (never LATEST's, never one tagged keep)")
    sp.add_argument("cut", help="a cut id or a step number")
    sp.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    sp.add_argument("--no-verify", action="store_true",
                    help="do not refuse to remove the newest cut that verifies when LATEST's does not")
    sp = add("gc", cmd_gc, "remove leftovers of interrupted saves and prunes (never foreign files)")
    sp.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    add("repair", cmd_repair, "point LATEST at the newest cut that verifies")
    add("resume-info", cmd_resume_info, "what a launcher needs: resume step, cut, finished, healthy")
    sp = add("diff", cmd_diff, "which tensors changed between two cuts (by hash; exit 1 when they differ)")
    sp.add_argument("cut_a")
    sp.add_argument("cut_b")
    sp.add_argument("--rank", type=int, default=None,
                    help="compare this rank's parts (required for cuts of several ranks)")
    sp = add("export", cmd_export, "write a cut as one safetensors or torch.save file")
    sp.add_argument("cut", nargs="?", default=None)
    sp.add_argument("--to", required=True, help="output file (refused if it exists, unless --force)")
    sp.add_argument("--rank", type=int, default=None,
                    help="export this rank's state (required for cuts of several ranks)")
    sp.add_argument("--format", choices=["safetensors", "torch"], default="safetensors")
    sp.add_argument("--allow-pickle-format", action="store_true",
                    help="needed for --format torch (the output): torch.load unpickles what it reads")
    sp.add_argument("--allow-pickle", action="store_true",
                    help="let the read unpickle values the cut holds (the input; only for cuts you trust)")
    sp.add_argument("--force", action="store_true", help="replace the file at --to if it exists")
    sp = add("restore-files", cmd_restore_files, "put the files attached to a cut (files=) back under a directory")
    sp.add_argument("cut", nargs="?", default=None, help="'latest' (default), a cut id or a step")
    sp.add_argument("--to", required=True, help="directory to restore into (created if missing)")
    sp.add_argument("--rank", type=int, default=None, help="this rank's files (required for cuts of several ranks)")
    sp.add_argument("--no-overwrite", action="store_true", help="refuse if any file to restore exists")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: 2 for bad usage, 0 for --help/--version
        return int(exc.code or 0)
    try:
        return int(args.fn(args))
    except CkptStoreError as exc:
        if args.debug:
            raise
        code = exit_code_for(exc)
        if getattr(args, "json", False):
            print(json.dumps({"error": type(exc).__name__, "message": str(exc), "store": exc.store,
                              "cut": exc.cut, "path": exc.path, "exit_code": code}))
        print(f"ckptstore: error: {exc}", file=sys.stderr)
        return code
    except (OSError, ValueError) as exc:
        if args.debug:
            raise
        print(f"ckptstore: error: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except Exception as exc:  # noqa: BLE001 - a backend's own error (botocore, gcsfs): still one line
        if args.debug:
            raise
        message = f"{type(exc).__name__}: {exc} [store={getattr(args, 'url', None)}]"
        if getattr(args, "json", False):
            print(json.dumps({"error": type(exc).__name__, "message": message, "store": getattr(args, "url", None),
                              "cut": None, "path": None, "exit_code": EXIT_CANNOT_RUN}))
        print(f"ckptstore: error: {message} (rerun with --debug for the traceback)", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except KeyboardInterrupt:
        print("ckptstore: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


__all__ = ["main", "build_parser", "EXIT_CODES", "exit_code_for"]
