"""The ``ckptstore`` command: parse, call one library function, render a table or ``--json``.

Exit codes (one table, :data:`EXIT_CODES`): 0 all is well; 1 a problem was found in the store
(a failed audit, damaged data, a broken LATEST); 2 the command could not run (bad arguments, no store,
the store locked by a writer, the file system refusing). No traceback reaches the user for a
ckptstore error; ``--debug`` shows one.

A package since issue 20 (the one module had grown to 531 lines): :mod:`.main` (the parser and the
exception-to-exit-code table), :mod:`.commands` (one function per command), :mod:`.render` (tables,
JSON, progress), :mod:`.exits` (the exit statuses). ``ckptstore.cli:main`` stays the console script and
``python -m ckptstore.cli`` runs it (``__main__.py``). Importing it loads neither torch nor the writer.
"""

from __future__ import annotations

from .exits import EXIT_CANNOT_RUN, EXIT_OK, EXIT_PROBLEM
from .main import EXIT_CODES, build_parser, exit_code_for, main

__all__ = ["main", "build_parser", "EXIT_CODES", "exit_code_for", "EXIT_OK", "EXIT_PROBLEM", "EXIT_CANNOT_RUN"]
