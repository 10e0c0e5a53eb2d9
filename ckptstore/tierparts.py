"""Which tier each rank reads its part of a cut from, in a restore of several ranks across a mirror
(issue 21, "Several ranks": rank 1's local copy may be gone while rank 0's is fine).

The group agrees on one cut, the newest whose every rank's part verifies in some tier, and each rank
reads its part from the first tier (local, then mirror) whose copy of that part verifies:

1. Rank 0 lists both tiers (only rank 0 lists: issue 24) and sends the candidates, newest first, each
   with the tiers that hold a copy of it (the same manifest: another cut at its step is never taken for
   it). With ``fallback`` every committed cut is one, less the copies recorded bad, or newer than their
   tier's LATEST (skipped as one tier's ``choose_across`` skips them); without it the candidate is the
   newest LATEST target of the tiers alone (a broken LATEST raises).
2. For each candidate in turn every rank verifies its own part of it, tier by tier, and the ranks
   exchange which tier served them (:func:`agree`). The first candidate that every rank could serve is
   the one. With ``fallback`` a copy proven damaged is recorded bad in its tier and the next candidate
   is tried; without it the rank whose part no tier holds raises a ``DataError`` naming it, and every
   other rank a ``RankFailure`` naming that rank. An I/O error proves nothing: it is raised, never
   recorded.

Every rank makes the same exchanges (each sees every answer), so the loop never splits the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from . import pointed
from .core import StoreCore
from .errors import CutNotFound, DataError, LatestError, StorageError, UsageError
from .events import log
from .manifest import Manifest
from .ranks import RankGroup, check_all_ok, outcome
from .recovery import Classification
from .repairing import record_bad_quietly
from .assemble import fragment_path, read_part
from .verify import FindingKind, part_tree_problem, tree_problem, verify_file

#: The tiers in the order a copy is preferred in (a tie at a step goes to the local tier).
TIERS = ("local", "mirror")
#: The exchange's name (a restore's: ``ranks.CALLS`` maps it to ``restore(group=)``).
EXCHANGE = "restore-choose"


@dataclass(frozen=True)
class PartsChoice:
    """What the group agreed on: the cut, the tier each rank reads its part from (by rank), and every
    copy skipped on the way (cut id -> why, naming the tier's copy and, for a part, the rank)."""

    cut: str
    tiers: list[str]
    skipped: dict[str, str]


def candidates(cores: dict[str, StoreCore], *, fallback: bool) -> dict[str, Any]:
    """Rank 0: the candidates and the copies left out (module docstring, step 1), as JSON for the others:
    ``{"candidates": [{"cut": id, "tiers": [names]}], "skipped": [[tier, cut, why]]}``."""
    classes = {name: cores[name].classify() for name in TIERS}
    if not fallback:
        return {"candidates": _latest_candidate(classes, cores), "skipped": []}
    rows = sorted(((-m.step, TIERS.index(name), -pos, name, m) for name, cls in classes.items()
                   for pos, m in enumerate(cls.committed)), key=lambda r: r[:3])
    first: dict[int, tuple[str, Manifest]] = {}
    found: dict[str, list[str]] = {}
    skipped: list[list[str]] = []
    for *_, name, m in rows:
        ref_name, ref = first.setdefault(m.step, (name, m))
        why = _left_out(classes[name], m)
        if ref_name != name and m != ref:
            why = f"another cut than the {ref_name} tier's {ref.cut} at step {m.step}"
        if why is not None:
            skipped.append([name, m.cut, why])
        else:
            found.setdefault(m.cut, []).append(name)
    order = [m.cut for *_, _n, m in rows]
    return {"candidates": [{"cut": c, "tiers": found[c]} for c in dict.fromkeys(order) if c in found],
            "skipped": skipped}


def _latest_candidate(classes: dict[str, Classification], cores: dict[str, StoreCore]) -> list[dict[str, Any]]:
    """Without fallback: the newest LATEST target of the tiers, with every tier holding that same cut."""
    heads: list[tuple[int, int, Manifest]] = []
    for i, name in enumerate(TIERS):
        cls = classes[name]
        if cls.latest_problem is not None:
            raise LatestError(cls.latest_problem, store=cores[name].url, hint=f"run `ckptstore repair {cores[name].url}`")
        m = cls.find(cls.latest.cut) if cls.latest is not None else None
        if m is not None:
            heads.append((-m.step, i, m))
    if not heads:
        return []
    m0 = min(heads, key=lambda h: h[:2])[2]
    return [{"cut": m0.cut, "tiers": [name for name in TIERS if classes[name].find(m0.cut) == m0]}]


def _left_out(cls: Classification, m: Manifest) -> str | None:
    """Why a tier's copy is no candidate (as ``selection.choose_across`` skips it), None when it is."""
    if m.cut in cls.bad:
        return "recorded bad by an earlier load"
    if cls.latest is not None and m.step > cls.latest.step:
        return "newer than LATEST"
    return None


def agree(ranks: RankGroup, cores: dict[str, StoreCore], plan: dict[str, Any], *, fallback: bool,
          store: str) -> PartsChoice | None:
    """Every rank: the first candidate of rank 0's ``plan`` that every rank's part verifies for, and the
    tier of each (module docstring, step 2); None when the tiers hold no cut. Collective."""
    skips: list[tuple[str, str, str]] = [(t, c, w) for t, c, w in plan["skipped"]]
    for t, c, w in skips if ranks.rank == 0 else []:
        _note_skip(cores["local"], t, c, w)
    for cand in plan["candidates"]:
        answers = _each_rank(ranks, lambda: _serve_part(cores, cand, ranks, fallback),
                             doing=f"verifying each rank's part of cut {cand['cut']}", store=store, cut=cand["cut"])
        skips += [(t, cand["cut"], w) for a in answers for t, w in a["skipped"]]
        if all(a["tier"] is not None for a in answers):
            return PartsChoice(cand["cut"], [a["tier"] for a in answers], _skipped(skips))
    if not plan["candidates"]:
        return None
    raise CutNotFound("no committed cut verifies for every rank in either tier", store=store,
                      hint=f"skipped: {_skipped(skips)}")


def _serve_part(cores: dict[str, StoreCore], cand: dict[str, Any], ranks: RankGroup,
                fallback: bool) -> dict[str, Any]:
    """This rank: the first tier whose copy of its part of ``cand`` verifies, and why each one before it
    did not. Without ``fallback`` none serving it raises that tier's damage (a ``DataError``)."""
    cut, rank = cand["cut"], ranks.rank
    skipped: list[tuple[str, str]] = []
    failure: DataError | None = None
    for name in cand["tiers"]:
        core = cores[name]
        try:
            m = pointed.named_manifest(core.storage, core.url, cut)  # rank 0 listed; every rank reads by name
        except (CutNotFound, DataError) as exc:  # removed, or damaged, since rank 0 listed it
            skipped.append((name, f"rank {rank}: {exc.message}"))
            continue
        if m.world_size != ranks.size:
            raise UsageError(f"cut {cut} holds {m.world_size} rank(s) but this job has {ranks.size}; a per-rank "
                             "restore needs the world size of the save (resharding needs the DCP reader)",
                             store=core.url, cut=cut)
        why, path = part_damage(core, m, rank)
        if why is None:
            return {"tier": name, "skipped": skipped}
        skipped.append((name, f"rank {rank}: {why}"))
        _note_skip(cores["local"], name, cut, f"rank {rank}: {why}")
        if fallback:
            record_bad_quietly(core, cut, f"rank {rank}'s part: {why}")
        failure = failure or DataError(f"LATEST cut fails verification for rank {rank}'s part: {why}",
                                       store=core.url, cut=cut, path=path,
                                       hint="restore(..., fallback=True) resumes from the newest cut that verifies")
    if not fallback and failure is not None:
        raise failure
    return {"tier": None, "skipped": skipped}


def part_damage(core: StoreCore, m: Manifest, rank: int) -> tuple[str | None, str | None]:
    """The first finding that proves rank ``rank``'s part of committed cut ``m`` damaged in this tier
    (a tree that does not decode, a file missing, short or hashing wrong) and its path; (None, None)
    when the part verifies. Only this rank's files are read. An I/O error raises: it proves nothing."""
    if m.fragmented:  # format 5: this rank's fragment alone, checked against the commit record first
        try:
            m = read_part(core.storage, core.url, m, rank)
        except StorageError:
            raise
        except DataError as exc:
            return f"{FindingKind.CORRUPT_FILE}: {exc.message}", fragment_path(m.cut, rank)
        problem = part_tree_problem(m, rank)
    else:
        problem = tree_problem(m)
    if problem is not None:
        return f"{FindingKind.TREE_INVALID}: {problem}", None
    for rec in m.files:
        if rec.rank != rank:
            continue
        for f in verify_file(core.storage, m, rec):
            if f.kind == FindingKind.IO_ERROR:
                raise StorageError(f"could not check the cut: {f.message}", store=core.url, cut=m.cut, path=f.path,
                                   hint="a transient I/O error: retry; the cut was not recorded bad")
            return f"{f.kind}: {f.message}", f.path
    return None, None


def _each_rank(ranks: RankGroup, local: Callable[[], Any], *, doing: str, **where: Any) -> list[Any]:
    """``local`` on every rank and every rank's result on every rank (one exchange); a failure anywhere
    raises everywhere: that rank its own error, the others a ``RankFailure`` naming it."""
    err: BaseException | None = None
    result: Any = None
    try:
        result = local()
    except BaseException as exc:  # noqa: BLE001 - every rank hears of it in the exchange
        err = exc
    msgs = ranks.exchange(EXCHANGE, {**outcome(err), "value": result}, **where)
    if err is not None:
        raise err
    check_all_ok(msgs, doing, **where)
    return [m["value"] for m in msgs]


def _note_skip(local: StoreCore, tier: str, cut: str, why: str) -> None:
    local.events.emit("fallback-skipped", cut=cut, reason=f"{tier} copy: {why}")
    log.warning("ckptstore: skipped the %s copy of cut %s: %s", tier, cut, why)


def _skipped(skips: Sequence[tuple[str, str, str]]) -> dict[str, str]:
    """Cut id -> why, each reason naming its tier's copy, the reasons of one cut joined (as
    ``selection.Choice.skipped`` does with several tiers)."""
    out: dict[str, str] = {}
    for tier, cut, why in skips:
        why = f"{tier} copy: {why}"
        out[cut] = f"{out[cut]}; {why}" if cut in out else why
    return out


__all__ = ["EXCHANGE", "PartsChoice", "TIERS", "agree", "candidates", "part_damage"]
