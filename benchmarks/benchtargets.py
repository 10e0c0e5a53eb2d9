"""Targets and the tables that judge them, shared by both benchmarks (no torch, no side effects).

A :class:`Target` is a bound on a measured figure (a ratio to a floor or a baseline, or an absolute
figure such as CPU seconds per GiB). It is judged on the median of the per-repetition values, the
same way for every table, and rendered into a "target" and a "met?" column; rows with no target (the
floors, the baselines, the references) show a dash in both. Each benchmark declares its targets in one
``TARGETS`` dict at its top, so the issue's numbers live in one place.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Literal, Sequence

DASH = "—"


@dataclass(frozen=True)
class Target:
    """``figure`` must be ``at_most`` / ``at_least`` ``limit`` (median of the per-repetition values)."""

    what: str
    bound: Literal["at_most", "at_least"]
    limit: float
    unit: str = "x"  # appended to the limit: "x" for ratios, " s/GiB" for CPU per GiB

    def cell(self) -> str:
        return f"{'<=' if self.bound == 'at_most' else '>='} {self.limit:g}{self.unit}"

    def met(self, values: Sequence[float | None]) -> bool | None:
        xs = [x for x in values if x is not None]
        if not xs:
            return None
        m = statistics.median(xs)
        return m <= self.limit if self.bound == "at_most" else m >= self.limit


def met_cell(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**NOT met**")


@dataclass
class Verdict:
    """One target judged in this run, for the summary table at the end of a report."""

    key: str
    target: Target
    values: list[float]
    shown: str  # the measured figure as the tables show it, "median (min-max)" plus its unit

    @property
    def ok(self) -> bool | None:
        return self.target.met(self.values)


@dataclass
class Judge:
    """Collects the verdicts of one report and renders the target / met? cells of each table row."""

    targets: dict[str, Target]
    verdicts: list[Verdict] = field(default_factory=list)

    def cells(self, key: str | None, values: Sequence[float | None] = (), shown: str = "") -> list[str]:
        """The two cells for a row: dashes when the row has no target (``key`` None), else the bound and the
        verdict on ``values``, which is also recorded, with ``shown``, for the summary."""
        if key is None:
            return [DASH, DASH]
        target = self.targets[key]
        v = Verdict(key, target, [x for x in values if x is not None], shown)
        self.verdicts.append(v)
        return [target.cell(), met_cell(v.ok)]

    def missing(self) -> list[str]:
        """Targets that no table judged in this run (a section not run, a method that failed)."""
        seen = {v.key for v in self.verdicts}
        return [k for k in self.targets if k not in seen]

    def summary(self) -> list[str]:
        """The closing "Targets" table: every target of the run, its measured figure and the verdict."""
        out = ["| target | bound | measured (median (min-max) of the repetitions) | met? |", "|---|---|---|---|"]
        for v in self.verdicts:
            out.append(f"| {v.target.what} | {v.target.cell()} | {v.shown} | {met_cell(v.ok)} |")
        for k in self.missing():
            out.append(f"| {self.targets[k].what} | {self.targets[k].cell()} | not measured in this run | n/a |")
        met = sum(1 for v in self.verdicts if v.ok)
        judged = sum(1 for v in self.verdicts if v.ok is not None)
        unjudged = len(self.targets) - judged
        out += ["", f"{met} of {judged} targets met in this run"
                + (f" ({unjudged} could not be judged)." if unjudged else ".")]
        return out


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A markdown table."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out
