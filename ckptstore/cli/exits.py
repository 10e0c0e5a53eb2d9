"""The exit statuses of the ``ckptstore`` command, named once for the commands (which return them) and
for main.py (whose ``EXIT_CODES`` is the one table mapping exceptions to them). A module of its own so
that commands.py and main.py share them without importing each other (issue 20: no import cycle)."""

#: 0 all is well; 1 a problem was found in the store (a failed audit, damaged data, a broken LATEST);
#: 2 the command could not run (bad arguments, no store, the store locked, the file system refusing).
EXIT_OK, EXIT_PROBLEM, EXIT_CANNOT_RUN = 0, 1, 2

__all__ = ["EXIT_OK", "EXIT_PROBLEM", "EXIT_CANNOT_RUN"]
