"""Retention policies: small pure objects that say which cuts to keep.

A policy sees the committed, verified-good cuts in ascending step order and returns the ids it keeps;
``a | b`` keeps what either keeps. The store adds the hard rules on top (see ``Store.prune``): never
the LATEST target, never a cut newer than the newest kept one, never a cut tagged ``keep``; order is by
step, never by name or time (failure-modes row 19).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from .kinds import StrKind

PINNED_TAG = "keep"


class HardKeep(StrKind):
    """Which hard rule keeps a cut (``hard_keeps``'s reasons, spelled as before): ``prune`` and
    ``remove`` both apply these, so the rules live here once (issue 20)."""

    LATEST = "LATEST target"
    PINNED = f"tagged {PINNED_TAG!r}"
    NEWER = "newer than the newest kept cut"


class CutLike(Protocol):
    id: str
    step: int
    tags: tuple[str, ...]
    final: bool


class Policy:
    """Base of every policy: ``keep(cuts)`` returns the ids to keep."""

    def keep(self, cuts: Sequence[CutLike]) -> set[str]:
        raise NotImplementedError

    def __or__(self, other: "Policy") -> "Policy":
        return AnyOf((self, other))


@dataclass(frozen=True)
class AnyOf(Policy):
    policies: tuple[Policy, ...]

    def keep(self, cuts: Sequence[CutLike]) -> set[str]:
        out: set[str] = set()
        for p in self.policies:
            out |= p.keep(cuts)
        return out

    def __or__(self, other: Policy) -> Policy:
        return AnyOf(self.policies + (other,))


@dataclass(frozen=True)
class KeepLast(Policy):
    """Keeps the ``n`` cuts with the highest steps."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError("KeepLast(n) needs n >= 1")

    def keep(self, cuts: Sequence[CutLike]) -> set[str]:
        return {c.id for c in sorted(cuts, key=lambda c: c.step)[-self.n :]}


@dataclass(frozen=True)
class KeepEvery(Policy):
    """Keeps every cut whose step is a multiple of ``k`` (long-term snapshots)."""

    k: int

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError("KeepEvery(k) needs k >= 1")

    def keep(self, cuts: Sequence[CutLike]) -> set[str]:
        return {c.id for c in cuts if c.step % self.k == 0}


@dataclass(frozen=True)
class KeepTagged(Policy):
    """Keeps every cut carrying any of ``tags`` (e.g. "best")."""

    tags: tuple[str, ...]

    def __init__(self, *tags: str) -> None:
        object.__setattr__(self, "tags", tuple(tags))

    def keep(self, cuts: Sequence[CutLike]) -> set[str]:
        return {c.id for c in cuts if set(c.tags) & set(self.tags)}


@dataclass(frozen=True)
class KeepFinal(Policy):
    """Keeps every cut marked final."""

    def keep(self, cuts: Sequence[CutLike]) -> set[str]:
        return {c.id for c in cuts if c.final}


def hard_keeps(cuts: Sequence[CutLike], policy_keeps: set[str], latest: str | None) -> dict[str, HardKeep]:
    """The store's rules that no policy can override: id -> the rule (a ``str`` reason)."""
    out: dict[str, HardKeep] = {}
    if latest is not None:
        out[latest] = HardKeep.LATEST
    kept_steps = [c.step for c in cuts if c.id in policy_keeps or c.id in out]
    newest_kept = max(kept_steps) if kept_steps else None
    for c in cuts:
        if PINNED_TAG in c.tags:
            out.setdefault(c.id, HardKeep.PINNED)
        if newest_kept is not None and c.step > newest_kept:
            out.setdefault(c.id, HardKeep.NEWER)
    return out
