"""The parser of ``ckptstore`` and :func:`main`, the one place that maps exceptions to exit codes
(:data:`EXIT_CODES`). No traceback reaches the user for a ckptstore error; ``--debug`` shows one."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Sequence

from ..errors import CkptStoreError, DataError, StorageError, StoreLocked, UsageError
from ..version import __version__
from . import commands as c
from .mirror import cmd_mirror
from .tiers import add_mirror_flags
from .exits import EXIT_CANNOT_RUN, EXIT_PROBLEM

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


Add = Callable[[str, Callable[[argparse.Namespace], int], str], argparse.ArgumentParser]


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

    # The subcommands are added in this order (it is the order of ``--help``).
    _add_reading(add)
    _add_maintaining(add)
    _add_copying(add)
    return p


def _add_reading(add: Add) -> None:
    """``ls``, ``show``, ``verify``: the audits and listings."""
    sp = add("ls", c.cmd_ls, "list committed cuts (and leftovers; with a mirror, which cuts it holds)")
    add_mirror_flags(sp, default_recorded=True)
    sp = add("show", c.cmd_show, "show one cut (default: latest)")
    sp.add_argument("cut", nargs="?", default=None, help="'latest', a cut id or a step")
    sp.add_argument("--tensors", action="store_true", help="list the cut's tensors (with their rank)")
    sp.add_argument("--rank", type=int, default=None, help="list only this rank's files and tensors")
    sp.add_argument("--files", action="store_true", help="list the files attached to the cut (files=)")
    sp = add("verify", c.cmd_verify, "re-hash every committed cut and report findings (exit 1 on problems)")
    sp.add_argument("--cut", default=None, help="verify only this cut ('latest', an id or a step)")
    add_mirror_flags(sp, default_recorded=False)


def _add_maintaining(add: Add) -> None:
    """``prune``, ``rm``, ``gc``, ``repair``, ``resume-info``."""
    sp = add("prune", c.cmd_prune, "remove cuts a retention policy does not keep")
    sp.add_argument("--keep-last", type=int, default=None, metavar="N", help="keep the N cuts with the highest steps")
    sp.add_argument("--keep-every", type=int, default=None, metavar="K", help="keep every cut whose step is a multiple of K")
    sp.add_argument("--keep-tag", action="append", default=[], metavar="TAG", help="keep cuts tagged TAG (repeatable)")
    sp.add_argument("--keep-final", action="store_true", help="keep cuts marked final")
    sp.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    sp.add_argument("--no-verify", action="store_true",
                    help="do not verify the newest kept cut before removing others (see docs/cli.md)")
    sp = add("rm", c.cmd_rm, "remove one committed cut, under prune's rules (never LATEST's, never one tagged keep)")
    sp.add_argument("cut", help="a cut id or a step number")
    sp.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    sp.add_argument("--no-verify", action="store_true",
                    help="do not refuse to remove the newest cut that verifies when LATEST's does not")
    sp = add("gc", c.cmd_gc, "remove leftovers of interrupted saves and prunes (never foreign files)")
    sp.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    add("repair", c.cmd_repair, "point LATEST at the newest cut that verifies")
    sp = add("resume-info", c.cmd_resume_info, "what a launcher needs: resume step, cut, finished, healthy "
             "(with a mirror: the tier, the mirror's lag)")
    add_mirror_flags(sp, default_recorded=True)


def _add_copying(add: Add) -> None:
    """``diff``, ``export``, ``restore-files``, ``mirror``: commands on the contents of cuts."""
    sp = add("diff", c.cmd_diff, "which tensors changed between two cuts (by hash; exit 1 when they differ)")
    sp.add_argument("cut_a")
    sp.add_argument("cut_b")
    sp.add_argument("--rank", type=int, default=None,
                    help="compare this rank's parts (required for cuts of several ranks)")
    sp = add("export", c.cmd_export, "write a cut as one safetensors or torch.save file")
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
    sp = add("restore-files", c.cmd_restore_files, "put the files attached to a cut (files=) back under a directory")
    sp.add_argument("cut", nargs="?", default=None, help="'latest' (default), a cut id or a step")
    sp.add_argument("--to", required=True, help="directory to restore into (created if missing)")
    sp.add_argument("--rank", type=int, default=None, help="this rank's files (required for cuts of several ranks)")
    sp.add_argument("--no-overwrite", action="store_true", help="refuse if any file to restore exists")
    sp = add("mirror", cmd_mirror, "copy the committed cuts a mirror store is missing into it, oldest first, "
             "every byte checked (exit 1 when a cut's files do not match its manifest)")
    sp.add_argument("--to", default=None, metavar="MIRROR",
                    help="the mirror's path or fsspec URL (created if missing; default: the one URL's STORE.json records)")
    sp.add_argument("--storage-options", default=None, metavar="JSON|@FILE",
                    help="fsspec options of URL (a JSON object, or @FILE holding one: keeps credentials off ps)")
    sp.add_argument("--to-storage-options", default=None, metavar="JSON|@FILE", help="fsspec options of MIRROR")


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
        return _foreign_error(args, exc)
    except KeyboardInterrupt:
        print("ckptstore: interrupted", file=sys.stderr)
        return 130


def _foreign_error(args: argparse.Namespace, exc: Exception) -> int:
    """One line (and, under ``--json``, one document) for an error that is not ckptstore's own."""
    message = f"{type(exc).__name__}: {exc} [store={getattr(args, 'url', None)}]"
    if getattr(args, "json", False):
        print(json.dumps({"error": type(exc).__name__, "message": message, "store": getattr(args, "url", None),
                          "cut": None, "path": None, "exit_code": EXIT_CANNOT_RUN}))
    print(f"ckptstore: error: {message} (rerun with --debug for the traceback)", file=sys.stderr)
    return EXIT_CANNOT_RUN


__all__ = ["main", "build_parser", "EXIT_CODES", "exit_code_for"]
