"""GefenMuon's schedule (``optim.muon.schedule``): owners by Newton-Schulz cost, buckets within their bound.

Pure functions, so every case is exact; the multi-rank step that runs the
schedule is tests/integration/test_gefen_muon.py (which also checks that
every member of a group built the same one and that each bucket's peak
bytes stayed within the bound).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from gefen_titan.optim.muon.schedule import (
    MOMENTUM_BYTES,
    MatrixSpec,
    build_schedule,
    lpt,
    ns_flops,
    owner_loads,
    rank_bytes,
)

GROUP = (3, 5, 7, 11)


def spec(fqn: str, rows: int, cols: int, group=GROUP, ns_steps: int = 5) -> MatrixSpec:
    """A matrix cut by rows over ``group`` (uneven cuts as DTensor's: ceil-sized first)."""
    per = -(-rows // len(group)) if group else rows
    cut = [max(0, min(per, rows - per * j)) for j in range(len(group))]
    return MatrixSpec(fqn, (rows, cols), ns_steps, tuple(group), tuple(c * cols for c in cut), tuple(cut))


def test_cost_is_newton_schulz_flops_not_numel():
    # two GEMMs of s*s*l and one of s^3 per step, 2 FLOPs per multiply-add
    assert ns_flops((8, 32), 5) == 2 * 5 * 8 * 8 * (2 * 32 + 8)
    assert ns_flops((32, 8), 5) == ns_flops((8, 32), 5)
    # the same numel: a square matrix costs more than a thin one
    assert ns_flops((64, 64), 5) > 4 * ns_flops((16, 256), 5)


def test_owners_follow_cost_largest_first_each_to_the_least_loaded():
    # a square 64x64 (cost 2.6M) and four 16x256 (numel 4096 each, cost 0.44M):
    # by numel all five tie; by cost the square one is alone on its owner
    specs = [spec("thin.a", 16, 256), spec("square", 64, 64), spec("thin.b", 16, 256), spec("thin.c", 16, 256),
             spec("thin.d", 16, 256)]
    owners, after = lpt(specs, range(len(specs)), {})
    assert owners[1] == GROUP[0]  # largest first, to the first member
    assert sorted(owners[i] for i in (0, 2, 3, 4)) == [5, 5, 7, 11]  # then the others, one each, then wrap
    assert [i for i in (0, 2, 3, 4) if owners[i] == 5] == [0, 4]  # ties by FQN: thin.a first, thin.d wraps
    assert sum(after[GROUP]) == sum(m.cost for m in specs)


def test_ties_are_broken_by_fqn_not_by_position():
    a, b = spec("layers.0.w", 32, 32), spec("layers.1.w", 32, 32)
    first, _ = lpt([a, b], [0, 1], {})
    swapped, _ = lpt([b, a], [0, 1], {})
    assert first == {0: 3, 1: 5} and swapped == {0: 5, 1: 3}


def test_carried_loads_spread_later_buckets():
    one = [spec("m", 32, 32)]
    owners, carried = lpt(one, [0], {})
    again, _ = lpt(one, [0], carried)
    assert owners[0] == 3 and again[0] == 5  # the next bucket's single matrix goes elsewhere


def test_groups_are_balanced_on_their_own_and_whole_matrices_have_no_owner():
    specs = [spec("a", 32, 32), spec("col", 32, 32, group=(0, 1)), spec("whole", 32, 32, group=())]
    owners, _ = lpt(specs, range(3), {})
    assert owners == {0: 3, 1: 0, 2: -1}


def _random_specs(seed: int, n: int = 60) -> list[MatrixSpec]:
    rnd = random.Random(seed)
    shapes = [(rnd.choice([8, 16, 48, 64, 128, 130]), rnd.choice([16, 64, 96, 256])) for _ in range(n)]
    return [spec(f"layers.{i}.w", r, c) for i, (r, c) in enumerate(shapes)]


@pytest.mark.parametrize("bucket_bytes", [1, 64 << 10, 512 << 10, 1 << 30])
def test_buckets_keep_their_bound_and_cover_every_matrix_once_in_order(bucket_bytes):
    specs = _random_specs(1)
    sched = build_schedule(specs, bucket_bytes)
    assert sched.limit_bytes == max(bucket_bytes, 2 * max(m.nbytes for m in specs))
    assert [i for b in sched.buckets for i in b.matrices] == list(range(len(specs)))
    for b in sched.buckets:
        held = rank_bytes(specs, dict(zip(b.matrices, b.owners)))
        assert len(b.matrices) == 1 or max(held.values()) <= sched.limit_bytes
    if bucket_bytes == 1 << 30:
        assert len(sched.buckets) == 1
    else:  # the longest run that fits: with the loads carried from the buckets before it (as the
        # schedule assigns owners), the bucket grown by the next matrix would not have fitted
        carried: dict = {}
        for b, nxt in zip(sched.buckets, sched.buckets[1:]):
            grown = list(b.matrices) + [nxt.matrices[0]]
            owners, _ = lpt(specs, grown, carried)
            assert max(rank_bytes(specs, owners).values()) > sched.limit_bytes, (b, nxt.matrices[0])
            owners, carried = lpt(specs, b.matrices, carried)
            assert tuple(owners[i] for i in b.matrices) == b.owners  # the replay is the schedule's


def test_rank_bytes_counts_what_a_rank_sends_and_the_whole_matrices_it_owns():
    m = spec("w", 8, 16)  # rows 2 per member, 16 cols
    held = rank_bytes([m], {0: 5})
    assert held[5] == 8 * 17 * MOMENTUM_BYTES
    assert held[3] == held[7] == held[11] == 2 * 17 * MOMENTUM_BYTES


def test_more_than_one_owner_computes_in_a_bucket():
    specs = [spec(f"layers.{i}.w", 64, 64) for i in range(8)]
    for bucket_bytes in (1, 1 << 30):
        sched = build_schedule(specs, bucket_bytes)
        for b in sched.buckets:
            assert len(set(b.owners)) == min(len(b.matrices), len(GROUP)), b
        assert any(len(b.matrices) > 1 for b in sched.buckets)


def test_busiest_owner_within_the_largest_matrix_or_a_tenth_over_the_mean():
    specs = _random_specs(2, n=200)
    sched = build_schedule(specs, 1 << 20)
    loads = owner_loads(specs, sched)
    mean = sum(m.cost for m in specs) / len(GROUP)
    assert max(loads.values()) <= max(max(m.cost for m in specs), 1.1 * mean)
    assert sum(loads.values()) == sum(m.cost for m in specs)


_IN_CHILD = """
import json, sys
from gefen_titan.optim.muon.schedule import build_schedule
from tests.unit.test_muon_schedule import _random_specs
specs = _random_specs(3) + _random_specs(4)[:5]
s = build_schedule(specs, 256 << 10)
print(json.dumps([[list(b.matrices), list(b.owners)] for b in s.buckets]))
"""


def test_every_member_builds_the_same_schedule_whatever_its_process():
    # A member computes the schedule alone; a difference between processes
    # (hash seeds: set or dict orders) would pair mismatched messages.
    runs = [subprocess.run([sys.executable, "-c", _IN_CHILD], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout for seed in ("1", "2")]
    assert runs[0] == runs[1] and json.loads(runs[0])


def test_a_bad_bucket_size_is_refused():
    with pytest.raises(ValueError, match="bucket_bytes"):
        build_schedule([spec("w", 8, 8)], 0)


def test_the_schedules_fast_byte_count_is_rank_bytes():
    """build_schedule counts a bucket's bytes from prefix sums per shard group (``_RangeBytes``): the
    same figure as ``rank_bytes``, for dense matrices of several groups, whole matrices and experts
    that one rank holds whole or a few hold cut."""
    from gefen_titan.optim.muon.schedule import _RangeBytes

    rnd = random.Random(5)
    specs = []
    for i in range(80):
        kind = rnd.choice(["dense", "col", "whole", "expert", "cut"])
        if kind == "whole":
            specs.append(spec(f"w{i}", 16, 32, group=()))
        elif kind == "expert":  # a whole expert on one rank
            specs.append(spec(f"e{i}[0]", 24, 16, group=(rnd.choice(GROUP),)))
        elif kind == "cut":  # an expert's rows over two of the ranks
            specs.append(spec(f"e{i}[1]", 24, 16, group=tuple(rnd.sample(GROUP, 2))))
        else:
            specs.append(spec(f"m{i}", rnd.choice([8, 30, 64]), 48, group=GROUP if kind == "dense" else (0, 1)))
    fast = _RangeBytes(specs)
    for _ in range(60):
        a = rnd.randrange(len(specs))
        b = rnd.randrange(a + 1, len(specs) + 1)
        owners, _ = lpt(specs, range(a, b), {})
        assert fast(a, b, owners) == max(rank_bytes(specs, owners).values(), default=0), (a, b)
