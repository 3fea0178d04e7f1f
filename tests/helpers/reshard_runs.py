"""The save-at-N / load-at-M runs of ``reshard_worker`` (format v1) that
``tests/integration/test_reshard*.py`` check: what runs, in which launches.

Under the plan's base folder: ``cN`` the checkpoints, ``out/refN`` and
``out/NtoM`` the dumps of the references and resumes, ``hsdp`` the HSDP
pair's, ``bad`` the fail-closed cases (``bad_checkpoints.V1_CASES``), the
AdamW checkpoint and, in ``bad/out``, the corrupt job's dumps.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from tests.helpers import bad_checkpoints as bad
from tests.helpers.worker_jobs import Launch

WORKER = "reshard"
SAVE_STEP, STEPS = 3, 2
PAIRS = [(2, 2), (2, 4), (4, 2), (2, 1), (1, 2), (3, 2)]
# The launches, in order: (world size, jobs), a job being ("ref", n) (the
# reference at n, this launch's world size), ("resume", n) (from n's
# checkpoint), n a world size or "hsdp" (HSDP 2 x 2 at 4 ranks), ("adamw", 2)
# (an AdamW run of the same model saving the checkpoint of another optimizer)
# or ("corrupt", 2) (a stepped optimizer tries every bad checkpoint, edited
# from c2 before the launch). Each world size runs its reference and the
# resumes whose source is saved by then in one launch; the resumes to 2 from
# later references, and the fail-closed job, come last.
RUN_PLAN = [
    (2, [("ref", 2), ("resume", 2), ("adamw", 2)]),
    (4, [("ref", 4), ("resume", 2), ("ref", "hsdp")]),
    (3, [("ref", 3)]),
    (1, [("ref", 1), ("resume", 2)]),
    (2, [("resume", 4), ("resume", 1), ("resume", 3), ("resume", "hsdp"), ("corrupt", 2)]),
]


def _args(mode: str, ckpt: Path, out: Path, *extra: str) -> list[str]:
    return [WORKER, "--mode", mode, "--ckpt", str(ckpt), "--out", str(out), "--save-step", str(SAVE_STEP), *extra]


def plan(base: Path) -> list[Launch]:
    """Reference runs at 1..4 ranks (4 saves async), every resume of PAIRS,
    an HSDP 2 x 2 reference at 4 ranks resumed as plain FSDP at 2 (under
    ``base / "hsdp"``) and the fail-closed jobs (under ``base / "bad"``): the
    jobs of RUN_PLAN, as launches (``worker_jobs.launch_all``)."""
    out, hsdp, root = base / "out", base / "hsdp", base / "bad"
    root.mkdir(parents=True)
    saved, resumed = set(), set()
    launches = []
    for world, jobs_plan in RUN_PLAN:
        jobs, before = [], []
        for mode, src in jobs_plan:
            ckpt = hsdp / "c" if src == "hsdp" else base / f"c{src}"
            if mode == "adamw":
                jobs.append(_args("ref", root / "adamw", root, "--optimizer", "AdamW", "--steps", "0"))
                continue
            if mode == "corrupt":
                assert src == 2 and 2 in saved, "the bad checkpoints are edited from c2"
                (root / "out").mkdir()
                before.append(partial(bad.write_v1, ckpt, root, SAVE_STEP))
                cases = [root / name for name in bad.V1_CASES]
                jobs.append(_args("corrupt", ckpt, root / "out", "--cases", ",".join(map(str, cases))))
                continue
            if mode == "ref":
                assert src == world or (src == "hsdp" and world == 4), (world, src)
                dst = hsdp / "ref" if src == "hsdp" else out / f"ref{src}"
                extra = ["--hsdp", "2"] if src == "hsdp" else ["--async-mode", "async" if src == 4 else "disabled"]
                saved.add(src)
            else:
                assert src in saved, f"RUN_PLAN resumes from {src} before its reference"
                dst = hsdp / "res" if src == "hsdp" else out / f"{src}to{world}"
                extra = []
                resumed.add((src, world))
            dst.mkdir(parents=True)
            jobs.append(_args(mode, ckpt, dst, "--steps", str(STEPS), *extra))
        launches.append(Launch(world, jobs, before))
    assert resumed == set(PAIRS) | {("hsdp", 2)}, resumed
    return launches
