"""MIG geometry: NVIDIA's layout rules, and slice positions that keep larger profiles placeable."""

from __future__ import annotations

import itertools

import pytest
from gpuorch_policy.mig_geometry import Slot, headroom, layout_refusal, place_instances, planning_profiles
from gpuorch_policy.mig_profiles import MIG_A100_40GB, MIG_H100_80GB, mig_table_for
from hypothesis import given, settings
from hypothesis import strategies as st

H100 = MIG_H100_80GB


@pytest.mark.parametrize(("slots", "why"), [
    ([Slot("7g.80gb", 0)], None),
    ([Slot("4g.40gb", 0), Slot("3g.40gb", 4)], None),
    ([Slot("3g.40gb", 0), Slot("3g.40gb", 4)], None),
    ([Slot("4g.40gb", 0), Slot("2g.20gb", 4), Slot("1g.10gb", 6)], None),
    ([Slot("1g.10gb", i) for i in range(7)], None),
    ([Slot("1g.10gb", 7)], "cannot start"),                       # no 1g placement on slice 7
    ([Slot("3g.40gb", 2)], "cannot start"),                       # 3g starts at 0 or 4 only
    ([Slot("4g.40gb", 0), Slot("2g.20gb", 2)], "overlaps"),
    ([Slot("4g.40gb", 0), Slot("3g.40gb", 4), Slot("1g.10gb", 7)], "cannot start"),
    ([Slot("2g.20gb", 0), Slot("2g.20gb", 2), Slot("2g.20gb", 4), Slot("1g.20gb", 6)], None),
    ([Slot("3g.40gb", 0), Slot("2g.20gb", 4), Slot("1g.20gb", 6)], None),
    ([Slot("3g.40gb", 0), Slot("2g.20gb", 4), Slot("2g.20gb", 6)], "cannot start"),
    ([Slot("4g.40gb", 0), Slot("1g.20gb", 4), Slot("1g.20gb", 6), Slot("1g.10gb", 6)], "overlaps"),
    ([Slot("5g.50gb", 0)], "not offered"),
])
def test_layout_rules(slots, why) -> None:
    refusal = layout_refusal(H100, slots)
    assert (refusal is None) if why is None else (refusal is not None and why in refusal)


def test_compute_slices_are_capped_at_seven() -> None:
    # 4 x 1g.20gb (4 compute, 8 memory slices) is fine; 3g + 4 x 1g would need 7 memory... and 7 compute: fine
    assert layout_refusal(H100, [Slot("1g.20gb", s) for s in (0, 2, 4, 6)]) is None
    assert layout_refusal(H100, [Slot("4g.40gb", 0), *(Slot("1g.10gb", s) for s in (4, 5, 6))]) is None
    # 4 x 2g would need 8 compute slices (and has no fourth 2g placement)
    assert layout_refusal(H100, [Slot("2g.20gb", s) for s in (0, 2, 4)] + [Slot("1g.20gb", 6)]) is None


def test_tables_are_found_by_reported_model_names() -> None:
    assert mig_table_for("H100-80GB") is H100
    assert mig_table_for("NVIDIA H100 80GB HBM3") is H100
    assert mig_table_for("A100-40GB") is MIG_A100_40GB
    assert mig_table_for("L4") == ()


def test_a_small_instance_goes_where_it_blocks_no_larger_profile() -> None:
    layout = place_instances(H100, [], ["1g.10gb"])
    assert layout == (Slot("1g.10gb", 6),)          # at 0 it would block 4g and 7g; at 4/5 the second 3g
    assert place_instances(H100, layout, ["4g.40gb"]) is not None
    layout = place_instances(H100, [], ["1g.10gb", "1g.10gb", "2g.20gb"])
    assert layout is not None and place_instances(H100, layout, ["3g.40gb"]) is not None


def test_place_instances_keeps_what_is_kept_and_refuses_what_cannot_fit() -> None:
    kept = (Slot("3g.40gb", 4),)
    layout = place_instances(H100, kept, ["2g.20gb", "2g.20gb"])
    assert layout == (Slot("2g.20gb", 0), Slot("2g.20gb", 2), Slot("3g.40gb", 4))
    assert place_instances(H100, (Slot("3g.40gb", 0),), ["2g.20gb", "2g.20gb"]) is None  # 2g never starts at 6
    assert place_instances(H100, kept, ["4g.40gb", "1g.10gb"]) is None
    assert place_instances(H100, [], ["7g.80gb", "1g.10gb"]) is None
    assert place_instances(H100, [Slot("1g.10gb", 7)], ["1g.10gb"]) is None  # an invalid kept layout


profiles = [p.name for p in planning_profiles(H100)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(profiles), min_size=1, max_size=6), st.sampled_from(["H100-80GB", "A100-40GB"]))
def test_placed_layouts_are_valid_and_leave_the_most_room(names, model) -> None:
    """Any valid arrangement of the same instances leaves no more room for larger profiles than the chosen one."""
    table = mig_table_for(model)
    names = [n.replace("80gb", "40gb") if model == "A100-40GB" else n for n in names]
    by_h100 = dict(zip(profiles, (p.name for p in planning_profiles(table)), strict=True)) if model != "H100-80GB" \
        else {n: n for n in profiles}
    names = [by_h100.get(n, n) for n in names]
    layout = place_instances(table, [], names)
    specs = {p.name: p for p in table}
    arrangements = [
        [Slot(n, s) for n, s in zip(names, starts, strict=True)]
        for starts in itertools.product(*(specs[n].starts for n in names))
    ]
    valid = [a for a in arrangements if layout_refusal(table, a) is None]
    if layout is None:
        assert not valid
        return
    assert layout_refusal(table, layout) is None
    assert sorted(s.profile for s in layout) == sorted(names)
    assert all(headroom(table, a) <= headroom(table, layout) for a in valid)
