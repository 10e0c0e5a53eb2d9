"""The commands of ``ckptstore``: each opens the store, calls one library function and renders what it
returned (:mod:`.render`), returning an exit status (:mod:`.exits`). Errors are raised, never caught:
main.py maps them to exit codes in one place (issue 20: the commands half of the old cli.py)."""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext
from typing import Any

from .. import layout, spi
from ..errors import CutNotFound, StoreNotFound, UsageError
from ..manifest import Manifest
from ..retention import KeepEvery, KeepFinal, KeepLast, KeepTagged, Policy
from ..selection import Choice, select_manifest
from ..collect import leftover_json
from ..reading import rank_manifest
from ..store import Store, open_for_repair
from ..verify import VerifyReport
from . import tiers
from .exits import EXIT_OK, EXIT_PROBLEM
from .render import CUT_HEADERS, Progress, cut_rows, dtype_label, emit, file_ranks, human_bytes, rank_counts, table


def _cli_rank_part(m: Manifest, rank: int | None, url: str, what: str) -> Manifest:
    """Rank ``rank``'s part of a cut for a command that works on one rank's state (``what``); a one-line
    UsageError (exit 2) naming the world size when a cut of several ranks comes without ``--rank``."""
    if rank is None and m.world_size > 1:
        raise UsageError(f"cut {m.cut} holds the state of {m.world_size} ranks (world size {m.world_size}); "
                         f"pass --rank R (0 to {m.world_size - 1}) to {what} one rank's part", store=url, cut=m.cut)
    return rank_manifest(m, rank, url)


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


def cmd_ls(args: argparse.Namespace) -> int:
    with Store.open(args.url, readonly=True) as store, tiers.read_mirror(args, store) as view:
        cls = spi.classify(store)
        cuts = [cls.info(m) for m in cls.committed]
        latest = cls.latest.cut if cls.latest else None
        doc = {"store": store.url, "latest": latest, "latest_problem": cls.latest_problem,
               "cuts": [c.to_json() for c in cuts],
               "leftovers": [{"cut": lo.cut, "kind": lo.kind, "paths": lo.paths} for lo in cls.leftovers]}
        headers, rows = CUT_HEADERS, cut_rows(cuts, latest)
        if view is not None:  # a mirror (issue 21): a column, a key per cut; none without one
            headers, rows = tiers.ls_mirrored(view, cls, doc, rows)
        text = table(headers, rows)
        if view is not None:
            text += "\n" + tiers.ls_summary(doc)
        if cls.latest_problem:
            text += f"\n! {cls.latest_problem} (run `ckptstore repair {store.url}`)"
        if cls.leftovers:
            text += f"\n{len(cls.leftovers)} leftover(s) of interrupted work; `ckptstore gc` removes them"
        emit(args, doc, text)
        return EXIT_PROBLEM if cls.latest_problem else EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    with Store.open(args.url, readonly=True) as store:
        cls = spi.classify(store)
        m = select_manifest(cls, _selector(args.cut), store.url)
        info = cls.info(m)
        if args.rank is None:
            m = spi.whole_of(store, m)  # every rank's files: a cut of format 5 reads every fragment
        # --rank R: the files and tensors listed are rank R's only (the cut's totals stay in the doc);
        # of a cut of format 5 the commit record and rank R's fragment alone are read (issue 22)
        part = m if args.rank is None else spi.part_of(store, m, args.rank)
        counts = rank_counts(m)
        doc: dict[str, Any] = {**info.to_json(), "latest": cls.latest is not None and cls.latest.cut == m.cut,
                               "writer": m.writer.model_dump(), "metadata": m.metadata,
                               "ranks": counts, "rank": args.rank,
                               "files": [f.model_dump() for f in part.files],
                               "attached": [a.model_dump() for a in part.attached]}
        lines = [
            f"cut       {m.cut}", f"step      {m.step}", f"final     {'yes' if info.final else 'no'}",
            f"latest    {'yes' if doc['latest'] else 'no'}", f"tags      {', '.join(m.tags) or '-'}",
            f"size      {human_bytes(info.nbytes)} in {m.file_count} file(s), {m.array_count - m.attached_count} "
            f"tensor(s)" + (f" and {m.attached_count} attached file(s)" if m.attached_count else ""),
            f"ranks     {m.world_size}",
            *[f"{'rank ' + str(c['rank']):<9} {human_bytes(c['nbytes'])} in {c['files']} file(s), "
              f"{c['tensors']} tensor(s)" for c in counts if m.world_size > 1 and args.rank in (None, c["rank"])],
            f"created   {m.created_at}", f"writer    {m.writer.host} pid {m.writer.pid} ({m.writer.mode}, "
            f"ckptstore {m.writer.ckptstore_version})",
        ]
        _show_extras(args, m, part, lines)
        if args.tensors:
            _show_tensors(m, part, doc, lines)
        emit(args, doc, "\n".join(lines))
        return EXIT_OK


def _show_extras(args: argparse.Namespace, m: Manifest, part: Manifest, lines: list[str]) -> None:
    """``show``'s attached-files and metadata lines, and the ``--files`` table."""
    if m.attached_count:
        whose = "" if args.rank is None else f" (rank {args.rank}: {len(part.attached)})"
        # A commit record (format 5) counts every rank's attached files; their sizes are in the fragments.
        size = "" if m.fragmented else f", {human_bytes(sum(a.nbytes for a in m.attached))}"
        lines.append(f"attached  {m.attached_count} file(s){size}{whose}: restore with `ckptstore restore-files`")
    if m.metadata:
        lines.append(f"metadata  {json.dumps(m.metadata)}")
    if args.files and part.attached:
        lines.append("")
        lines.append(table(["rank", "path", "bytes"], [[a.rank, a.path, a.nbytes] for a in part.attached]))


def _show_tensors(m: Manifest, part: Manifest, doc: dict[str, Any], lines: list[str]) -> None:
    """``show --tensors``: the tensors of ``part`` by rank and name, in ``doc`` and as a table."""
    ranks = file_ranks(part)
    tensors = sorted(part.tensors, key=lambda t: (ranks[t.file], t.name))
    doc["tensors"] = [{"rank": ranks[t.file], "name": t.name, "kind": t.kind, "dtype": t.dtype,
                       "dtype_name": dtype_label(t.kind, t.dtype), "shape": t.shape, "nbytes": t.nbytes,
                       "file": t.file, "blake3": t.blake3} for t in tensors]
    rows = [[t.name, dtype_label(t.kind, t.dtype), list(t.shape), t.nbytes, t.file] for t in tensors]
    lines.append("")
    if m.world_size > 1:  # names repeat across ranks: say whose each one is
        lines.append(table(["rank", "name", "dtype", "shape", "bytes", "file"],
                           [[ranks[t.file], *row] for t, row in zip(tensors, rows)]))
    else:
        lines.append(table(["name", "dtype", "shape", "bytes", "file"], rows))


def cmd_verify(args: argparse.Namespace) -> int:
    with Store.open(args.url, readonly=True) as store:
        url = tiers.mirror_url(args, store, default_recorded=False)
        # The mirror is opened before anything is hashed: one that cannot be read is exit 2 at once.
        with Store.open(url, readonly=True, options=tiers.mirror_options(args)) if url else nullcontext() as mirror:
            ok, doc, text = _verify_one(store, args.cut)
            if mirror is not None:  # issue 21: each tier's report, labeled; a problem in either is exit 1
                mirror_ok, doc["mirror"], mirror_text = _verify_one(mirror, args.cut)
                text = f"local {store.url}:\n{text}\n\nmirror {mirror.url}:\n{mirror_text}"
                ok = ok and mirror_ok
            emit(args, doc, text)
            return EXIT_OK if ok else EXIT_PROBLEM


def _verify_one(store: Store, selector: str | None) -> tuple[bool, dict[str, Any], str]:
    """``verify`` of one store: whether it is ok, its ``--json`` document and its text."""
    cut = None if selector is None else _selector(selector)
    manifests = spi.classify(store).committed if cut is None else [store.manifest(cut)]
    progress = Progress(sum(m.nbytes for m in manifests), "verify")
    report = store.verify(cut, progress=progress)
    progress.finish()
    by_id = {m.cut: m for m in manifests}
    world_sizes = {c: by_id[c].world_size if c in by_id else None for c in report.cuts_checked}
    doc = report.to_json()
    doc["world_sizes"] = world_sizes  # cut -> how many ranks' state it holds (None: manifest unreadable)
    for f, fd in zip(report.findings, doc["findings"]):
        fd["rank"] = _finding_rank(by_id, f.cut, f.path)
    return report.ok, doc, _verify_text(report, doc, world_sizes)


def _verify_text(report: VerifyReport, doc: dict[str, Any], world_sizes: dict[str, int | None]) -> str:
    """``verify``'s findings table (with a rank column when a cut holds several ranks) and summary."""
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
    return (table(headers, rows) + "\n" if rows else "") + summary


def _finding_rank(by_id: dict[str, Manifest], cut: str | None, path: str | None) -> int | None:
    """The rank whose file a finding is about (None when it is not about one of a cut's shard files)."""
    m = by_id.get(cut) if cut is not None else None
    if m is None or not path:
        return None
    name = path.rsplit("/", 1)[-1]
    if m.world_size > 1:  # a shard's or a fragment's name carries its rank
        if layout.is_rank_record_name(name):
            return int(name[4:9])
        return layout.shard_rank(name)
    return file_ranks(m).get(name)


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
            text = table(CUT_HEADERS, cut_rows(removed, None)) + "\n" + text
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
        rows = [[lo.kind, lo.cut or "-", ", ".join(lo.paths) + (f" (upload {lo.upload_id})" if lo.upload_id else "")]
                for lo in report.removed]
        text = (table(["kind", "cut", "paths"], rows) + "\n" if rows else "") + f"{verb} {len(report.removed)} leftover(s)"
        if report.foreign:
            text += f"\nleft alone {len(report.foreign)} foreign entr(ies): {', '.join(report.foreign)}"
        emit(args, report.to_json(), text)
        return EXIT_OK


def cmd_repair(args: argparse.Namespace) -> int:
    store = open_for_repair(args.url)
    try:
        cls = spi.classify(store)
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
    try:
        store = Store.open(args.url, readonly=True)
    except StoreNotFound:
        if args.mirror is None or args.no_mirror:
            raise
        doc, text = tiers.resume_info_mirror_alone(args)  # a replaced node: the mirror alone (issue 21)
        emit(args, doc, text)
        return EXIT_PROBLEM
    with store, tiers.read_mirror(args, store) as view:
        cls = spi.classify(store)
        try:
            # Restore's choice: the newest step that verifies in either tier (issue 21; the local alone
            # without a mirror, or with one that cannot be read).
            choice: Choice | None = tiers.choose_tiers(store, cls, view)
            skipped = choice.skipped
        except CutNotFound as exc:
            choice, skipped = None, {"*": exc.message}
        info = choice.info if choice is not None else None
        latest = cls.latest.cut if cls.latest is not None else None
        healthy = tiers.local_healthy(store, cls, choice)
        doc = {"store": store.url, "resume_step": info.step if info else None, "cut": info.id if info else None,
               "finished": bool(info.final) if info else False, "healthy": healthy, "latest": latest,
               "world_size": info.world_size if info else None,
               "latest_problem": cls.latest_problem,
               "skipped": [{"cut": c, "reason": r} for c, r in skipped.items()]}
        from_mirror = info is not None and choice is not None and choice.tier == 1
        if view is not None:
            doc["tier"] = None if info is None else "mirror" if from_mirror else "local"
            doc["mirror"] = tiers.lag_json(view, cls)
        if info is None:
            text = "empty store: start from scratch" if not cls.committed else "no committed cut verifies"
        else:
            ranks = f"world size {info.world_size}; " if info.world_size > 1 else ""
            where = f" from the mirror {view.url}" if from_mirror and view is not None else ""
            text = (f"resume from step {info.step} ({info.id}){where}; run {'finished' if info.final else 'interrupted'}; "
                    f"{ranks}LATEST {'healthy' if healthy else 'NOT healthy'}")
        if view is not None:
            text += "\n" + tiers.lag_text(doc["mirror"])
        for c, r in skipped.items():
            text += f"\n  skipped {c}: {r}"
        # The exit status is the local tier's, mirror or not: a launcher's check means what it meant.
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
    from ..export import export_cut

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


__all__ = ["cmd_diff", "cmd_export", "cmd_gc", "cmd_ls", "cmd_prune", "cmd_repair", "cmd_restore_files",
           "cmd_resume_info", "cmd_rm", "cmd_show", "cmd_verify"]
