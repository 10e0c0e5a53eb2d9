"""``python -m ckptstore.cli``: the ``ckptstore`` command (what ``if __name__ == "__main__"`` in the old
cli.py module did before it became a package, issue 20)."""

import sys

from .main import main

sys.exit(main())
