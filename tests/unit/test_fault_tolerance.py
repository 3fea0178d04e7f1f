"""gefen_titan.ft and optim.live_state, one process: what a heal carries, and what it refuses.

The multi-group runs (a lighthouse, SIGKILL, restart) are
tests/integration/test_fault_tolerance.py; here the pieces: a captured
state restored into fresh optimizers continues bit for bit (Gefen, GefenMuon,
AdamW), nothing is cached, no collective runs, a mismatched payload changes
nothing, the transport refuses a pickle with code, and the recipe layer
refuses what a fault-tolerant run cannot do.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gefen_titan.optim import live_state
from gefen_titan.optim.blocking_options import BlockingOptions
from gefen_titan.optim.container import ParamGroup
from gefen_titan.recipe.build import load_recipe
from gefen_titan.recipe.errors import RecipeError

ROOT = Path(__file__).resolve().parents[2]
FT_RECIPE = ROOT / "recipes" / "llama_gefen_ft.toml"
needs_torchft = pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="the [ft] extra")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 64)
        self.w1 = torch.nn.Linear(64, 128, bias=False)
        self.w2 = torch.nn.Linear(128, 64, bias=True)
        self.norm = torch.nn.LayerNorm(64)


def _container(model: torch.nn.Module):
    """GefenMuon for the matrices, AdamW for the bias, Gefen for the rest; torchft off."""
    from gefen_titan.ft.optimizer import GefenFTOptimizersContainer

    groups = [ParamGroup(pattern=r"^w[12]\.weight$", optimizer_name="GefenMuon"),
              ParamGroup(pattern=r"^w2\.bias$", optimizer_name="AdamW"), ParamGroup(pattern=".*")]
    return GefenFTOptimizersContainer.Config(name="Gefen", lr=3e-3, param_groups=groups).build(model_parts=[model])


def _step(model: torch.nn.Module, container, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
    container.step()


def _trained(steps: int = 3, seed: int = 0):
    torch.manual_seed(seed)
    model = Net()
    container = _container(model)
    for s in range(steps):
        _step(model, container, s)
    return model, container


def _same_state(a, b) -> list[str]:
    """Where two captures differ (every tensor bit for bit)."""
    bad = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        for fqn in x["state"]:
            for k, v in x["state"][fqn].items():
                w = y["state"][fqn].get(k)
                if not (torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w):
                    bad.append(f"{i} {fqn} {k}")
        if x.get("codebook") is not None and not torch.equal(x["codebook"], y["codebook"]):
            bad.append(f"{i} codebook")
    return bad


def _roundtrip(payload):
    """Through a weights-only pickle, as the transport moves it."""
    import io

    buf = io.BytesIO()
    torch.save(payload, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_a_restored_state_continues_bit_for_bit_for_gefen_gefenmuon_and_adamw():
    model, opts = _trained()
    assert [type(o).__name__ for o in opts.optimizers] == ["ShardedGefenMuon", "AdamW", "Gefen"]
    payload = _roundtrip(opts.heal_state_dict())
    twin = copy.deepcopy(model)  # the same weights (the model's own heal is HealState's)
    fresh = _container(twin)  # a joiner that has not stepped: the agreement still to run
    assert fresh.agreement.needed
    fresh.load_heal_state_dict(payload)
    assert not fresh.agreement.needed  # the peer's agreed periods and codebook, never its own
    assert [g["lr"] for o in fresh.optimizers for g in o.param_groups] == \
        [g["lr"] for o in opts.optimizers for g in o.param_groups]
    for s in range(3, 6):
        _step(model, opts, s)
        _step(twin, fresh, s)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    assert _same_state(opts.heal_state_dict()["optimizers"], fresh.heal_state_dict()["optimizers"]) == []


def test_capture_is_live_not_a_cached_snapshot():
    model, opts = _trained()
    before = _roundtrip(opts.heal_state_dict())
    _step(model, opts, 9)
    after = opts.heal_state_dict()
    assert _same_state(before["optimizers"], after["optimizers"])  # torchtitan #4422 served `before` forever
    gefen = after["optimizers"][2]
    assert gefen["global_step"] == before["optimizers"][2]["global_step"] + 1


def test_capture_and_restore_run_no_collective(monkeypatch):
    model, opts = _trained()

    def refuse(*a, **k):
        raise AssertionError("a collective in a heal: torchft runs it on its own thread, and heals ranks apart")

    for name in ("all_reduce", "all_gather", "all_gather_object", "broadcast", "barrier", "broadcast_object_list"):
        monkeypatch.setattr(dist, name, refuse)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    payload = opts.heal_state_dict()
    _container(copy.deepcopy(model)).load_heal_state_dict(payload)


@pytest.mark.parametrize("damage", ["params", "dtype", "kind", "codebook", "blocking"])
def test_a_payload_that_does_not_fit_changes_nothing(damage):
    _, opts = _trained()
    payload = opts.heal_state_dict()
    _, target = _trained(steps=1, seed=1)
    before = copy.deepcopy(target.heal_state_dict())
    gefen = payload["optimizers"][2]
    if damage == "params":
        gefen["params"] = ["other.weight"] + gefen["params"][1:]
    elif damage == "dtype":
        gefen["state"]["embed.weight"]["m_magnitude"] = gefen["state"]["embed.weight"]["m_magnitude"].double()
    elif damage == "kind":
        payload["optimizers"][1]["kind"] = "SGD"
    elif damage == "codebook":
        del gefen["codebook"]
    else:
        payload["agreement_needed"] = None  # a peer on per-rank blocking
    with pytest.raises(live_state.LiveStateError, match="cannot heal the optimizer state"):
        target.load_heal_state_dict(payload)
    after = target.heal_state_dict()
    assert _same_state(before["optimizers"], after["optimizers"]) == []
    assert after["agreement_needed"] == before["agreement_needed"]


def test_capture_refuses_what_a_weights_only_reader_could_not_read():
    _, opts = _trained(1)
    opts.optimizers[1].param_groups[0]["hook"] = object()
    with pytest.raises(live_state.LiveStateError, match="cannot travel in a heal"):
        opts.heal_state_dict()


class _Payload:
    """Runs code when unpickled (a hostile or compromised peer)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@needs_torchft
def test_the_transport_reads_a_heal_without_running_its_code(tmp_path):
    from gefen_titan.ft.transport import SafeHTTPTransport

    sender, receiver = SafeHTTPTransport(timedelta(seconds=10)), SafeHTTPTransport(timedelta(seconds=10))
    try:
        plain = {"model": {"w": torch.arange(6.0)}, "train_state": {"step": 3}, "lrs": [0.1, (0.9, 0.95)]}
        sender.send_checkpoint([1], step=3, state_dict=plain, timeout=timedelta(seconds=10))
        got = receiver.recv_checkpoint(0, sender.metadata(), step=3, timeout=timedelta(seconds=10))
        assert torch.equal(got["model"]["w"], plain["model"]["w"]) and got["train_state"] == {"step": 3}
        assert receiver.last_received_bytes == sender.last_sent_bytes == 24
        marker = tmp_path / "ran"
        sender.send_checkpoint([1], step=4, state_dict={"x": _Payload(str(marker))}, timeout=timedelta(seconds=10))
        with pytest.raises(Exception, match="(?i)weights.only|unsupported global|system"):
            receiver.recv_checkpoint(0, sender.metadata(), step=4, timeout=timedelta(seconds=10))
        assert not marker.exists()
    finally:
        sender.shutdown()
        receiver.shutdown()


@needs_torchft
def test_with_a_key_a_heal_is_signed_and_checked(monkeypatch):
    """Issue 38, item 4: with ``digest_key_env``'s key the sender signs the payload and the step it serves;
    the joiner refuses, before it returns anything to torchft, a payload changed in flight, one from a
    process without the key or with another key, and one signed for another step (a replayed heal)."""
    from gefen_titan.ft.transport import MAC_FIELD, HealRefused, SafeHTTPTransport

    t = timedelta(seconds=10)
    key = b"k" * 32
    signed, unsigned, other = SafeHTTPTransport(t, key=key), SafeHTTPTransport(t), SafeHTTPTransport(t, key=b"o" * 32)
    receiver = SafeHTTPTransport(t, key=key)
    try:
        payload = {"user": {"gefen_titan": {"model": {"w": torch.arange(6.0)}, "train_state": {"step": 5}}},
                   "torchft": {"step": 5, "batches_committed": 10}}
        signed.send_checkpoint([1], step=5, state_dict=payload, timeout=t)
        got = receiver.recv_checkpoint(0, signed.metadata(), step=5, timeout=t)  # the good peer
        assert MAC_FIELD not in got and torch.equal(got["user"]["gefen_titan"]["model"]["w"], torch.arange(6.0))
        assert SafeHTTPTransport(t).recv_checkpoint(0, signed.metadata(), step=5, timeout=t)["torchft"]["step"] == 5

        real = SafeHTTPTransport._load_from_address
        def in_flight(cls, address, timeout):  # one element of the model changed on the wire
            out = real.__func__(cls, address, timeout)
            out["user"]["gefen_titan"]["model"]["w"][3] += 1
            return out
        monkeypatch.setattr(SafeHTTPTransport, "_load_from_address", classmethod(in_flight))
        with pytest.raises(HealRefused, match="step 5 from replica rank 0 its MAC does not match"):
            receiver.recv_checkpoint(0, signed.metadata(), step=5, timeout=t)
        monkeypatch.setattr(SafeHTTPTransport, "_load_from_address", real)

        unsigned.send_checkpoint([1], step=5, state_dict=payload, timeout=t)
        with pytest.raises(HealRefused, match="carries no MAC"):
            receiver.recv_checkpoint(0, unsigned.metadata(), step=5, timeout=t)
        other.send_checkpoint([1], step=5, state_dict=payload, timeout=t)
        with pytest.raises(HealRefused, match="MAC does not match"):
            receiver.recv_checkpoint(0, other.metadata(), step=5, timeout=t)
        signed.send_checkpoint([1], step=3, state_dict=payload, timeout=t)  # signed for step 3 ...
        signed.allow_checkpoint(5)  # ... served as step 5
        with pytest.raises(HealRefused, match="MAC does not match"):
            receiver.recv_checkpoint(0, signed.metadata(), step=5, timeout=t)
    finally:
        for x in (signed, unsigned, other, receiver):
            x.shutdown()


@needs_torchft
@pytest.mark.parametrize("cut", [100, 300_000, 1_049_000])  # in the records' index, a tensor, the last tensor
def test_a_serving_peer_killed_mid_transfer_yields_no_payload(cut):
    """Issue 38, item 7, at the transport: the serving process is SIGKILLed after ``cut`` bytes of a
    1 MiB heal. The joiner's read raises one clear ConnectionError and returns nothing, whatever
    record the stream ended in; torchft then reports the step's error and applies nothing, and the
    next quorum heals again (the path the keyed-heal refusal takes in
    tests/integration/test_fault_tolerance.py). An intact transfer reads back as before
    (test_the_transport_reads_a_heal_without_running_its_code)."""
    import multiprocessing as mp

    from gefen_titan.ft.transport import SafeHTTPTransport
    from tests.helpers.dying_heal_server import serve_and_die

    t = timedelta(seconds=30)
    ctx = mp.get_context("fork")  # this process's imports, no second interpreter (the suite's time)
    conn, child_conn = ctx.Pipe()
    server = ctx.Process(target=serve_and_die, args=(cut, child_conn))
    server.start()
    receiver = SafeHTTPTransport(t)
    try:
        address = conn.recv()
        with pytest.raises(ConnectionError, match=r"the peer's stream ended after [\d,]+ bytes.*died mid-transfer"):
            receiver.recv_checkpoint(0, address, step=5, timeout=t)
        server.join(30)
        assert server.exitcode == -9  # it died, killed, in the middle of the transfer
    finally:
        server.kill()
        receiver.shutdown()


@needs_torchft
def test_an_ft_recipe_builds_the_fault_tolerant_trainer_with_gefen_parts():
    from gefen_titan.ft.checkpoint import GefenFTCheckpointManager
    from gefen_titan.ft.manager import GefenTorchFTManager
    from gefen_titan.ft.optimizer import GefenFTOptimizersContainer
    from gefen_titan.ft.trainer import GefenFaultTolerantTrainer

    config = load_recipe(FT_RECIPE, world_size=2).config
    assert type(config) is GefenFaultTolerantTrainer.Config
    assert type(config.optimizer) is GefenFTOptimizersContainer.Config and config.optimizer.name == "Gefen"
    assert type(config.checkpoint) is GefenFTCheckpointManager.Config
    assert type(config.fault_tolerance) is GefenTorchFTManager.Config and config.fault_tolerance.enable


@needs_torchft
def test_ft_components_lift_ours_keeping_their_values():
    from gefen_titan.checkpoint.manager import GefenCheckpointManager
    from gefen_titan.ft.checkpoint import GefenFTCheckpointManager
    from gefen_titan.ft.optimizer import GefenFTOptimizersContainer
    from gefen_titan.optim.container import GefenOptimizersContainer

    ckpt = GefenFTCheckpointManager.Config.from_torchtitan(
        GefenCheckpointManager.Config(enable=True, interval=3, digest_key_env="KEY"))
    assert type(ckpt) is GefenFTCheckpointManager.Config
    assert (ckpt.enable, ckpt.interval, ckpt.digest_key_env) == (True, 3, "KEY")
    opt = GefenFTOptimizersContainer.Config.from_torchtitan(
        GefenOptimizersContainer.Config(name="AdamW", lr=1e-3, blocking=BlockingOptions(max_tensor_parallel_degree=2)))
    assert type(opt) is GefenFTOptimizersContainer.Config
    assert (opt.name, opt.lr, opt.betas, opt.blocking.max_tensor_parallel_degree) == ("AdamW", 1e-3, None, 2)
    assert GefenFTOptimizersContainer.Config.from_torchtitan(opt) is opt


@needs_torchft
@pytest.mark.parametrize(("overrides", "match"), [
    ({"fault_tolerance": {"semi_sync_method": "diloco"}}, "DiLoCo"),
    ({"fault_tolerance": {"replica_id": 2}}, "replica_id 2"),
    ({"fault_tolerance": {"min_replica_size": 3}}, "min_replica_size 3"),
    ({"parallelism": {"data_parallel_replicate_degree": 2}}, "data_parallel_replicate_degree"),
    ({"training": {"global_batch_size": 4}}, "global_batch_size 4 is not a multiple"),
])
def test_the_recipe_layer_refuses_what_a_fault_tolerant_run_cannot_do(overrides, match):
    with pytest.raises(RecipeError, match=match):
        load_recipe(FT_RECIPE, overrides, world_size=2)


@needs_torchft
def test_fault_tolerance_needs_the_global_order_loader():
    from gefen_titan.data.elastic import ElasticTextDataLoader
    from gefen_titan.recipe.fault_tolerance import check_fault_tolerance

    config = load_recipe(FT_RECIPE, world_size=2).config
    config.dataloader = ElasticTextDataLoader.Config()
    with pytest.raises(RecipeError, match=r"needs \[dataloader\] loader = \"global_order\""):
        check_fault_tolerance(config, "x.toml")


def test_an_ft_recipe_without_torchft_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    with pytest.raises(RecipeError, match=r"pip install 'gefen-titan\[ft\]'"):
        load_recipe(FT_RECIPE, world_size=2)


@needs_torchft
def test_a_replica_group_without_fsdp_is_refused():
    from gefen_titan.ft.manager import GefenTorchFTManager

    manager = GefenTorchFTManager.__new__(GefenTorchFTManager)
    manager._manager, manager.replicate_pg = object(), object()  # enabled, as after __init__
    with pytest.raises(ValueError, match="needs FSDP2 inside each replica group"):
        manager.maybe_set_all_reduce_hook([Net()])


class _Manager:
    """torchft's Manager as the container sees it: a quorum, then a verdict per step."""

    def __init__(self, verdicts: list[bool]) -> None:
        self.verdicts = verdicts
        self.quorums = 0

    def start_quorum(self) -> None:
        self.quorums += 1

    def should_commit(self) -> bool:
        return self.verdicts.pop(0)


def test_an_uncommitted_step_changes_nothing_and_runs_no_step_hook():
    """torch runs step hooks around the most derived step: the agreement (a pre-hook) must not
    learn from a step torchft then throws away, nor may the post-hooks count it."""
    from types import SimpleNamespace

    from gefen_titan.ft.optimizer import GefenFTOptimizersContainer

    torch.manual_seed(0)
    model = Net()
    groups = [ParamGroup(pattern=r"^w[12]\.weight$", optimizer_name="GefenMuon"), ParamGroup(pattern=".*")]
    manager = _Manager([False, True, False])
    opts = GefenFTOptimizersContainer.Config(name="Gefen", lr=3e-3, param_groups=groups).build(
        model_parts=[model], ft_manager=SimpleNamespace(enabled=True, manager=manager))
    calls = []
    opts.register_step_pre_hook(lambda *a: calls.append("pre"))
    opts.register_step_post_hook(lambda *a: calls.append("post"))
    weights = [p.detach().clone() for p in model.parameters()]
    opts.zero_grad()
    _step_grads = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=_step_grads) * 1e-2
    opts.step()  # not committed
    assert not opts.last_step_committed and calls == [] and opts.agreement.needed
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    assert all("step" not in st for o in opts.optimizers for st in o.state.values())  # never stepped
    opts.step()  # committed: the agreement runs now, on these gradients
    assert opts.last_step_committed and calls == ["pre", "post"] and not opts.agreement.needed
    assert not all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    after = live_state.capture(opts.optimizers)
    opts.step()  # not committed again: nothing moves
    assert calls == ["pre", "post"]
    assert _same_state(after, live_state.capture(opts.optimizers)) == []
    assert manager.quorums == 1


# ------------------------------------------ a heal is installed on every rank of a group or on none


class _HealManager:
    """torchft's Manager as ``ft.heal`` asks it: whether this rank's quorum failed, and its step."""

    def __init__(self, step: int, errored: str | None = None) -> None:
        self.step, self._errored = step, errored

    def errored(self):
        return self._errored

    def state_dict(self):
        return {"step": self.step, "batches_committed": 2 * self.step}

    def load_state_dict(self, state_dict):
        self.step = state_dict["step"]


class _Stateful:
    def __init__(self, **state) -> None:
        self.__dict__.update(state)

    def state_dict(self):
        return dict(self.__dict__)

    def load_state_dict(self, state_dict):
        self.__dict__.update(state_dict)


def _group_rank(rank: int, world: int, store: str, out: str, case: str) -> None:
    """One rank of a joining group in one quorum, torchft's part played as torchft plays it: a rank
    whose transfer succeeded gets torchft's step set to the heal's and ``load_state_dict``; a rank
    whose transfer failed gets neither, and its manager reports the error."""
    import json

    from gefen_titan.ft.heal import HealState

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        peer_model, peer_opts = _trained(seed=1)
        model = Net()
        opts = _container(model)
        manager = _HealManager(step=2, errored="cut stream" if (case == "one_cut" and rank == 1) else None)
        heal = HealState(model_parts=[model], optimizers=opts, lr_schedulers=_Stateful(last_epoch=1),
                         dataloader=None, train_state=_Stateful(step=2), manager=manager)
        payload = {"model": {k: v.detach().clone() for k, v in peer_model.state_dict().items()},
                   "optimizer": _roundtrip(peer_opts.heal_state_dict()), "lr_scheduler": {"last_epoch": 5},
                   "dataloader": {}, "train_state": {"step": 6}}
        if case == "one_refused" and rank == 1:
            payload["model"]["w1.weight"] = payload["model"]["w1.weight"][:, :3]
        before = {k: v.clone() for k, v in model.state_dict().items()}
        heal.before_quorum()
        if manager.errored() is None:  # this rank's transfer succeeded
            manager.step = 6
            heal.load_state_dict(payload)
        error = None
        try:
            heal.after_quorum()
        except live_state.LiveStateError as e:
            error = str(e)
        same_as = ("peer" if all(torch.equal(v, payload["model"][k]) for k, v in model.state_dict().items())
                   else "before" if all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) else "?")
        with open(os.path.join(out, f"{case}-{rank}.json"), "w") as f:
            json.dump({"model": same_as, "step": heal.train_state.step, "torchft_step": manager.step,
                       "heals": heal.stats.heals, "error": error}, f)
    finally:
        dist.destroy_process_group()


def _group_cases(rank: int, world: int, store: str, out: str) -> None:
    for case in ("both", "one_cut", "one_refused"):
        _group_rank(rank, world, f"{store}-{case}", out, case)


def test_a_heal_is_installed_on_every_rank_of_the_group_or_on_none(tmp_path):
    """torchft hands each rank its heal on its own and picks each rank's source on its own: when the
    serving peer dies mid-transfer, one rank may hold a whole heal while the other's stream was cut
    (a 3-group run diverged so). 2 gloo ranks of one joining group: both receive -> both install;
    one's transfer fails -> neither installs, and torchft's step goes back so the next quorum heals
    the group again; one receives a payload that does not fit -> both raise, naming it."""
    import json

    from tests.helpers import processes

    processes.spawn(_group_cases, (2, str(tmp_path / "store"), str(tmp_path)), 2, timeout=300, fork_server=True)
    got = {(c, r): json.loads((tmp_path / f"{c}-{r}.json").read_text())
           for c in ("both", "one_cut", "one_refused") for r in (0, 1)}
    for r in (0, 1):
        assert got["both", r] == {"model": "peer", "step": 6, "torchft_step": 6, "heals": 1, "error": None}
        assert got["one_cut", r] == {"model": "before", "step": 2, "torchft_step": 2, "heals": 0, "error": None}
        refused = got["one_refused", r]
        assert refused["model"] == "before" and refused["heals"] == 0 and refused["step"] == 2
        assert "cannot heal from the live replica group: w1.weight: the peer's shard" in refused["error"]
