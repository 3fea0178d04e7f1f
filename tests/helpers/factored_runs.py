"""The factored second moment's layout runs of ``agreed_worker`` that tests/integration/test_factored.py
checks (``--second-moment factored``): which jobs, in which launches.

As ``agreed_runs``: a ref job runs S+K steps and saves at S, a job with loads resumes each at S and
runs K more. Two more resume each other's checkpoint with the other second moment (``switch``). The MoE
runs (``MOE_RUNS``) share ``moe_runs``'s launches (``MOE_PHASES``).
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers.worker_jobs import Launch, ordered_launches, run_job

WORKER = "agreed"
S, K = 3, 2

# (layout, nproc, tag, ref base, loads). "f_" jobs run factored, "b_" block.
RUNS = [
    ("fsdp", 1, "f_fsdp1", "c_f_fsdp1", []),
    ("fsdp", 2, "f_fsdp2", "c_f_fsdp2", []),
    ("fsdp", 2, "b_fsdp2", "c_b_fsdp2", []),
    ("fsdp_offload", 2, "f_fsdp2_offload", "c_f_fsdp2_offload", ["c_f_fsdp2"]),
    ("tp", 2, "f_tp2", "c_f_tp2", []),
    ("pp", 2, "f_pp2", "c_f_pp2", ["c_f_fsdp2"]),  # PP 2 <- FSDP 2
    ("fsdp", 3, "f_fsdp3", "c_f_fsdp3", ["c_f_fsdp2"]),
    ("fsdp_tp", 4, "f_fsdp_tp4", "c_f_fsdp_tp4", ["c_f_fsdp2", "c_f_tp2"]),
    ("hsdp", 4, "f_hsdp4", "c_f_hsdp4", []),
    ("fsdp", 2, "f_fsdp2_resume", "", ["c_f_fsdp1", "c_f_fsdp3", "c_f_fsdp_tp4", "c_f_hsdp4", "c_f_pp2",
                                       "c_f_fsdp2_offload", "c_f_tp2"]),
    ("fsdp", 1, "f_fsdp1_resume", "", ["c_f_fsdp_tp4"]),
    # A factored run resumes a block checkpoint, a block run a factored one.
    ("fsdp", 2, "f_switch", "", ["c_b_fsdp2"]),
    ("fsdp", 2, "b_switch", "", ["c_f_fsdp2"]),
]
SWITCHES = {"f_switch": "c_b_fsdp2", "b_switch": "c_f_fsdp2"}


def target(tag: str) -> str:
    """The reference tag whose uninterrupted run a job's resumes must equal."""
    return tag.split("_resume")[0]


# (source checkpoint, target tag) of every resume that keeps its second moment.
PAIRS = [(src, target(tag)) for _, _, tag, _, loads in RUNS for src in loads if tag not in SWITCHES]

# Its own launches, not agreed_runs's: a launch that runs two jobs of the same multi-dim mesh layout
# (agreed's fsdp_tp4 and this fsdp_tp4, its pp2 and this pp2) fails in the second one's first collective:
# torch 2.13's DeviceMesh resolves the new submesh to the first job's root mesh, whose groups the first
# job's end destroyed ("Could not resolve the process group registered under the name 3").
PLAN = [
    (1, ["f_fsdp1"]),
    (2, ["f_fsdp2", "b_fsdp2", "f_fsdp2_offload", "f_tp2", "f_pp2"]),
    (3, ["f_fsdp3"]),
    (4, ["f_fsdp_tp4", "f_hsdp4"]),
    (2, ["f_fsdp2_resume", "f_switch", "b_switch"]),
    (1, ["f_fsdp1_resume"]),
]


def job(layout: str, tag: str, out: Path, *args: str) -> list[str]:
    return run_job(WORKER, layout, tag, out, S, K, *args)


def plan(base: Path) -> list[Launch]:
    """Every job of PLAN, as launches (``worker_jobs.launch_all``); the folders are made here."""
    out = base / "out"
    out.mkdir(parents=True)
    return ordered_launches(PLAN, jobs(base, out), RUNS, {})


def jobs(base: Path, out: Path) -> dict[str, tuple[int, list[str]]]:
    """tag -> (world size, job) of every run here, writing into ``out``, checkpoints under ``base``."""
    table = {}
    for layout, n, tag, ref, loads in RUNS:
        args = ["--second-moment", "factored" if tag.startswith("f_") else "block"]
        if ref:
            args += ["--ref", str(base / ref)]
        if loads:
            args += ["--load", ",".join(str(base / c) for c in loads)]
        table[tag] = (n, job(layout, tag, out, *args))
    return table


# Mixture of experts (``moe_worker``, Gefen alone with the factored moment: a grouped experts' weight
# (E, out, in) is E matrices): (layout, nproc, tag, ref base, loads, experts), as ``moe_runs``.
MOE_RUNS = [
    ("ep", 2, "fm_ep2_e4", "c_fm_ep2_e4", [], 4),  # EP 2: whole experts
    ("fsdp", 2, "fm_fsdp2_e4", "c_fm_fsdp2_e4", ["c_fm_ep2_e4"], 4),  # EP 1 x FSDP 2 <- EP 2
    ("ep", 4, "fm_ep2x2_e2", "c_fm_ep2x2_e2", [], 2),  # EP 2 x efsdp 2: the experts' rows cut (Shard(1))
    ("one", 1, "fm_one_e4", "c_fm_one_e4", ["c_fm_ep2_e4"], 4),  # 1 rank <- EP 2
    ("one", 1, "fm_one_e2", "c_fm_one_e2", ["c_fm_ep2x2_e2"], 2),  # 1 rank <- EP 2 x efsdp 2
]
# moe_runs.PLAN's launch (its index) -> the MoE jobs here that run in it.
MOE_PHASES = {0: ["fm_ep2_e4", "fm_fsdp2_e4"], 1: ["fm_ep2x2_e2"], 3: ["fm_one_e4", "fm_one_e2"]}
MOE_PAIRS = [(src, tag) for _, _, tag, _, loads, _ in MOE_RUNS for src in loads]


def moe_jobs(base: Path, out: Path) -> dict[str, tuple[int, list[str]]]:
    """tag -> (world size, job) of every MoE run here, writing into ``out``, checkpoints under ``base``."""
    table = {}
    for layout, n, tag, ref, loads, e in MOE_RUNS:
        args = ["moe", "--layout", layout, "--experts", str(e), "--tag", tag, "--out", str(out),
                "--save-step", str(S), "--steps", str(K), "--second-moment", "factored"]
        if ref:
            args += ["--ref", str(base / ref)]
        if loads:
            args += ["--load", ",".join(str(base / c) for c in loads)]
        table[tag] = (n, args)
    return table
