"""The agreed-blocking (format v3) runs of ``agreed_worker`` that
tests/integration/test_agreed_blocking.py checks: which jobs, in which launches.

Under the plan's base folder: ``c_TAG`` the checkpoints of the reference
jobs, ``out`` every job's dumps (``TAG_rRANK.pt``), ``bad`` the fail-closed
checkpoints (``bad_checkpoints.V2_CASES``, and ``c_notp``, ``c_tampered``).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from tests.helpers import bad_checkpoints as bad
from tests.helpers.worker_jobs import Launch, ordered_launches, reshard_jobs, run_job

WORKER = "agreed"
S, K = 3, 2

# (layout, nproc, tag, ref base, loads): one worker job each. A ref job runs
# S+K steps and saves at S; then (or alone, without a ref) it loads each of
# its loads, checked against the uninterrupted run of its own layout.
RUNS = [
    ("fsdp", 2, "fsdp2", "c_fsdp2", []),
    # CPU offload: trains like FSDP 2, resumes a checkpoint saved without it; its own resumes at 1 and 2 without
    ("fsdp_offload", 2, "fsdp2_offload", "c_fsdp2_offload", ["c_fsdp2"]),
    ("tp", 2, "tp2", "c_tp2", []),
    ("fsdp", 4, "fsdp4", "c_fsdp4", ["c_fsdp2"]),
    ("fsdp", 3, "fsdp3", "c_fsdp3", ["c_fsdp2"]),
    ("fsdp", 1, "fsdp1", "c_fsdp1", ["c_fsdp2", "c_fsdp2_offload"]),
    ("fsdp_tp", 4, "fsdp_tp4", "c_fsdp_tp4", ["c_fsdp2", "c_tp2"]),
    ("hsdp", 4, "hsdp4", "c_hsdp4", []),
    ("pp", 2, "pp2", "c_pp2", []),
    ("pp", 4, "pp4", "c_pp4", ["c_fsdp2"]),
    ("fsdp", 2, "fsdp2_resume", "", ["c_fsdp2", "c_fsdp4", "c_fsdp3", "c_fsdp1", "c_fsdp_tp4", "c_hsdp4", "c_pp2",
                                     "c_fsdp2_offload"]),
    ("fsdp", 4, "fsdp4_resume", "", ["c_fsdp_tp4"]),
    ("tp", 2, "tp2_resume", "", ["c_fsdp_tp4"]),
]


def target(tag: str) -> str:
    """The reference tag whose uninterrupted run a job's resumes must equal."""
    return tag.split("_resume")[0]


# (source checkpoint, target tag) of every resume.
PAIRS = [(src, target(tag)) for _, _, tag, _, loads in RUNS for src in loads]

# The launches: the jobs of one world size share one where the order
# allows (a launch's process group, and the jobs' start-up, are paid once).
# A job's loads must be saved by an earlier launch or an earlier job of its
# own; "v1", "notp", "misfit" and "bad" are the fail-closed jobs (`plan`
# below), and the bad checkpoints "bad" tries are edited, before its launch,
# from c_fsdp2 and c_pp2.
PLAN = [
    (2, ["fsdp2", "fsdp2_offload", "tp2", "pp2", "v1", "notp", "misfit"]),
    (4, ["fsdp4", "fsdp_tp4", "hsdp4", "pp4", "fsdp4_resume"]),
    (3, ["fsdp3"]),
    (1, ["fsdp1"]),
    (2, ["tp2_resume", "fsdp2_resume", "bad"]),
]


def job(layout: str, tag: str, out: Path, *args: str) -> list[str]:
    return run_job(WORKER, layout, tag, out, S, K, *args)


def plan(base: Path) -> list[Launch]:
    """Every job of PLAN, as launches (``worker_jobs.launch_all``); the folders are made here."""
    jobs, out, root = reshard_jobs(base, job, RUNS)
    # A per-rank (format v1) checkpoint, one whose periods assume no TP (a TP
    # layout then tries it), and every bad checkpoint of V2_CASES.
    jobs["v1"] = (2, job("fsdp", "v1", out, "--ref", str(base / "c_v1"), "--blocking", "per_rank", "--steps", "0"))
    jobs["notp"] = (2, job("fsdp", "notp", out, "--ref", str(root / "c_notp"), "--max-tp", "1", "--steps", "0"))
    jobs["misfit"] = (2, job("tp", "misfit", out, "--cases", str(root / "c_notp")))
    cases = [bad.v2_case_path(base, root, name) for name in bad.V2_CASES]
    jobs["bad"] = (2, job("fsdp", "bad", out, "--cases", ",".join(cases), "--tamper-save", str(root / "c_tampered")))
    return ordered_launches(PLAN, jobs, RUNS, {"bad": partial(bad.write_v2, base, root, S)})
