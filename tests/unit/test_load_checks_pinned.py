"""Load checks that no other test held (issue 27, item 5): each test here fails when its check is removed.

One process. A small model's Gefen and GefenMuon state (format v3) is saved
once by GefenCheckpointManager (``saved``); each test loads it, or a copy
damaged or edited one way (``tests.helpers.bad_checkpoints.edited``: DCP's
own writer, so the copy has no ``.digests`` and only the record checks
stand between it and the optimizer), through a fresh manager, as a resume
does. The byte checks of ``checkpoint.io.reading`` (items no plan reads, items
without a digest) run on the saved checkpoint as it is, and the raw-entry
reads of a reshard on DTensor shards of a fake process group (every rank of
a 2- or 3-rank mesh in turn, DCP with ``no_dist``).

Checks pinned, one test (or parametrized set) each:
* the items no rank's plan reads are checked too (``check_unread``);
* an item without a row in ``.digests`` is refused;
* a codebook is refused when a middle value is out of order, NaN or inf;
* NaN or negative Gefen hyperparameters are refused (``gefen_records.check_hyper``);
* a parameter step above its optimizer's global step is refused (Gefen v3,
  GefenMuon, Gefen v1);
* GefenMuon's group keys: present, ``normuon_eps > 0``, ``ns_steps`` and
  the schedule's length below 100 (``muon_records.check_muon_hyper``);
* a raw item that a request takes only part of reads back bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from gefen_titan.checkpoint.errors import GefenCheckpointError
from gefen_titan.checkpoint.format import digests, schema
from gefen_titan.checkpoint.io import storage
from gefen_titan.checkpoint.manager import GefenCheckpointManager
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.blocking_options import BlockingOptions
from gefen_titan.optim.container import GefenOptimizersContainer, ParamGroup
from gefen_titan.optim.kinds.gefen import keys as gefen_keys
from tests.helpers.bad_checkpoints import edited
from tests.helpers.loader_checkpoint import Blob

pytestmark = pytest.mark.filterwarnings("ignore:.*single process:UserWarning")

STEP = 2
MUON = r"^w[12]\.weight$"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 64)
        self.w1 = nn.Linear(64, 48, bias=False)
        self.w2 = nn.Linear(48, 64, bias=False)
        self.norm = nn.LayerNorm(64)


def build(seed: int = 0, blocking: str = "agreed", muon: bool = True) -> tuple[Net, GefenOptimizersContainer]:
    torch.manual_seed(seed)
    net = Net()
    groups = [ParamGroup(pattern=MUON, optimizer_name="GefenMuon", optimizer_kwargs={"normuon": True})] if muon else []
    config = GefenOptimizersContainer.Config(name="Gefen", lr=3e-3, blocking=BlockingOptions(mode=blocking),
                                             param_groups=[*groups, ParamGroup(pattern=".*")])
    return net, config.build(model_parts=[net])


def manager(root: Path, net: Net, opt: GefenOptimizersContainer, **config) -> GefenCheckpointManager:
    cfg = GefenCheckpointManager.Config(enable=True, folder=str(root / "ckpt"), interval=1, keep_latest_k=0,
                                        last_save_model_only=False, **config)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*initial_load.*")
        return cfg.build(dataloader=Blob(), model_parts=[net], optimizers=opt, lr_schedulers=Blob(), states={},
                         sd_adapter=None, base_folder="")


def save(root: Path, **build_kw) -> tuple[Net, GefenOptimizersContainer]:
    """A model and its optimizer after ``STEP`` steps, saved under ``root``."""
    net, opt = build(**build_kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEP):
        for p in net.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    manager(root, net, opt).save(curr_step=STEP)
    return net, opt


def load(root: Path, build_kw: dict | None = None, **config) -> tuple[Net, GefenOptimizersContainer]:
    """A fresh model and optimizer (other initial values) resumed from ``root``, as a run's start does."""
    net, opt = build(seed=5, **(build_kw or {}))
    assert manager(root, net, opt, **config).load(step=STEP)
    return net, opt


def step_dir(root: Path) -> Path:
    return root / "ckpt" / f"step-{STEP}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint root, the model and optimizer that saved it): Gefen and GefenMuon (NorMuon) state, v3."""
    root = tmp_path_factory.mktemp("saved")
    net, opt = save(root)
    return root, net, opt


def refused(root: Path, match: str, build_kw: dict | None = None) -> GefenOptimizersContainer:
    """Load ``root`` into a fresh optimizer, which must refuse it with ``match``; the optimizer (still fresh)."""
    net, opt = build(seed=5, **(build_kw or {}))
    with pytest.raises(GefenCheckpointError, match=match):
        manager(root, net, opt).load(step=STEP)
    return opt


def entries(opt_sd: dict, kind: str) -> list[str]:
    """The optimizer's entries of a ``schema.parse_key`` kind."""
    return sorted(k for k in opt_sd if (pk := schema.parse_key(k)) is not None and pk.kind == kind)


def edit_records(kind: str, change: Callable[[dict], None]) -> Callable[[dict], None]:
    """An edit of every record of ``kind`` ("gefen": Gefen's, "muon": GefenMuon's): ``change(record dict)``."""
    def edit(opt_sd):
        for key in entries(opt_sd, kind):
            rec = json.loads(opt_sd[key])
            change(rec)
            opt_sd[key] = json.dumps(rec)
    return edit


def test_the_copies_load_when_unedited(saved, tmp_path):
    """The baseline of the refusals below: a copy written as theirs are (``edited``) but left as it was
    loads, and restores the saved state exactly (so each refusal is its edit's)."""
    root, net, opt = saved
    edited(root, tmp_path, STEP, lambda opt_sd: None)
    net2, opt2 = load(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), net2.parameters()))
    for o, o2 in zip(opt.optimizers, opt2.optimizers):
        assert torch.equal(gx.codebook(o), gx.codebook(o2)) and gx.global_step(o) == gx.global_step(o2) == STEP
        assert [g["lr"] for g in o.param_groups] == [g["lr"] for g in o2.param_groups]


# ------------------------------------------------------------------ items no rank reads
def damage_item(path: Path, entry: str) -> None:
    """Flip one byte in the middle of ``entry``'s stored item."""
    md = storage.read_metadata(path)
    (info,) = [i for idx, i in md.storage_data.items() if idx.fqn == entry]
    assert int(info.length) > 0
    file = path / info.relative_path
    data = bytearray(file.read_bytes())
    data[int(info.offset) + int(info.length) // 2] ^= 0x40
    file.write_bytes(bytes(data))


def copy_of(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_a_damaged_item_that_no_plan_reads_is_refused(saved, tmp_path):
    """Pins ``check_unread`` (``_CheckedReading.prepare_global_plan`` hands the items no plan reads to a rank,
    ``_read_and_check`` reads them): a load that leaves the LR scheduler out (``exclude_from_loading``) is
    still refused for a flipped byte of its entry, naming it; the same load of the intact checkpoint
    succeeds, and a reader without ``check_unread`` does not see the damage (it is in no plan)."""
    root, _, _ = saved
    bad = tmp_path / "bad"
    copy_of(step_dir(root), step_dir(bad))
    damage_item(step_dir(bad), "lr_scheduler.blob")
    load(root, exclude_from_loading=["lr_scheduler"])  # the intact one loads
    net, opt = build(seed=5)
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(GefenCheckpointError, match=r"entry lr_scheduler\.blob: xxh3_64 digest mismatch"):
        manager(bad, net, opt, exclude_from_loading=["lr_scheduler"]).load(step=STEP)
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))  # nothing reached the model
    assert all(gx.codebook(o) is None for o in opt.optimizers)  # nor the optimizer
    # The damage is in an item the load's plan does not read: only check_unread finds it.
    model = {k: torch.empty_like(v) for k, v in Net().state_dict().items()}
    dcp.load(model, storage_reader=storage.storage_reader(step_dir(bad)), no_dist=True)
    with pytest.raises(BaseException, match=r"entry lr_scheduler\.blob: xxh3_64 digest mismatch"):
        dcp.load(model, storage_reader=storage.storage_reader(step_dir(bad), check_unread=True), no_dist=True)


# ------------------------------------------------------------------ an item without a digest
def test_an_item_without_a_digest_is_refused(saved, tmp_path):
    """Pins ``_read_and_check``'s "no digest was recorded for this item": ``.digests`` rebuilt without the
    row of one item (its section's and index's own digests intact, as another save's file would be) makes
    the load refuse that item, by that reason, not as a digest mismatch."""
    root, _, _ = saved
    path = copy_of(step_dir(root), tmp_path / "step")
    md, record = storage.read_checked_metadata(path)
    dropped = gefen_keys.qcodes_key("embed.weight")
    items: dict[str, dict[int, tuple[int, str]]] = {}
    for index, info in md.storage_data.items():
        if index.fqn != "optimizer." + dropped and int(info.length):
            items.setdefault(info.relative_path, {})[int(info.offset)] = (
                int(info.length), record.item(info.relative_path, info.offset, info.length))
    (path / digests.FILE).write_bytes(
        digests.Digests(record.metadata_size, record.metadata_digest, items).to_bytes())
    assert storage.read_digests(path).count() == record.count() - 1
    target = {"optimizer." + dropped: torch.empty(32, 64, dtype=torch.uint8)}
    with pytest.raises(BaseException, match=re.escape(
            f"entry optimizer.{dropped}: no digest was recorded for this item")):
        dcp.load(target, storage_reader=storage.storage_reader(path), no_dist=True)
    other = {"embed.weight": torch.empty(32, 64)}  # the other items still load
    dcp.load(other, storage_reader=storage.storage_reader(path), no_dist=True)


# ------------------------------------------------------------------ codebooks
def _unsorted(cb: torch.Tensor) -> torch.Tensor:
    assert cb[100] < cb[101]
    cb[100], cb[101] = cb[101].clone(), cb[100].clone()
    return cb


def _set(value: float):
    def damage(cb: torch.Tensor) -> torch.Tensor:
        cb[128] = value
        return cb
    return damage


@pytest.mark.parametrize("kind, what", [("codebook", "codebook"), ("muon_codebook", "GefenMuon codebook")],
                         ids=["gefen", "muon"])
@pytest.mark.parametrize("damage", [_unsorted, _set(float("nan")), _set(float("inf")), _set(-float("inf"))],
                         ids=["unsorted", "nan", "inf", "-inf"])
def test_a_codebook_damaged_in_the_middle_is_refused(saved, tmp_path, kind, what, damage):
    """Pins ``schema_records.check_codebook``'s sortedness and finiteness on load (Gefen's and GefenMuon's
    codebooks): two middle entries swapped, or a middle entry NaN or infinite, with the ends still -1 and
    +1 and the size 256, are refused, naming the entry; nothing is loaded."""
    root, _, _ = saved

    def edit(opt_sd):
        (key,) = entries(opt_sd, kind)
        cb = damage(opt_sd[key].clone())
        assert cb.numel() == schema.K and cb[0] == -1 and cb[-1] == 1  # only the middle differs
        opt_sd[key] = cb

    edited(root, tmp_path, STEP, edit)
    opt = refused(tmp_path, rf"{what} gefen/{kind}/\S+ is corrupt \(must be 256 sorted finite values from -1 to 1\)")
    assert all(gx.codebook(o) is None for o in opt.optimizers)


# ------------------------------------------------------------------ Gefen's hyperparameters
@pytest.mark.parametrize("key, value", [("lr", float("nan")), ("lr", -1e-3), ("weight_decay", float("nan")),
                                        ("weight_decay", -0.1), ("beta1", -0.5)])
def test_nan_or_negative_gefen_hyperparameters_are_refused(saved, tmp_path, key, value):
    """Pins ``gefen_records.check_hyper``'s "not NaN, not negative": a Gefen record whose group holds a NaN or
    negative value that the representability check (betas below 1, eps above 0) lets through is refused,
    naming the parameter and the value; the live group keeps its own."""
    root, _, _ = saved

    def change(rec):
        rec["params"][0]["group"][key] = value

    edited(root, tmp_path, STEP, edit_records("gefen", change))
    fqn = next(gx.named_params(next(o for o in saved[2].optimizers if gx.is_gefen(o))))[0]  # params[0]
    opt = refused(tmp_path, re.escape(f"{fqn}: hyperparameter {key}={value!r} in the checkpoint is invalid"))
    gefen = next(o for o in opt.optimizers if gx.is_gefen(o))
    assert all(not math.isnan(g[key]) and g[key] >= 0 for g in gefen.param_groups)


# ------------------------------------------------------------------ step > global_step
def _behind(rec):
    """The record's global step one below its largest parameter step (every counter else unchanged)."""
    top = max(p["step"] for p in rec["params"])
    assert top > 0
    rec["global_step"] = top - 1


@pytest.mark.parametrize("kind", ["gefen", "muon"])
def test_a_parameter_step_above_the_global_step_is_refused(saved, tmp_path, kind):
    """Pins the ``step > global_step`` check of ``gefen_records.check_counters`` (Gefen, v3) and
    ``muon_records.check_muon_counters`` (GefenMuon) on load: a record whose global step is below a
    parameter's step is refused, naming both, by the records stage (the load's, which ``ckpt verify``
    runs: the adapters plan from its records and no longer check them again)."""
    root, _, _ = saved
    edited(root, tmp_path, STEP, edit_records(kind, _behind))
    refused(tmp_path, rf": global step {STEP - 1} < parameter step {STEP} \[records\]")


def test_a_v1_parameter_step_above_its_source_rank_global_step_is_refused(tmp_path):
    """Pins ``GefenPerRankAdapter``'s ``global step < parameter step`` check (format v1, per-rank
    blocking): source rank 0's record table with its global step (row 0) below the parameters' steps."""
    src = tmp_path / "src"
    save(src, blocking="per_rank", muon=False)

    def edit(opt_sd):
        (key,) = entries(opt_sd, "records")
        table = opt_sd[key].clone()
        assert int(table[1:, 3].max()) == STEP  # column 3: each parameter's step
        table[0, 0] = STEP - 1
        opt_sd[key] = table

    edited(src, tmp_path / "bad", STEP, edit)
    load(src, {"blocking": "per_rank", "muon": False})  # the unedited one loads
    refused(tmp_path / "bad", rf": global step {STEP - 1} < parameter step {STEP}$",
            {"blocking": "per_rank", "muon": False})


# ------------------------------------------------------------------ GefenMuon's group keys
def _muon_group(key, value):
    def change(rec):
        group = rec["params"][0]["group"]
        if value is _MISSING:
            del group[key]
        else:
            group[key] = value
    return change


_MISSING = object()


@pytest.mark.parametrize("key, value, match", [
    ("normuon_eps", 0.0, "normuon_eps=0.0"),  # the key and its value
    ("ns_steps", 100, "ns_steps=100"),
    ("ns_coefficients", [[3.4445, -4.775, 2.0315]] * 100, "ns_coefficients"),
    ("normuon_eps", _MISSING, "'normuon_eps' missing from the checkpoint"),
], ids=["normuon_eps_zero", "ns_steps_100", "ns_coefficients_100", "normuon_eps_missing"])
def test_gefen_muon_group_keys_out_of_range_are_refused(saved, tmp_path, key, value, match):
    """Pins ``muon_records.check_muon_hyper`` on load beyond what test_gefen_muon tries: every key present,
    ``normuon_eps > 0`` (0 passes the non-negative check), ``ns_steps < 100`` and fewer than 100
    coefficient triples (the upper bounds); each refused naming the key, the live group unchanged."""
    root, _, _ = saved
    edited(root, tmp_path, STEP, edit_records("muon", _muon_group(key, value)))
    opt = refused(tmp_path, rf"w1\.weight: GefenMuon group key .*{re.escape(match)}")
    (muon,) = [o for o in opt.optimizers if gx.is_gefen_muon(o)]
    assert muon.param_groups[0]["normuon_eps"] > 0 and muon.param_groups[0]["ns_steps"] < 100


# ------------------------------------------------------------------ raw items read in part (a reshard)
@contextlib.contextmanager
def fake_rank(rank: int, world: int):
    """This process as rank ``rank`` of ``world`` on a fake process group (no peers; DCP runs ``no_dist``),
    with a 1-D CPU mesh over the ranks: DTensor computes each rank's shard as a real job does."""
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_raw_items_taken_in_part_read_back_bit_for_bit(saved, world):
    """Pins the raw-entry read of a reshard (``_read_raw``, ``_raw_layout``, ``_tensor``, then the narrow
    into the target): the saved v3 checkpoint (each raw item one whole chunk, as one rank wrote it) read
    by every rank of a 2- or 3-rank job (uneven: 32 rows over 3, 64 columns over 3) into DTensor shards
    by rows and by columns, so each request takes part of a stored chunk (not the whole-chunk read
    straight into the target);
    every shard holds exactly the values saved there (DTensor's own split of what the optimizer held)."""
    root, net, opt = saved
    gefen = next(o for o in opt.optimizers if gx.is_gefen(o))
    st = gx.gefen_read(gefen, net.embed.weight)
    grid = schema.grid_shape(tuple(net.embed.weight.shape), st.period)
    want = {"optimizer." + gefen_keys.qcodes_key("embed.weight"): st.codes.reshape(net.embed.weight.shape),
            "optimizer." + gefen_keys.grid_key("embed.weight"): gefen_keys.pack_blocks(
                st.magnitude.view(grid), None if st.vmean is None else st.vmean.view(grid))}
    if st.factored:  # the default: its rows (a vector, sharded by dim 0 below only)
        want["optimizer." + gefen_keys.vrow_key("embed.weight")] = st.v_row.reshape(-1)
    md = storage.read_metadata(step_dir(root))
    for key, value in want.items():  # stored raw, one chunk of the whole tensor
        (info,) = [i for idx, i in md.storage_data.items() if idx.fqn == key]
        assert schema.is_raw_item(key, info.length, value.dtype, tuple(value.shape)), key
    for rank in range(world):
        for dim in (0, 1):
            with fake_rank(rank, world) as mesh:
                some = {k: v for k, v in want.items() if v.ndim > dim}
                expected = {k: distribute_tensor(v, mesh, [Shard(dim)], src_data_rank=None) for k, v in some.items()}
                targets = {k: distribute_tensor(torch.full_like(v, 7), mesh, [Shard(dim)], src_data_rank=None)
                           for k, v in some.items()}
                dcp.load(targets, storage_reader=storage.storage_reader(step_dir(root)), no_dist=True)
            for key, t in targets.items():
                got, exp = t.to_local(), expected[key].to_local()
                if dim == 0 or want[key].shape[1] > 1:  # (the grid's one column (period 64) is rank 0's whole)
                    assert got.shape != want[key].shape, (key, rank, dim)  # part of the stored chunk
                assert got.dtype == exp.dtype and torch.equal(got, exp), (key, world, rank, dim)
