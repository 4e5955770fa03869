"""Planning a MIG layout: which placement each wanted GPU instance gets, or why the layout cannot exist.

``plan_layout`` is pure. It works on the profile table the GPU itself reports (through NVML), so the same rules
hold on a real GPU and in the simulation:
- every wanted profile must be offered by the GPU (names like ``1g.10gb``; ``MIG 1g.10gb`` and ``mig-1g.10gb`` too);
- no more instances of a profile than its instance count;
- each instance at one of the profile's allowed placement starts, instances never overlapping in memory slices;
- compute slices of all instances add up to at most the GPU's compute slices (7 on A100/H100).
It searches placements by backtracking (largest instances first), so a layout that fits anywhere is found.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class MigProfileOffer:
    """One GPU-instance profile as the GPU reports it."""

    name: str
    profile_id: int
    compute_slices: int
    placement_size: int
    instance_count: int
    starts: tuple[int, ...]
    memory_mib: int


@dataclass(frozen=True)
class PlannedInstance:
    profile: MigProfileOffer
    start: int


@dataclass(frozen=True)
class MigLayoutPlan:
    instances: tuple[PlannedInstance, ...] = ()
    refusal: str | None = None

    @property
    def ok(self) -> bool:
        return self.refusal is None


def normalize_profile_name(name: str) -> str:
    text = name.strip().lower()
    for prefix in ("mig ", "mig-", "nvidia.com/mig-"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    return text


def plan_layout(offers: Sequence[MigProfileOffer], wanted: Sequence[str], *, compute_slices: int | None = None
                ) -> MigLayoutPlan:
    by_name = {normalize_profile_name(o.name): o for o in offers}
    chosen: list[MigProfileOffer] = []
    for name in wanted:
        offer = by_name.get(normalize_profile_name(name))
        if offer is None:
            known = ", ".join(sorted(by_name)) or "none"
            return MigLayoutPlan(refusal=f"profile {name!r} is not offered by this GPU (offered: {known})")
        chosen.append(offer)
    for offer in {o.profile_id: o for o in chosen}.values():
        count = sum(1 for c in chosen if c.profile_id == offer.profile_id)
        if count > offer.instance_count:
            return MigLayoutPlan(
                refusal=f"{count} x {offer.name} asked; the GPU allows {offer.instance_count}")
    max_compute = compute_slices or max((o.compute_slices for o in offers), default=0)
    need = sum(o.compute_slices for o in chosen)
    if need > max_compute:
        return MigLayoutPlan(refusal=f"layout needs {need} compute slices; the GPU has {max_compute}")
    order = sorted(chosen, key=lambda o: (-o.placement_size, -o.compute_slices, o.name))
    placed = _place(order, [])
    if placed is None:
        return MigLayoutPlan(refusal=f"no placement fits {', '.join(wanted)} within the GPU's memory slices")
    return MigLayoutPlan(instances=tuple(placed))


def _place(todo: list[MigProfileOffer], placed: list[PlannedInstance]) -> list[PlannedInstance] | None:
    if not todo:
        return placed
    offer, rest = todo[0], todo[1:]
    for start in offer.starts:
        end = start + offer.placement_size
        if all(end <= p.start or p.start + p.profile.placement_size <= start for p in placed):
            result = _place(rest, [*placed, PlannedInstance(offer, start)])
            if result is not None:
                return result
    return None
