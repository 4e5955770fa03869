"""MIG geometry of one GPU: which layouts are valid, and where new instances go so larger profiles stay possible.

A layout is a tuple of ``Slot(profile, start)``: one GPU instance of ``profile`` whose memory slices begin at
``start``. ``layout_refusal`` checks NVIDIA's rules against the GPU's table (``gpuorch_policy.mig_profiles``):
the profile is offered, the start is one of its allowed placements, memory slices never overlap, compute slices
add up to at most 7, and no profile has more instances than its instance count.

``place_instances(table, kept, wanted)`` adds one instance per wanted profile to the ``kept`` slots (which never
move) and returns the valid layout that leaves the most room for larger profiles afterwards, or ``None`` when no
valid layout holds them all. "Room" is ``headroom``: for each profile from the largest down, how many more
instances of it could still be created; layouts compare on that tuple, so a 1g instance placed at slice 0 (where
it blocks the only 4g/7g start) loses to one placed at slice 6. This is what keeps MIG fragmentation from
growing with placement order. Pure and deterministic.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from gpuorch_policy.mig_profiles import MIG_COMPUTE_SLICES, MigProfileSpec


@dataclass(frozen=True, order=True)
class Slot:
    """One GPU instance: its profile name and the first memory slice of its placement."""

    profile: str
    start: int


Table = tuple[MigProfileSpec, ...]


def planning_profiles(table: Table) -> tuple[MigProfileSpec, ...]:
    """The profiles the planner uses (no ``+me`` media-extension variants), largest first."""
    return tuple(sorted((p for p in table if not p.media_extensions),
                        key=lambda p: (-p.memory_slices, -p.compute_slices, p.name)))


def spec_of(table: Table, profile: str) -> MigProfileSpec | None:
    return next((p for p in table if p.name == profile), None)


def _mask(spec: MigProfileSpec, start: int) -> int:
    return ((1 << spec.memory_slices) - 1) << start


def layout_refusal(table: Table, slots: Iterable[Slot]) -> str | None:
    """Why ``slots`` is not a valid layout on a GPU with ``table``, or ``None`` when it is."""
    used = 0
    compute = 0
    counts: dict[str, int] = {}
    for slot in slots:
        spec = spec_of(table, slot.profile)
        if spec is None:
            return f"profile {slot.profile} is not offered by this GPU"
        if slot.start not in spec.starts:
            return f"{slot.profile} cannot start at memory slice {slot.start} (allowed: {spec.starts})"
        mask = _mask(spec, slot.start)
        if used & mask:
            return f"{slot.profile}@{slot.start} overlaps another instance's memory slices"
        used |= mask
        compute += spec.compute_slices
        counts[spec.name] = counts.get(spec.name, 0) + 1
        if counts[spec.name] > spec.instance_count:
            return f"more than {spec.instance_count} x {spec.name}"
    if compute > MIG_COMPUTE_SLICES:
        return f"{compute} compute slices; the GPU has {MIG_COMPUTE_SLICES}"
    return None


def headroom(table: Table, slots: Sequence[Slot]) -> tuple[int, ...]:
    """For each planning profile, largest first: how many more instances of it alone the GPU could still take."""
    return _headroom(table, tuple(sorted(slots)))


@lru_cache(maxsize=65536)
def _headroom(table: Table, slots: tuple[Slot, ...]) -> tuple[int, ...]:
    return tuple(_more_of(table, slots, spec) for spec in planning_profiles(table))


def _more_of(table: Table, slots: tuple[Slot, ...], spec: MigProfileSpec) -> int:
    layout = list(slots)
    added = 0
    for start in spec.starts:
        if layout_refusal(table, [*layout, Slot(spec.name, start)]) is None:
            layout.append(Slot(spec.name, start))
            added += 1
    return added


def place_instances(table: Table, kept: Sequence[Slot], wanted: Sequence[str]) -> tuple[Slot, ...] | None:
    """``kept`` plus one slot per ``wanted`` profile, positioned to leave the most headroom; ``None`` if none fit.

    ``kept`` must itself be valid; its slots are returned unchanged (they are running or already planned)."""
    if layout_refusal(table, kept) is not None:
        return None
    specs = []
    for name in wanted:
        spec = spec_of(table, name)
        if spec is None:
            return None
        specs.append(spec)
    specs.sort(key=lambda p: (-p.memory_slices, -p.compute_slices, p.name))
    best: tuple[tuple[int, ...], tuple[Slot, ...]] | None = None
    for layout in _layouts(table, tuple(kept), specs, 0, -1):
        key = (headroom(table, layout), tuple(sorted(layout, reverse=True)))
        if best is None or key > best:
            best = key
    return tuple(sorted(best[1], key=lambda s: (s.start, s.profile))) if best else None


def _layouts(table: Table, layout: tuple[Slot, ...], specs: list[MigProfileSpec], i: int, floor: int
             ) -> Iterable[tuple[Slot, ...]]:
    """Every valid completion; equal profiles in increasing start order (each set once)."""
    if i == len(specs):
        yield layout
        return
    spec = specs[i]
    same_as_before = i > 0 and specs[i - 1].name == spec.name
    for start in spec.starts:
        if same_as_before and start <= floor:
            continue
        candidate = (*layout, Slot(spec.name, start))
        if layout_refusal(table, candidate) is None:
            yield from _layouts(table, candidate, specs, i + 1, start)


def fits(table: Table, layout: Sequence[Slot], profile: str) -> bool:
    """Could one more instance of ``profile`` be created on this layout?"""
    return place_instances(table, layout, [profile]) is not None
