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

from . import __version__
from .errors import CkptStoreError, CutNotFound, DataError, StorageError, StoreLocked, UsageError
from .info import CutInfo
from .retention import KeepEvery, KeepFinal, KeepLast, KeepTagged, Policy
from .store import Store, open_for_repair

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


def _cut_rows(cuts: Sequence[CutInfo], latest: str | None) -> list[list[Any]]:
    return [
        [c.step, c.id, ("LATEST " if c.id == latest else "") + ("final" if c.final else ""), ",".join(c.tags),
         human_bytes(c.nbytes), c.tensors, c.created_at.strftime("%Y-%m-%d %H:%M:%S")]
        for c in cuts
    ]


def _selector(s: str | None) -> str | int:
    if s is None or s == "latest":
        return "latest"
    return int(s) if s.isdigit() else s


# ---------------------------------------------------------------------------------------- commands
def cmd_ls(args: argparse.Namespace) -> int:
    with Store.open(args.url, readonly=True) as store:
        cls = store.classify()
        cuts = [CutInfo.from_manifest(m) for m in cls.committed]
        latest = cls.latest.cut if cls.latest else None
        doc = {"store": store.url, "latest": latest, "latest_problem": cls.latest_problem,
               "cuts": [c.to_json() for c in cuts],
               "leftovers": [{"cut": lo.cut, "kind": lo.kind, "paths": lo.paths} for lo in cls.leftovers]}
        text = table(["step", "cut", "state", "tags", "size", "tensors", "created (UTC)"], _cut_rows(cuts, latest))
        if cls.latest_problem:
            text += f"\n! {cls.latest_problem} (run `ckptstore repair {store.url}`)"
        if cls.leftovers:
            text += f"\n{len(cls.leftovers)} leftover(s) of interrupted work; `ckptstore gc` removes them"
        emit(args, doc, text)
        return EXIT_PROBLEM if cls.latest_problem else EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    with Store.open(args.url, readonly=True) as store:
        m = store.manifest(_selector(args.cut))
        info = CutInfo.from_manifest(m)
        cls = store.classify()
        doc: dict[str, Any] = {**info.to_json(), "latest": cls.latest is not None and cls.latest.cut == m.cut,
                               "writer": m.writer.model_dump(), "metadata": m.metadata,
                               "files": [f.model_dump() for f in m.files]}
        lines = [
            f"cut       {m.cut}", f"step      {m.step}", f"final     {'yes' if m.final else 'no'}",
            f"latest    {'yes' if doc['latest'] else 'no'}", f"tags      {', '.join(m.tags) or '-'}",
            f"size      {human_bytes(info.nbytes)} in {len(m.files)} file(s), {len(m.tensors)} tensor(s)",
            f"created   {m.created_at}", f"writer    {m.writer.host} pid {m.writer.pid} ({m.writer.mode}, "
            f"ckptstore {m.writer.ckptstore_version})",
        ]
        if m.metadata:
            lines.append(f"metadata  {json.dumps(m.metadata)}")
        if args.tensors:
            doc["tensors"] = [{"name": t.name, "dtype": t.dtype, "shape": t.shape, "nbytes": t.nbytes,
                               "file": t.file, "blake3": t.blake3} for t in m.tensors]
            lines.append("")
            lines.append(table(["name", "dtype", "shape", "bytes", "file"],
                               [[t.name, t.dtype, list(t.shape), t.nbytes, t.file] for t in m.tensors]))
        emit(args, doc, "\n".join(lines))
        return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    with Store.open(args.url, readonly=True) as store:
        cut = None if args.cut is None else _selector(args.cut)
        cuts = store.cuts() if cut is None else [CutInfo.from_manifest(store.manifest(cut))]
        progress = Progress(sum(c.nbytes for c in cuts), "verify")
        report = store.verify(cut, progress=progress)
        progress.finish()
        rows = [[f.severity, f.kind, f.cut or "-", f.path or "-", f.message] for f in report.findings]
        summary = (f"{'OK' if report.ok else 'PROBLEMS FOUND'}: {len(report.cuts_checked)} cut(s), "
                   f"{report.files_checked} file(s), {human_bytes(report.bytes_hashed)} hashed, "
                   f"{len(report.errors)} error(s), {len(report.findings) - len(report.errors)} notice(s)")
        text = (table(["severity", "kind", "cut", "file", "message"], rows) + "\n" if rows else "") + summary
        emit(args, report.to_json(), text)
        return EXIT_OK if report.ok else EXIT_PROBLEM


def _policy(args: argparse.Namespace) -> Policy:
    parts: list[Policy] = []
    if args.keep_last:
        parts.append(KeepLast(args.keep_last))
    if args.keep_every:
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
    with Store.open(args.url) as store:
        removed = store.prune(policy, dry_run=args.dry_run)
        verb = "would remove" if args.dry_run else "removed"
        doc = {"dry_run": args.dry_run, "removed": [c.to_json() for c in removed],
               "kept": [c.to_json() for c in store.cuts() if c.id not in {r.id for r in removed}]}
        text = f"{verb} {len(removed)} cut(s)"
        if removed:
            text = table(["step", "cut", "state", "tags", "size", "tensors", "created (UTC)"],
                         _cut_rows(removed, None)) + "\n" + text
        emit(args, doc, text)
        return EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    with Store.open(args.url) as store:
        # Opening as writer already cleans leftovers (recovery); report what it found, too.
        report = store.gc(dry_run=True) if args.dry_run else store.gc()
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
               "latest_problem": cls.latest_problem,
               "skipped": [{"cut": c, "reason": r} for c, r in skipped.items()]}
        if info is None:
            text = "empty store: start from scratch" if not cls.committed else "no committed cut verifies"
        else:
            text = (f"resume from step {info.step} ({info.id}); run {'finished' if info.final else 'interrupted'}; "
                    f"LATEST {'healthy' if healthy else 'NOT healthy'}")
        for c, r in skipped.items():
            text += f"\n  skipped {c}: {r}"
        emit(args, doc, text)
        return EXIT_OK if healthy else EXIT_PROBLEM


def cmd_diff(args: argparse.Namespace) -> int:
    with Store.open(args.url, readonly=True) as store:
        a, b = store.manifest(_selector(args.cut_a)), store.manifest(_selector(args.cut_b))
        ta = {t.name: (t.blake3, t.dtype, tuple(t.shape)) for t in a.tensors}
        tb = {t.name: (t.blake3, t.dtype, tuple(t.shape)) for t in b.tensors}
        doc = {"a": a.cut, "b": b.cut,
               "changed": sorted(n for n in ta.keys() & tb.keys() if ta[n] != tb[n]),
               "unchanged": sorted(n for n in ta.keys() & tb.keys() if ta[n] == tb[n]),
               "added": sorted(tb.keys() - ta.keys()), "removed": sorted(ta.keys() - tb.keys())}
        same = not (doc["changed"] or doc["added"] or doc["removed"])
        rows = [[kind, n] for kind in ("changed", "added", "removed") for n in doc[kind]]
        text = (table(["change", "tensor"], rows) + "\n" if rows else "") + (
            f"{len(doc['changed'])} changed, {len(doc['unchanged'])} unchanged, {len(doc['added'])} added, "
            f"{len(doc['removed'])} removed")
        emit(args, doc, text)
        return EXIT_OK if same else EXIT_PROBLEM


def cmd_export(args: argparse.Namespace) -> int:
    from .export import export_cut

    with Store.open(args.url, readonly=True) as store:
        doc = export_cut(store, _selector(args.cut), args.to, fmt=args.format,
                         allow_pickle_format=args.allow_pickle_format)
        emit(args, doc, f"exported {doc['cut']} ({doc['tensors']} tensors) to {doc['path']} as {doc['format']}")
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
    sp.add_argument("--tensors", action="store_true", help="list the cut's tensors")
    sp = add("verify", cmd_verify, "re-hash every committed cut and report findings (exit 1 on problems)")
    sp.add_argument("--cut", default=None, help="verify only this cut ('latest', an id or a step)")
    sp = add("prune", cmd_prune, "remove cuts a retention policy does not keep")
    sp.add_argument("--keep-last", type=int, default=0)
    sp.add_argument("--keep-every", type=int, default=0)
    sp.add_argument("--keep-tag", action="append", default=[])
    sp.add_argument("--keep-final", action="store_true")
    sp.add_argument("--dry-run", action="store_true")
    sp = add("gc", cmd_gc, "remove leftovers of interrupted saves and prunes (never foreign files)")
    sp.add_argument("--dry-run", action="store_true")
    add("repair", cmd_repair, "point LATEST at the newest cut that verifies")
    add("resume-info", cmd_resume_info, "what a launcher needs: resume step, cut, finished, healthy")
    sp = add("diff", cmd_diff, "which tensors changed between two cuts (by hash; exit 1 when they differ)")
    sp.add_argument("cut_a")
    sp.add_argument("cut_b")
    sp = add("export", cmd_export, "write a cut as one safetensors or torch.save file")
    sp.add_argument("cut", nargs="?", default=None)
    sp.add_argument("--to", required=True, help="output file")
    sp.add_argument("--format", choices=["safetensors", "torch"], default="safetensors")
    sp.add_argument("--allow-pickle-format", action="store_true",
                    help="needed for --format torch: torch.load unpickles what it reads")
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
    except KeyboardInterrupt:
        print("ckptstore: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


__all__ = ["main", "build_parser", "EXIT_CODES", "exit_code_for"]
