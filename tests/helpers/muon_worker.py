"""One rank of the GefenMuon runs (tests.helpers.muon_runs).

``agreed_worker``'s small model, layouts (fsdp, fsdp_tp, tp, hsdp, pp) and
fixed global gradients, trained with GefenMuon (NorMuon on) for the hidden
matrices (``layers.N.w1``, ``layers.N.w2`` and the 2-row ``gate``: an empty
shard at W=3) and Gefen for the embedding, the norms and the output head,
chosen by regex param groups, through ``GefenOptimizersContainer`` and
``GefenCheckpointManager``.

A job does, in order, what its flags ask, and writes ``TAG_rRANK.pt`` into ``--out``:
  --ref BASE     steps 1..S+K, checkpoint at S into BASE; dump the state at S
                 (the checkpoint entries and the live GefenMuon state, as
                 global tensors) and the full parameters at S..S+K
  --gefen-x      (one rank) step gefen-x's own GefenMuon on plain tensors
                 beside the run, with the run's periods, codebook and lr, and
                 dump where they differ
  --load B1,..   for each checkpoint: fresh model and optimizer, load S, dump
                 the state, K more steps, dump the parameters
  --cases C1,..  for each bad checkpoint BASE[|gefen=1]: a fresh optimizer
                 (``gefen=1``: Gefen for every parameter) takes one step,
                 tries the load, and dumps the error and its live state
                 before and after
  --gefen-only   (with --ref) train Gefen for every parameter instead
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn
from gefen import GefenMuon

from gefen_titan.checkpoint.format.schema import grid_shape
from gefen_titan.distributed import like_param, like_param_rows, local
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.container import GefenOptimizersContainer, ParamGroup
from gefen_titan.optim.kinds.gefen_muon.options import MuonOptions
from tests.helpers import agreed_worker as aw  # applies gefen_titan's CPU patches
from tests.helpers import small_model as sm
from tests.helpers import worker_jobs

MUON_PATTERN = r"^layers\.\d+\.w[12]\.weight$|^gate\.weight$"
MUON_KWARGS = {"lr": 0.02, "normuon": True}
# Small enough that the step runs several buckets at every layout (the limit
# becomes twice the largest matrix, ~98 KiB), so the two live buckets, their
# exchanges' order and the carried owner loads are what the layouts compare.
MUON_BUCKET_MIB = 0.05


def groups(gefen_only: bool) -> dict:
    if gefen_only:
        return {}
    return {"param_groups": [ParamGroup(pattern=MUON_PATTERN, optimizer_name="GefenMuon",
                                        optimizer_kwargs=dict(MUON_KWARGS)),
                             ParamGroup(pattern=".*")],
            "muon": MuonOptions(bucket_mib=MUON_BUCKET_MIB)}


def schedule(opt: GefenOptimizersContainer) -> dict:
    """This rank's GefenMuon buckets ([(fqn, owner), ...] each) and its step statistics."""
    out = {"buckets": [], "stats": []}
    for optim, stats in zip(opt.optimizers_of("GefenMuon"), opt.step_stats("GefenMuon"), strict=True):
        names = [fqn for fqn, _, _ in gx.named_params(optim)]
        sched = gx.muon_sharded_step(optim).schedule
        out["buckets"] += [[(names[i], o) for i, o in zip(b.matrices, b.owners)] for b in sched.buckets]
        out["stats"].append({"peak": stats.peak_inflight_bytes, "bound": stats.bound_bytes,
                             "sent": stats.bytes_sent, "received": stats.bytes_received,
                             "ns_matrices": stats.ns_matrices, "steps": stats.steps})
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return sm.full(t)


def muon_state(opt: GefenOptimizersContainer) -> dict:
    """This rank's stage of the live GefenMuon state as global tensors (collective within the stage)."""
    out = {"periods": {}, "counters": {}, "tensors": {}}
    for optim in opt.optimizers_of("GefenMuon"):
        out["codebook"] = gx.codebook(optim).cpu().clone()
        out["global_step"] = gx.global_step(optim)
        for fqn, p, group in gx.named_params(optim):
            st = gx.muon_read(optim, p)
            shape, local_shape = tuple(p.shape), tuple(local(p).shape)
            out["periods"][fqn] = st.period
            out["counters"][fqn] = (st.step, st.rows_step, float(group["lr"]))
            out["tensors"][fqn] = {
                "codes": _full(like_param(p, st.codes.view(local_shape), shape)),
                "magnitude": _full(like_param(p, st.magnitude.view(grid_shape(local_shape, st.period)),
                                              grid_shape(shape, st.period))),
                "rows": _full(like_param_rows(p, st.rows.view(-1))),
            }
    return out


def global_state(opt: GefenOptimizersContainer) -> dict:
    """The checkpoint's entries (Gefen's and GefenMuon's) as global tensors, plus the live GefenMuon state."""
    sd = opt.state_dict()
    out = {k: (_full(v) if isinstance(v, torch.Tensor) else v) for k, v in sd.items() if k.startswith("gefen/")}
    out["muon"] = muon_state(opt) if opt.optimizers_of("GefenMuon") else None
    return out


def snapshot(opt: GefenOptimizersContainer) -> dict:
    """This rank's live optimizer state, copied (fail-closed checks)."""
    out = aw.snapshot(opt)
    for optim in opt.optimizers_of("GefenMuon"):
        out["muon_codebook"] = None if gx.codebook(optim) is None else gx.codebook(optim).clone()
        out["muon_global_step"] = gx.global_step(optim)
        for n, p, group in gx.named_params(optim):
            st = gx.muon_read(optim, p)
            out["muon:" + n] = None if st is None else (
                st.period, st.step, st.rows_step, st.codes.clone(), st.magnitude.clone(),
                None if st.rows is None else st.rows.clone(), {k: group[k] for k in gx.MUON_GROUP_KEYS})
    return out


class GefenX:
    """gefen-x's own GefenMuon on plain tensors, stepped beside the run with its periods, codebook and lr."""

    def __init__(self, opt: GefenOptimizersContainer) -> None:
        init = {n: p.detach().clone() for n, p in aw.sm.build_model(aw.SIZES).named_parameters()}
        self.run = [(optim, fqn, p, group) for optim in opt.optimizers_of("GefenMuon")
                    for fqn, p, group in gx.named_params(optim)]
        self.params = {fqn: nn.Parameter(init[fqn].clone()) for _, fqn, _, _ in self.run}
        _, _, _, group = self.run[0]
        self.optim = GefenMuon([(fqn, p) for fqn, p in self.params.items()], fused=False,
                               **{k: group[k] for k in gx.MUON_GROUP_KEYS})
        self.differ: list[str] = []

    def lr(self) -> float:
        """The lr the run's next step uses (its scheduler moves it after each step)."""
        return self.run[0][3]["lr"]

    def step(self, s: int, lr: float) -> None:
        self.optim.param_groups[0]["lr"] = lr
        for optim, fqn, p, _ in self.run:  # the run's periods and codebook, once
            if gx.period(self.optim, self.params[fqn]) is None:
                gx.set_period(self.optim, self.params[fqn], gx.period(optim, p))
        if gx.codebook(self.optim) is None:
            gx.set_codebook(self.optim, gx.codebook(self.run[0][0]).clone())
        for fqn, q in self.params.items():
            q.grad = aw.global_grad(fqn, tuple(q.shape), s)
        self.optim.step()

    def compare(self, s: int, params: dict[str, torch.Tensor], state: dict | None) -> None:
        for fqn, q in self.params.items():
            if not torch.equal(q.detach(), params[fqn]):
                self.differ.append(f"step {s} param {fqn}")
            if state is None:
                continue
            st = gx.muon_read(self.optim, q)
            mine = state["tensors"][fqn]
            for what, ref in (("codes", st.codes.view(q.shape)), ("magnitude", st.magnitude.view(q.shape[0], -1)),
                              ("rows", st.rows.view(-1))):
                if not torch.equal(ref, mine[what]):
                    self.differ.append(f"step {s} {what} {fqn}")
            if (st.step, st.rows_step) != state["counters"][fqn][:2]:
                self.differ.append(f"step {s} counters {fqn}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="fsdp")
    ap.add_argument("--ref", default="")
    ap.add_argument("--load", default="")
    ap.add_argument("--cases", default="")
    ap.add_argument("--gefen-x", action="store_true")
    ap.add_argument("--gefen-only", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", default="")
    ap.add_argument("--save-step", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--max-tp", type=int, default=2)
    return ap


def job(args, rank: int, world: int) -> None:
    S, K = args.save_step, args.steps
    results = {"ref": None, "resume": {}, "cases": {}}

    def fresh(gefen_only: bool = False):
        model, opt = aw.build(args.layout, world, args.max_tp, **groups(gefen_only))
        return model, opt, sm.schedulers(opt, S + K), sm.TrainState()

    if args.ref:
        model, opt, sched, ts = fresh(args.gefen_only)
        ckpt = sm.checkpointer(model, opt, sched, ts, args.ref, S)
        ref = GefenX(opt) if args.gefen_x else None
        res = {"params": {}}
        for s in range(1, S + K + 1):
            lr = None if ref is None else ref.lr()
            aw.step(model, opt, sched, s)
            ts.step = s
            if ref is not None:
                ref.step(s, lr)
            if s == S:
                ckpt.save(s)
                res["state"] = global_state(opt)
                res["bytes"] = opt.state_bytes()
            if s >= S:
                res["params"][s] = sm.full_params(model)
            if ref is not None:
                ref.compare(s, sm.full_params(model), muon_state(opt))
        ckpt.close()
        res["gefen_x"] = None if ref is None else ref.differ
        res["schedule"] = schedule(opt)
        results["ref"] = res
    if args.load:
        results["resume"] = sm.resumes(args.load.split(","), fresh, aw.step, S, K, global_state)
    for case in filter(None, args.cases.split(",")):
        base, *overrides = case.split("|")
        results["cases"][os.path.basename(base) + "".join(overrides)] = sm.bad_checkpoint_case(
            base, lambda: fresh(gefen_only="gefen=1" in overrides), aw.step, S, snapshot)
    torch.save(results, os.path.join(args.out, f"{args.tag or args.layout + str(world)}_r{rank}.pt"))


if __name__ == "__main__":
    sys.exit(worker_jobs.run(parser(), job))
