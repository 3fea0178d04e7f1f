"""The GefenMuon runs of ``muon_worker`` that tests/integration/test_gefen_muon.py
checks: which jobs, in which launches (as ``agreed_runs`` does for Gefen).

Under the plan's base folder: ``c_TAG`` the checkpoints of the reference
jobs, ``out`` every job's dumps (``TAG_rRANK.pt``), ``bad`` the fail-closed
checkpoints (``bad_checkpoints.MUON_CASES`` and the Gefen-only ``c_gefen2``).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from tests.helpers import bad_checkpoints as bad
from tests.helpers.worker_jobs import Launch, ordered_launches, reshard_jobs, run_job

WORKER = "muon"
S, K = 3, 2

# (layout, nproc, tag, ref base, loads): as agreed_runs.RUNS. fsdp1 also
# steps gefen-x's own GefenMuon beside the run (--gefen-x).
RUNS = [
    ("fsdp", 2, "fsdp2", "c_fsdp2", []),
    ("fsdp_offload", 2, "fsdp2_offload", "c_fsdp2_offload", ["c_fsdp2"]),  # FSDP2's CPU offload
    ("pp", 2, "pp2", "c_pp2", []),
    ("fsdp", 4, "fsdp4", "c_fsdp4", ["c_fsdp2"]),
    ("fsdp_tp", 4, "fsdp_tp4", "c_fsdp_tp4", []),
    ("hsdp", 4, "hsdp4", "c_hsdp4", []),
    ("pp", 4, "pp4", "c_pp4", ["c_fsdp2"]),
    ("fsdp", 3, "fsdp3", "c_fsdp3", ["c_fsdp_tp4"]),
    ("fsdp", 1, "fsdp1", "c_fsdp1", ["c_fsdp2", "c_fsdp2_offload"]),
    ("fsdp", 2, "fsdp2_resume", "", ["c_fsdp2", "c_fsdp4", "c_fsdp3"]),
]


def target(tag: str) -> str:
    return tag.split("_resume")[0]


PAIRS = [(src, target(tag)) for _, _, tag, _, loads in RUNS for src in loads]

# "gefen2" saves a Gefen-only checkpoint of the same model; "bad" tries
# MUON_CASES (edited from c_fsdp2 before its launch).
PLAN = [
    (2, ["fsdp2", "fsdp2_offload", "pp2", "gefen2"]),
    (4, ["fsdp4", "fsdp_tp4", "hsdp4", "pp4"]),
    (3, ["fsdp3"]),
    (1, ["fsdp1"]),
    (2, ["fsdp2_resume", "bad"]),
]


def job(layout: str, tag: str, out: Path, *args: str) -> list[str]:
    return run_job(WORKER, layout, tag, out, S, K, *args)


def plan(base: Path) -> list[Launch]:
    """Every job of PLAN, as launches (``worker_jobs.launch_all``); the folders are made here."""
    jobs, out, root = reshard_jobs(base, job, RUNS, extra=lambda tag: ["--gefen-x"] if tag == "fsdp1" else [])
    jobs["gefen2"] = (2, job("fsdp", "gefen2", out, "--ref", str(base / "c_gefen2"), "--gefen-only", "--steps", "0"))
    cases = [bad.muon_case_path(base, root, name) for name in bad.MUON_CASES]
    jobs["bad"] = (2, job("fsdp", "bad", out, "--cases", ",".join(cases)))
    return ordered_launches(PLAN, jobs, RUNS, {"bad": partial(bad.write_muon, base, root, S)})
