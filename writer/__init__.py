"""ckptstore.writer: background cuts through one shared-memory block and a persistent writer process.

Not implemented yet (issue 3); importing it must never be needed by ``import ckptstore``.
"""

__all__: list[str] = []
