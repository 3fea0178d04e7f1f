"""Unit tests for the torchtitan 0.3.0 CPU/gloo patches (``patches`` package).

Fast, CPU-only. Most tests run in-process against a 1-rank gloo group; one test
spawns 2 gloo ranks to check the collective-level effects (PREMUL_SUM fallback
in a real FSDP2 backward, shard-consistent random init, the timeout barrier).
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import gefen_titan.patches as P
from tests.helpers import processes

PKG = P.__name__  # "patches" or "gefen_titan.patches"


@pytest.fixture(scope="module", autouse=True)
def applied():
    return P.apply_all()


@pytest.fixture(scope="module")
def gloo_world(tmp_path_factory):
    """A 1-rank gloo default group (tests need a real ProcessGroupGloo)."""
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------- apply_all
def test_importing_the_package_patches_nothing():
    """``import gefen_titan`` (and its optimizer container and checkpoint
    manager) leaves torch and torchtitan as they are; only ``apply_all()``
    or the training entry point patches."""
    code = textwrap.dedent("""
        import torch
        import torch.distributed as dist
        import torchtitan.tools.utils as tu
        from torchtitan.hf_datasets import text_datasets
        before = (tu.device_type, getattr(dist, "set_timeout", None))
        import gefen_titan
        from gefen_titan import GefenCheckpointManager, GefenOptimizersContainer, patches
        import gefen_titan.train, gefen_titan.recipe.build, gefen_titan.validation.command
        import gefen_titan.optim.checkpointing
        assert patches.applied() == {}, patches.applied()
        assert (tu.device_type, getattr(dist, "set_timeout", None)) == before
        assert "gefen_tiny" not in text_datasets.DATASETS
        patches.apply_all()
        # Installed on a torch without it (2.13); torch's own from 2.14 on.
        needed = "dist_set_timeout" in patches.needed_on(torch.__version__)
        assert patches.applied()["dist_set_timeout"] is needed and dist.set_timeout is not None
        print("ok")
    """)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr




def test_apply_all_reports_every_patch(applied):
    assert set(applied) == {p.NAME for p in P.PATCHES}
    # This machine has no accelerator: every patch is needed and active, less
    # those whose fix this torch ships (UPSTREAM_FROM_TORCH): there the patch
    # finds torch's own API and installs nothing. Exactly that split, per
    # supported torch: a release that gains or loses an upstream fix fails here.
    needed = P.needed_on(torch.__version__)
    assert {name for name, active in applied.items() if active} == needed, applied
    for p in P.PATCHES:
        assert p.is_applied() is (p.NAME in needed), p.NAME


def test_needed_on_follows_the_upstream_table():
    everything = {p.NAME for p in P.PATCHES}
    assert P.needed_on("2.13.0+cpu") == everything
    assert P.needed_on("2.14.1+cu130") == everything - {"dist_set_timeout", "pp_presplit_step"}
    assert set(P.UPSTREAM_FROM_TORCH) <= everything


def test_apply_all_is_idempotent():
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.fsdp as tt_fsdp
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tu
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll
    from torch.distributed.tensor import DTensor

    def snapshot():
        h = DTensor._op_dispatcher._custom_op_handlers
        return (
            tu.device_type,
            tu.device_module,
            tu.get_device_info,
            metrics.build_device_memory_monitor,
            dist_utils.set_pg_timeouts,
            dist_utils.init_distributed,
            tt_fsdp.CPUOffloadPolicy,
            dist.set_timeout,
            coll._get_gradient_divide_factors,
            h[torch.ops.aten.normal_.default],
            h[torch.ops.aten.uniform_.default],
        )

    before = snapshot()
    first = P.apply_all()
    second = P.apply_all()
    assert first == second
    assert snapshot() == before
    # Applying the individual patches again must not wrap a wrapper.
    needed = P.needed_on(torch.__version__)
    for p in P.PATCHES:
        assert p.apply() is (p.NAME in needed), p.NAME
    assert snapshot() == before
    assert not P._util.is_marked(dist_utils.set_pg_timeouts.__wrapped_original__)
    assert not P._util.is_marked(coll._get_gradient_divide_factors.__wrapped_original__)


def test_apply_all_rejects_unknown_exclude():
    with pytest.raises(ValueError, match="unknown patch"):
        P.apply_all(exclude=["no_such_patch"])


# ----------------------------------------------------------------- version guard


def test_versions_installed_are_the_pinned_ones():
    P.check_versions()  # does not raise here


@pytest.mark.parametrize("version", ["0.2.2", "0.3.1", "0.4.0.dev0"])
def test_version_guard_rejects_other_torchtitan(monkeypatch, version):
    monkeypatch.setattr(P, "_torchtitan_version", lambda: version)
    with pytest.raises(RuntimeError) as e:
        P.apply_all()
    msg = str(e.value)
    assert f"torchtitan {version}" in msg and "0.3.0" in msg


@pytest.mark.parametrize("version", ["2.12.1", "2.15.0", "2.15.0+cu130", "3.13.0"])
def test_version_guard_rejects_other_torch(monkeypatch, version):
    monkeypatch.setattr(P, "_torch_version", lambda: version)
    with pytest.raises(RuntimeError) as e:
        P.apply_all()
    msg = str(e.value)
    assert f"torch {version} (expected 2.13.x or 2.14.x)" in msg
    assert "`pip install 'torch>=2.13,<2.15'`" in msg, msg  # the command that fixes it


def test_version_guard_accepts_torch_patch_releases(monkeypatch):
    for v in ("2.13.0", "2.13.0+cpu", "2.13.2+cu128", "2.14.0", "2.14.1+cu130"):
        monkeypatch.setattr(P, "_torch_version", lambda v=v: v)
        P.check_versions()


# ------------------------------------------------------------------- cpu_device


def test_cpu_device_resolves_to_cpu(monkeypatch):
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tu

    assert torch._utils._get_available_device_type() is None  # CPU-only machine
    assert (tu.device_type, tu.device_module) == ("cpu", torch.cpu)
    assert tu.get_device_info() == ("cpu", torch.cpu)
    # Modules that copied the names at import time were rebound too.
    for mod in (dist_utils, metrics):
        assert (mod.device_type, mod.device_module) == ("cpu", torch.cpu)
    assert parallel_dims.device_type == "cpu"
    # torchtitan picks the PG backend from device_type's default backend: gloo.
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert tu.get_local_device().type == "cpu"


def test_cpu_device_defers_when_an_accelerator_exists(monkeypatch):
    import torchtitan.tools.utils as tu

    monkeypatch.setattr(torch._utils, "_get_available_device_type", lambda: "cuda")
    monkeypatch.setattr(tu, "_get_available_device_type", lambda: "cuda")
    assert tu.get_device_info() == ("cuda", torch.cuda)


def test_cpu_device_is_noop_on_an_accelerator_machine():
    """Fresh interpreter that pretends CUDA exists before torchtitan is imported:
    the device-dependent patches must leave torchtitan's choices alone."""
    code = textwrap.dedent(
        f"""
        import torch, torch._utils
        torch._utils._get_available_device_type = lambda: "cuda"
        import {PKG} as P
        res = P.apply_all()
        import torchtitan.tools.utils as tu
        from torch.distributed.tensor import DTensor
        h = DTensor._op_dispatcher._custom_op_handlers
        assert res["cpu_device"] is False and res["cpu_dtensor_rng"] is False, res
        assert tu.device_type == "cuda" and tu.device_module is torch.cuda
        assert torch.ops.aten.normal_.default not in h
        print("OK", sorted(res.items()))
        """
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK" in out.stdout


# ------------------------------------------------------------ cpu_memory_monitor


def test_cpu_memory_monitor_reports_rss():
    import torchtitan.components.metrics as metrics

    mon = metrics.build_device_memory_monitor()
    assert isinstance(mon, metrics.DeviceMemoryMonitor)
    assert mon.device_name == "CPU" and mon.device_capacity > 0
    stats = mon.get_peak_stats()
    assert isinstance(stats, metrics.DeviceMemStats)
    assert 0 < stats.max_reserved_gib < mon.device_capacity_gib
    assert stats.num_alloc_retries == 0 and stats.num_ooms == 0
    mon.reset_peak_stats()


def test_cpu_memory_monitor_defers_off_cpu(monkeypatch):
    import torchtitan.components.metrics as metrics
    import torchtitan.tools.utils as tu

    built = []

    class FakeMonitor:
        def __init__(self, device):
            built.append(device)
            self.device_name, self.device_capacity_gib = "FakeGPU", 1.0

    monkeypatch.setattr(tu, "device_type", "cuda")
    monkeypatch.setattr(metrics, "device_type", "cuda")
    monkeypatch.setattr(metrics, "DeviceMemoryMonitor", FakeMonitor)
    mon = metrics.build_device_memory_monitor()
    assert isinstance(mon, FakeMonitor) and built == ["cuda"]


# ------------------------------------------------- dist_set_timeout / gloo_barrier


def test_set_timeout_exists_and_works_on_gloo(gloo_world):
    assert hasattr(dist, "set_timeout")
    dist.set_timeout(datetime.timedelta(seconds=123))
    dist.set_timeout(datetime.timedelta(seconds=124), gloo_world)


def _fake_parallel_dims(meshes=None):
    return SimpleNamespace(get_all_one_dimensional_meshes=lambda: dict(meshes or {}))


def test_set_pg_timeouts_works_on_gloo(gloo_world):
    import torchtitan.distributed.utils as dist_utils

    dist_utils.set_pg_timeouts(datetime.timedelta(seconds=100), _fake_parallel_dims())
    # ...while the upstream version fails exactly as measured.
    with pytest.raises(TypeError, match="incompatible function arguments"):
        dist_utils.set_pg_timeouts.__wrapped_original__(
            datetime.timedelta(seconds=100), _fake_parallel_dims()
        )


def test_set_pg_timeouts_runs_upstream_code_off_cpu(monkeypatch):
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tu

    calls = []
    monkeypatch.setattr(tu, "device_type", "cuda")
    monkeypatch.setattr(
        dist_utils,
        "device_module",
        SimpleNamespace(current_device=lambda: 3, synchronize=lambda: None),
    )
    monkeypatch.setattr(dist, "barrier", lambda **kw: calls.append(("barrier", kw)))
    monkeypatch.setattr(dist, "set_timeout", lambda t, g: calls.append(("timeout", g)))
    dist_utils.set_pg_timeouts(datetime.timedelta(seconds=5), _fake_parallel_dims())
    assert calls == [("barrier", {"device_ids": [3]}), ("timeout", None)]


# ------------------------------------------------------------------- cpu_offload


def test_cpu_offload_starts_gloo_where_upstream_names_cpu_twice(tmp_path):
    """``--training.enable_cpu_offload`` on a CPU host: upstream asks for "cpu:gloo,cpu:gloo" and fails.

    Run in ``tmp_path``: ``init_distributed`` with no ``base_folder`` makes
    the flight recorder's ``comm_traces/`` in the current directory, which
    would otherwise be the checkout."""
    code = textwrap.dedent(f"""
        import os
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str({processes.free_port()}))
        import torch.distributed as dist
        import {PKG} as P
        P.apply_all()
        import torchtitan.distributed.utils as dist_utils
        from torchtitan.config import CommConfig
        try:
            dist_utils.init_distributed.__wrapped_original__(CommConfig(), enable_cpu_backend=True)
            print("upstream started")
        except ValueError as e:
            print("upstream:", e)
        assert dist_utils.init_distributed(CommConfig(), enable_cpu_backend=True) == 1
        print("patched:", dist.get_backend())
        dist.destroy_process_group()
    """)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "comm_traces").is_dir()  # where it went instead of the checkout
    assert "upstream: Duplicate device type cpu" in proc.stdout and "patched: gloo" in proc.stdout, proc.stdout


def test_cpu_offload_policy_pins_only_off_cpu(monkeypatch):
    import torchtitan.distributed.fsdp as tt_fsdp
    import torchtitan.tools.utils as tu
    from torch.distributed.fsdp import CPUOffloadPolicy

    policy = tt_fsdp.CPUOffloadPolicy()
    assert isinstance(policy, CPUOffloadPolicy) and policy.pin_memory is False
    monkeypatch.setattr(tu, "device_type", "cuda")
    assert tt_fsdp.CPUOffloadPolicy().pin_memory is True  # upstream's default on an accelerator


# ---------------------------------------------------------------- gloo_reduce_op


def test_gloo_gets_sum_instead_of_premul_sum(gloo_world):
    from torch.distributed import ReduceOp
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll

    patched = coll._get_gradient_divide_factors
    original = patched.__wrapped_original__
    # torchtitan's set_gradient_divide_factor(1.0) with a 2-way shard group:
    # upstream picks PREMUL_SUM, which gloo rejects.
    up = original(gloo_world, None, torch.float32, "cpu", 2.0, False)
    assert up[2] != ReduceOp.SUM
    pre, post, rs_op, ar_op = patched(gloo_world, None, torch.float32, "cpu", 2.0, False)
    assert (pre, post, rs_op, ar_op) == (None, 2.0, ReduceOp.SUM, ReduceOp.SUM)
    # factor=None (FSDP default) would be AVG upstream; gloo gets SUM + divide.
    assert patched(gloo_world, None, torch.float32, "cpu", None, False)[2] == ReduceOp.SUM


def test_non_gloo_groups_keep_upstream_reduce_ops():
    from torch.distributed import ReduceOp
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll

    class NotGloo:  # stands in for an NCCL group
        def size(self):
            return 2

        def _get_backend(self, device):
            return object()

    got = coll._get_gradient_divide_factors(NotGloo(), None, torch.float32, "cuda", 4.0, False)
    assert got[:2] == (None, None) and got[2] != ReduceOp.SUM  # PREMUL_SUM kept
    got = coll._get_gradient_divide_factors(NotGloo(), None, torch.float32, "cuda", None, False)
    assert got[2] == ReduceOp.AVG


# -------------------------------------------------------------- cpu_dtensor_rng


def test_dtensor_rng_handlers_installed():
    from torch.distributed.tensor import DTensor

    h = DTensor._op_dispatcher._custom_op_handlers
    for op in (torch.ops.aten.normal_.default, torch.ops.aten.uniform_.default):
        assert P._util.is_marked(h[op])


# ------------------------------------------------------------ patch-target checks


def test_patches_fail_loudly_when_targets_change(monkeypatch):
    import torchtitan.distributed.utils as dist_utils
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll

    monkeypatch.setattr(dist_utils, "set_pg_timeouts", lambda timeout, mesh, extra: None)
    with pytest.raises(P.PatchTargetChanged, match="set_pg_timeouts"):
        P.gloo_barrier.apply()
    monkeypatch.setattr(coll, "_get_gradient_divide_factors", lambda group, dtype: None)
    with pytest.raises(P.PatchTargetChanged, match="_get_gradient_divide_factors"):
        P.gloo_reduce_op.apply()
    import torchtitan.components.metrics as metrics

    monkeypatch.delattr(metrics, "build_device_memory_monitor")
    with pytest.raises(P.PatchTargetChanged, match="build_device_memory_monitor"):
        P.cpu_memory_monitor.apply()
    monkeypatch.setattr(dist_utils, "init_distributed", lambda config, backend, folder: None)
    with pytest.raises(P.PatchTargetChanged, match="init_distributed"):
        P.cpu_offload.apply()


# ---------------------------------------------------------------- sdpa override


def test_sdpa_override_swaps_flex_on_cpu():
    import importlib

    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    sdpa = importlib.import_module(f"{PKG}.sdpa_attention")
    cfg = llama3_debugmodel()
    lines = apply_overrides(
        OverrideConfig(imports=[f"{PKG}.sdpa_attention.sdpa_attention"]), cfg
    )
    assert len(lines) == 6  # debugmodel has 6 layers
    assert not list(cfg.model_spec.model.traverse(FlexAttention.Config))
    assert len(list(cfg.model_spec.model.traverse(ScaledDotProductAttention.Config))) == 6
    # Python helper form.
    spec = model_registry("debugmodel")
    assert sdpa.use_sdpa_attention(spec) == 6
    assert sdpa.use_sdpa_attention(spec) == 0


# ----------------------------------------------------- 2 gloo ranks, end to end


def _two_rank_worker(rank: int, world_size: int, store: str, out_dir: str) -> None:
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    P.apply_all()
    import torchtitan.distributed.utils as dist_utils

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))

        # cpu_dtensor_rng: sharded init == single-process draw (uneven rows too).
        torch.manual_seed(1234)
        w = distribute_tensor(torch.zeros(7, 5), mesh, [Shard(0)])
        nn.init.trunc_normal_(w, std=0.02)
        e = distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)])
        nn.init.normal_(e)
        torch.manual_seed(1234)
        ref_w = nn.init.trunc_normal_(torch.zeros(7, 5), std=0.02)
        ref_e = nn.init.normal_(torch.zeros(6, 4))
        assert torch.equal(w.full_tensor(), ref_w)
        assert torch.equal(e.full_tensor(), ref_e)

        # gloo_reduce_op: FSDP2 backward with torchtitan's divide factor 1.0.
        torch.manual_seed(0)
        ref = nn.Linear(8, 4, bias=False)
        model = nn.Linear(8, 4, bias=False)
        model.load_state_dict(ref.state_dict())
        fully_shard(model, mesh=mesh)
        model.set_gradient_divide_factor(1.0)
        xs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
        model(xs[rank]).pow(2).sum().backward()
        for x in xs:  # expected: SUM over ranks of per-rank grads
            ref(x).pow(2).sum().backward()
        torch.testing.assert_close(model.weight.grad.full_tensor(), ref.weight.grad)

        # gloo_barrier + dist_set_timeout: torchtitan's post-step-1 call.
        dist_utils.set_pg_timeouts(
            datetime.timedelta(seconds=60),
            SimpleNamespace(get_all_one_dimensional_meshes=lambda: {"fsdp": mesh}),
        )
        open(os.path.join(out_dir, f"ok{rank}"), "w").close()
        dist.barrier()  # nobody tears gloo down while a peer still talks to it
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_end_to_end(tmp_path):
    processes.spawn(_two_rank_worker, (2, str(tmp_path / "store"), str(tmp_path)), 2, timeout=300)
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()


# ------------------------------------------------- sdpa override under TP


def test_sdpa_override_keeps_the_tp_local_map():
    """The trainer sets sharding configs (update_from_config) before overrides
    run; the SDPA config must keep the inner attention's local_map, or TP runs
    hand head-sharded DTensors to SDPA ("... does not have a sharding strategy
    registered")."""
    import importlib

    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    sdpa = importlib.import_module(f"{PKG}.sdpa_attention")
    cfg = llama3_debugmodel()
    cfg.parallelism.tensor_parallel_degree = 2
    cfg.model_spec.model.update_from_config(config=cfg)
    before = [layer.attention.inner_attention.sharding_config for layer in cfg.model_spec.model.layers]
    assert all(sc is not None and sc.local_map is not None for sc in before)
    apply_overrides(OverrideConfig(imports=[f"{PKG}.sdpa_attention.sdpa_attention"]), cfg)
    after = [layer.attention.inner_attention for layer in cfg.model_spec.model.layers]
    assert all(type(a) is ScaledDotProductAttention.Config for a in after)
    assert [a.sharding_config for a in after] == before
    # Python helper form: the same carry-over.
    cfg = llama3_debugmodel()
    cfg.model_spec.model.update_from_config(config=cfg)
    flex = [layer.attention.inner_attention for layer in cfg.model_spec.model.layers]
    assert all(type(f) is FlexAttention.Config for f in flex)
    assert sdpa.use_sdpa_attention(cfg.model_spec) == len(flex)
    assert [layer.attention.inner_attention.sharding_config for layer in cfg.model_spec.model.layers] == [
        f.sharding_config for f in flex
    ]


# ------------------------------------------------------- cpu_grouped_mm override


def test_cpu_grouped_mm_override_swaps_exactly_the_grouped_experts_on_cpu():
    import importlib

    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    gmm = importlib.import_module(f"{PKG}.cpu_grouped_mm")
    cfg = qwen3_moe_debug()
    before = [c for _, c, _, _ in cfg.model_spec.model.traverse(GroupedExperts.Config)]
    assert len(before) == 8 and all(type(c) is GroupedExperts.Config for c in before)
    apply_overrides(OverrideConfig(imports=[f"{PKG}.cpu_grouped_mm.cpu_grouped_mm"]), cfg)
    after = [c for _, c, _, _ in cfg.model_spec.model.traverse(GroupedExperts.Config)]
    assert all(type(c) is gmm.CpuGroupedExperts.Config for c in after)
    for a, b in zip(after, before, strict=True):  # every field carried over (sizes, init, sharding)
        fields = [f for f in b.__dataclass_fields__ if f != "_owner"]  # the class the config builds
        assert {f: getattr(a, f) for f in fields} == {f: getattr(b, f) for f in fields}
    # Python helper form; subclasses (already swapped) are left alone.
    assert gmm.use_cpu_grouped_mm(cfg.model_spec) == 0
    assert gmm.use_cpu_grouped_mm(qwen3_moe_debug().model_spec) == 8


def test_cpu_grouped_mm_keeps_torchtitans_kernel_where_there_is_an_accelerator(monkeypatch):
    import importlib

    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    gmm = importlib.import_module(f"{PKG}.cpu_grouped_mm")
    monkeypatch.setattr(gmm, "_no_accelerator", lambda: False)
    spec = qwen3_moe_debug().model_spec
    (_, experts, _, _), *_ = spec.model.traverse(gmm.GroupedExperts.Config)
    assert gmm.cpu_grouped_mm(experts) is experts
    assert gmm.use_cpu_grouped_mm(spec) == 0
    assert type(gmm.cpu_grouped_mm(experts, cpu_only=False)) is gmm.CpuGroupedExperts.Config


def test_cpu_grouped_mm_is_torchtitans_math_through_the_fp32_kernel(monkeypatch):
    """The same bf16 operands and bf16 result as torchtitan's experts, the
    sums in another order: measured 0.008% of outputs one bf16 ulp apart."""
    import importlib

    from torchtitan.models.common.moe import GroupedExperts

    gmm = importlib.import_module(f"{PKG}.cpu_grouped_mm")
    config = GroupedExperts.Config(dim=64, hidden_dim=96, num_experts=4)
    theirs, ours = config.build(), gmm.derive(config, gmm.CpuGroupedExperts.Config).build()
    assert type(ours) is gmm.CpuGroupedExperts
    torch.manual_seed(0)
    for name, p in theirs.named_parameters():
        torch.nn.init.normal_(p, std=0.05)
        getattr(ours, name).data.copy_(p.data)
    counts = torch.tensor([5, 0, 11, 16])  # an expert without tokens too
    x = torch.randn(int(counts.sum()), 64)
    kernels = []
    real = torch._grouped_mm

    def recording(a, b, *args, **kw):
        kernels.append(a.dtype)
        return real(a, b, *args, **kw)

    monkeypatch.setattr(torch, "_grouped_mm", recording)
    results = []
    for module in (theirs, ours):
        xi = x.clone().requires_grad_()
        out = module(xi, counts)
        out.square().sum().backward()
        results.append((out, xi.grad, [p.grad for p in module.parameters()]))
    assert kernels[:3] == [torch.bfloat16] * 3 and kernels[3:] == [torch.float32] * 3
    (out_t, gx_t, gw_t), (out_o, gx_o, gw_o) = results
    assert out_o.dtype == out_t.dtype == torch.float32
    # bf16 results: equal but where an fp32 sum rounded the other way (one bf16 ulp, 2**-8 relative)
    assert (out_o == out_t).float().mean() > 0.99
    torch.testing.assert_close(out_o, out_t, rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(gx_o, gx_t, rtol=2**-6, atol=1e-4)
    for a, b in zip(gw_o, gw_t, strict=True):
        torch.testing.assert_close(a, b, rtol=2**-6, atol=1e-4)


# -------------------------------------------------------- pp_presplit_step


class _FakeSchedule:
    """Just what PipelineScheduleSingle.step touches, with a recording
    _step_microbatches."""

    _has_backward = False
    _n_microbatches = 2
    _args_chunk_spec = None
    _kwargs_chunk_spec = None

    def __init__(self):
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        self._stage = SimpleNamespace(has_backward=None, is_last=False,
                                      clear_runtime_states=lambda: None)
        self._split = PipelineScheduleSingle._split_inputs.__get__(self)
        self.calls = []
        # torch >= 2.14: its own step() sorts whole-batch and pre-split inputs here.
        for name in ("_get_microbatch_inputs", "_check_inputs"):
            if hasattr(PipelineScheduleSingle, name):
                setattr(self, name, getattr(PipelineScheduleSingle, name).__get__(self))

    def _split_inputs(self, args, kwargs=None):
        return self._split(args, kwargs)

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None,
                           losses=None, return_outputs=True, loss_kwargs=None):
        self.calls.append((arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs))


def test_pp_step_takes_presplit_microbatches():
    """torchtitan 0.3.0's pre-split call reaches ``_step_microbatches`` with its
    own lists: through the patch on torch 2.13, through torch's own ``step``
    from 2.14 on (UPSTREAM_FROM_TORCH), which the patch then leaves alone."""
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
    )

    patched = "pp_presplit_step" in P.needed_on(torch.__version__)
    for cls in (PipelineScheduleSingle, PipelineScheduleMulti):
        assert P._util.is_marked(cls.__dict__["step"]) is patched, cls
    assert P.pp_presplit_step.apply() is patched  # idempotent
    if patched:
        assert not P._util.is_marked(PipelineScheduleSingle.step.__wrapped_original__)

    step = PipelineScheduleSingle.step
    fake = _FakeSchedule()
    x0, x1 = torch.zeros(2, 3), torch.ones(2, 3)
    losses = []
    step(fake, arg_mbs=[(x0,), (x1,)], kwarg_mbs=[{}, {}], target_mbs=["t0", "t1"],
         losses=losses, loss_kwargs={"global_valid_tokens": 7}, return_outputs=False)
    ((args, kwargs, targets, got_losses, ret, lkw),) = fake.calls
    assert args[0][0] is x0 and args[1][0] is x1  # passed through, not re-split
    assert kwargs == [{}, {}] and targets == ["t0", "t1"] and got_losses is losses
    assert ret is False and lkw == {"global_valid_tokens": 7}
    assert "_step_microbatches" not in vars(fake)  # the per-call swap is undone
    assert fake._stage.has_backward is False

    # Middle stages pass no arg_mbs; whole-batch calls are upstream's split.
    step(fake, kwarg_mbs=[{}, {}])
    # The patch leaves them None for _step_microbatches' own _check_inputs;
    # torch's step runs that check first: one empty tuple per microbatch.
    assert fake.calls[-1][0] == (None if patched else [(), ()])
    step(fake, torch.arange(8.0).view(4, 2))
    assert [a[0].shape for a in fake.calls[-1][0]] == [(2, 2), (2, 2)]
    mixed = "cannot be mixed" if patched else "pre-split"  # the patch's message, torch's
    with pytest.raises(ValueError, match=mixed):
        step(fake, x0, arg_mbs=[(x0,), (x1,)])
    with pytest.raises(ValueError, match=mixed):
        step(fake, arg_mbs=[(x0,), (x1,)], target=x0)


# ------------------------------------------------ pp_split_backward_unshard


class _LastStage(torch.nn.Module):
    """A last pipeline stage as torchtitan builds it: a layer, the final norm
    and ``lm_head``, with ``lm_head`` run by the loss (``_skip_lm_head``)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(8, 8)
        self.norm = torch.nn.RMSNorm(8)
        self.lm_head = torch.nn.Linear(8, 16, bias=False)

    def forward(self, h):
        return self.norm(self.w(h))


def _split_backward_grads(schedule_cls) -> dict[str, torch.Tensor | None]:
    """The last stage's gradients (None where missing) after one step of a
    2-stage schedule on this rank, minus those of plain autograd on copies of
    the modules. torchtitan's wrapping: FSDP2 everywhere (a 1-rank mesh here,
    as at data_parallel_shard_degree 1), norm and lm_head in one unit, and its
    ChunkedLossWrapper, which reshards that unit after each microbatch's loss."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torchtitan.components.loss import ChunkedLossWrapper

    def chunked_loss(last):
        loss = ChunkedLossWrapper(ChunkedLossWrapper.Config(num_chunks=2))
        loss.set_lm_head(last.lm_head)
        return lambda out, target: loss(out, target)[0]

    torch.manual_seed(0)
    first, last = torch.nn.Linear(8, 8), _LastStage()
    ref_first, ref_last = copy.deepcopy(first), copy.deepcopy(last)
    mesh = init_device_mesh("cpu", (1,))
    fully_shard([last.norm, last.lm_head], mesh=mesh, reshard_after_forward=False)
    fully_shard(last, mesh=mesh, reshard_after_forward=False)
    fully_shard(first, mesh=mesh, reshard_after_forward=False)
    cpu = torch.device("cpu")
    stages = [PipelineStage(first, 0, 2, cpu), PipelineStage(last, 1, 2, cpu)]
    schedule = schedule_cls(stages, n_microbatches=2, loss_fn=chunked_loss(last), scale_grads=False)
    x, target = torch.randn(2, 4, 8), torch.randint(0, 16, (2, 4))
    schedule.step(x, target=target)

    ref_loss = chunked_loss(ref_last)
    for mb in range(2):  # the schedule sums the microbatches' gradients (scale_grads=False)
        ref_loss(ref_last(ref_first(x[mb:mb + 1])), target[mb:mb + 1]).backward()
    ref = dict(ref_last.named_parameters())
    return {name: None if p.grad is None else p.grad.full_tensor() - ref[name].grad
            for name, p in last.named_parameters()}


@pytest.mark.parametrize("schedule", ["ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble"])
def test_zero_bubble_schedules_compute_every_gradient(gloo_world, schedule):
    """Upstream's split backward (torch 2.13) leaves the gradient of a
    parameter whose FSDP unit is resharded at its input step at None (here
    norm.weight, as torchtitan's chunked loss leaves it); with the patch every
    gradient equals plain autograd's. The upstream half failing means torch
    fixed it: drop the patch."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import _PipelineStageBase

    cls = getattr(schedules, schedule)
    names = ("backward_one_chunk", "backward_weight_one_chunk")
    live = {n: _PipelineStageBase.__dict__[n] for n in names}
    try:
        for name, fn in live.items():
            setattr(_PipelineStageBase, name, getattr(fn, "__wrapped_original__", fn))
        upstream = _split_backward_grads(cls)
    finally:
        for name, fn in live.items():
            setattr(_PipelineStageBase, name, fn)
    assert [n for n, d in upstream.items() if d is None] == ["norm.weight"]

    diffs = _split_backward_grads(cls)
    assert [n for n, d in diffs.items() if d is None] == []
    for name, d in diffs.items():
        assert d.abs().max() <= 1e-6, name  # lm_head's chunked sums round once apart (2.4e-7)
    assert P.pp_split_backward_unshard.is_applied()
    assert P.pp_split_backward_unshard.apply() is True  # idempotent
