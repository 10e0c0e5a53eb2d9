"""Retention policies: small pure objects that say which cuts to keep.

A policy sees the committed, verified-good cuts in ascending step order and returns the ids it keeps;
``a | b`` keeps what either keeps. The store adds the hard rules on top (see ``Store.prune``): never
the LATEST target, never a cut newer than the newest kept one, never a cut tagged ``keep``; order is by
step, never by name or time (failure-modes row 19).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

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


def policy_to_json(policy: Policy) -> dict[str, Any]:
    """The JSON form of a policy built from this module's policies (and ``|`` of them), so a policy
    can travel to another process without pickle (issue 21: the writer process applies ``mirror_keep``).
    A policy of another class raises ``TypeError`` naming it."""
    if isinstance(policy, AnyOf):
        return {"any_of": [policy_to_json(p) for p in policy.policies]}
    if isinstance(policy, KeepLast):
        return {"keep_last": policy.n}
    if isinstance(policy, KeepEvery):
        return {"keep_every": policy.k}
    if isinstance(policy, KeepTagged):
        return {"keep_tagged": list(policy.tags)}
    if isinstance(policy, KeepFinal):
        return {"keep_final": True}
    raise TypeError(f"{type(policy).__name__} is not one of ckptstore's policies (KeepLast, KeepEvery, "
                    "KeepTagged, KeepFinal, or | of them) and has no JSON form")


def policy_from_json(doc: dict[str, Any]) -> Policy:
    """The policy :func:`policy_to_json` described (``ValueError`` for anything else)."""
    if not isinstance(doc, dict) or len(doc) != 1:
        raise ValueError(f"not a policy's JSON form: {doc!r}")
    (kind, arg), = doc.items()
    if kind == "any_of" and isinstance(arg, list) and arg:
        return AnyOf(tuple(policy_from_json(d) for d in arg))
    if kind == "keep_last" and type(arg) is int:
        return KeepLast(arg)
    if kind == "keep_every" and type(arg) is int:
        return KeepEvery(arg)
    if kind == "keep_tagged" and isinstance(arg, list) and all(isinstance(t, str) for t in arg):
        return KeepTagged(*arg)
    if kind == "keep_final" and arg is True:
        return KeepFinal()
    raise ValueError(f"not a policy's JSON form: {doc!r}")
