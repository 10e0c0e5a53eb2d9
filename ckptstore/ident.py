"""Who this process is: recorded in marks, manifests and the writer lock."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class HostIdentity:
    host: str
    pid: int


def host_identity() -> HostIdentity:
    """This process's host name and pid."""
    return HostIdentity(socket.gethostname(), os.getpid())
