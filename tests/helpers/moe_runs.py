"""The mixture-of-experts runs of ``moe_worker`` that tests/integration/test_moe.py checks.

Under the plan's base folder: ``c_TAG`` the checkpoints of the reference
jobs, ``out`` every job's dumps (``TAG_rRANK.pt``). Tags name the layout,
the world size and the experts per block (``moe_worker``'s layouts): with 4
experts EP's and efsdp's cuts are whole experts (``_StridedShard(0)``); with
2 experts at 4 ranks torchtitan cuts the experts' rows (``Shard(1)``).
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers import factored_runs
from tests.helpers.worker_jobs import Launch, ordered_launches

WORKER = "moe"
S, K = 3, 2

# (layout, nproc, tag, ref base, loads, experts); a "_resume" tag only loads.
RUNS = [
    ("ep", 2, "ep2_e4", "c_ep2_e4", [], 4),  # EP 2
    ("fsdp", 2, "fsdp2_e4", "c_fsdp2_e4", [], 4),  # EP 1 x FSDP 2
    ("tp", 2, "tp2_e4", "c_tp2_e4", [], 4),  # TP 2, EP 1: the experts cut by TP
    ("pp", 2, "pp2_e4", "c_pp2_e4", [], 4),  # PP 2, EP 1
    ("ep", 4, "ep2x2_e4", "c_ep2x2_e4", [], 4),  # EP 2 x efsdp 2
    ("ep", 4, "ep2x2_e2", "c_ep2x2_e2", [], 2),  # EP 2 x efsdp 2, experts Shard(1) on efsdp
    ("fsdp", 4, "fsdp4_e2", "c_fsdp4_e2", [], 2),  # EP 1 x FSDP 4, experts Shard(1)
    ("hsdp", 4, "hsdp4_e4", "c_hsdp4_e4", [], 4),  # HSDP 2 x EP 2
    ("ep4", 4, "ep4_e4", "c_ep4_e4", ["c_ep2x2_e4"], 4),  # EP 4 <- EP 2 x efsdp 2
    ("eptp", 4, "eptp4_e4", "c_eptp4_e4", ["c_ep2_e4"], 4),  # EP 2 x TP 2 <- EP 2
    ("ppep", 4, "ppep4_e4", "c_ppep4_e4", ["c_ep2_e4"], 4),  # PP 2 x EP 2 <- EP 2
    ("fsdp", 2, "fsdp2_e4_resume", "", ["c_ep2_e4"], 4),  # EP 1 <- EP 2, at 2 ranks
    # EP 2 <- EP 1, <- EP 2 x efsdp 2, <- PP 2 x EP 2
    ("ep", 2, "ep2_e4_resume", "", ["c_fsdp2_e4", "c_ep2x2_e4", "c_ppep4_e4"], 4),
    ("ep", 2, "ep2_e2", "c_ep2_e2", ["c_fsdp4_e2"], 2),  # EP 2 (Shard(0)) <- Shard(1) at 4 ranks
    ("one", 1, "one_e4", "c_one_e4", ["c_ep2_e4"], 4),  # 1 rank <- EP 2
    ("one", 1, "one_e2", "c_one_e2", ["c_ep2x2_e2"], 2),  # 1 rank <- EP 2 x efsdp 2 (Shard(1))
]

PLAN = [
    (2, ["ep2_e4", "fsdp2_e4", "tp2_e4", "pp2_e4"]),
    (4, ["ep2x2_e4", "ep2x2_e2", "fsdp4_e2", "hsdp4_e4", "ep4_e4", "eptp4_e4", "ppep4_e4"]),
    (2, ["fsdp2_e4_resume", "ep2_e4_resume", "ep2_e2"]),
    (1, ["one_e4", "one_e2"]),
]


def target(tag: str) -> str:
    return tag.split("_resume")[0]


def experts(tag: str) -> int:
    return int(tag.rsplit("_e", 1)[1].split("_")[0])


PAIRS = [(src, target(tag)) for _, _, tag, _, loads, _ in RUNS for src in loads]


def plan(base: Path) -> list[Launch]:
    """Every job of PLAN, as launches (``worker_jobs.launch_all``); the folders are made here."""
    out = base / "out"
    out.mkdir(parents=True)
    jobs = {}
    for layout, n, tag, ref, loads, e in RUNS:
        args = [WORKER, "--layout", layout, "--experts", str(e), "--tag", tag, "--out", str(out),
                "--save-step", str(S), "--steps", str(K)]
        if ref:
            args += ["--ref", str(base / ref)]
        if loads:
            args += ["--load", ",".join(str(base / c) for c in loads)]
        jobs[tag] = (n, args)
    # The factored second moment's MoE runs (tests/integration/test_factored.py) share these launches.
    jobs.update(factored_runs.moe_jobs(base, out))
    plan_ = [(n, tags + factored_runs.MOE_PHASES.get(i, [])) for i, (n, tags) in enumerate(PLAN)]
    return ordered_launches(plan_, jobs, [r[:5] for r in RUNS + factored_runs.MOE_RUNS], {})
