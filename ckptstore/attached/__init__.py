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

The package (issue 20: the one module had grown to 449 lines) is split by side: :mod:`.record` (the
manifest's record of a file and the path rules), :mod:`.capture` (opening and reading ``files=`` at
capture) and :mod:`.restore` (the :class:`Restorer`). Everything is imported from here, as before.
"""

from __future__ import annotations

from .capture import Source, close_sources, open_sources
from .record import (FILES_PREFIX, MAX_FILES, MAX_PATH_BYTES, MODE_BITS, NAME_MAX, AttachedFile, AttachedPath,
                     FilesArg, array_name, check_listing, check_path)
from .restore import Restorer

__all__ = ["AttachedFile", "FILES_PREFIX", "MODE_BITS", "FilesArg", "Source", "array_name", "check_path",
           "open_sources", "close_sources", "Restorer",
           # importers reach these through this module too (manifest.py: check_listing)
           "AttachedPath", "MAX_FILES", "MAX_PATH_BYTES", "NAME_MAX", "check_listing"]
