"""Shared, expensive set-up, and the suite's two tiers.

Gefen's first step learns block periods and a codebook with ~8 s of
single-threaded numba per process, so tests that need stepped Gefen state share
one stepped optimizer per session instead of stepping their own.

Tiers: ``tests/unit`` is the fast one (single process; 135 s in two workers
on the 2-vCPU AMD EPYC Zen 3 VM the README names, longer elsewhere:
``python -m pytest -q -n 2 --dist loadgroup tests/unit``); every
test under ``tests/integration`` (torchrun / gloo launches, minutes) is marked
``integration`` here, so ``-m "not integration"`` selects the fast tier from
anywhere. CI runs the unit tier so, then ``python -m pytest -q tests/integration``
in one process (README).
"""

import logging
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from gefen_titan import patches
from gefen_titan.data import corpus as data
from tests.helpers import suite_cache

# In-process tests build torchtitan components on CPU: what train.py does first.
patches.apply_all()
data.register_datasets()


class TinyBlock(nn.Module):
    """Big enough that Gefen picks a block period > 1 for the matrices."""

    def __init__(self, dim=64):
        super().__init__()
        self.attn = nn.Linear(dim, dim, bias=False)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, 32)

    def forward(self, x):
        return self.out(self.norm(self.attn(x)))


INTEGRATION = Path(__file__).resolve().parent / "integration"


@pytest.fixture(autouse=True)
def _no_logging_to_closed_streams():
    """Drop logging handlers whose stream is closed, before each test. A handler added while an earlier
    test's output was captured (torchtitan's ``init_logger``, a module's own) keeps that captured stream
    after it closes; the next record through it prints "--- Logging error --- Traceback ..." into what a
    later test reads (seen in CI: a verify test that asserts no traceback failed on it, by module order)."""
    for logger in [logging.getLogger(), *logging.root.manager.loggerDict.values()]:
        if not isinstance(logger, logging.Logger):
            continue
        for handler in list(logger.handlers):
            if isinstance(handler, logging.StreamHandler) and getattr(handler.stream, "closed", False):
                logger.removeHandler(handler)
    yield



# Modules that share a session fixture run in one worker (``runs`` of
# tests/integration/conftest.py: the format-v1 reshard runs).
SHARED_GROUPS = {"test_reshard_fail_closed": "test_reshard"}


def pytest_collection_modifyitems(config, items):
    # Parallel workers (``-n 2``, the README's unit tier) take whole modules
    # (``--dist loadgroup``): a module's fixtures (its reference runs, its
    # launches) are then built once, not once per worker that runs one of its tests.
    grouped = config.pluginmanager.hasplugin("xdist")
    for item in items:
        if INTEGRATION in item.path.parents:
            item.add_marker(pytest.mark.integration)
        if grouped:
            stem = item.path.stem
            item.add_marker(pytest.mark.xdist_group(SHARED_GROUPS.get(stem, f"{item.path.parent.name}/{stem}")))


@pytest.fixture(scope="session", autouse=True)
def token_cache(tmp_path_factory):
    """Token datasets tokenized on first use (the global-order loader's
    gefen_tiny) go to this session's temp dir, not ~/.cache; runs started
    from tests inherit it."""
    os.environ.setdefault("GEFEN_TITAN_CACHE", str(tmp_path_factory.mktemp("token_cache")))
    return os.environ["GEFEN_TITAN_CACHE"]


@pytest.fixture(scope="session")
def reference_cache(tmp_path_factory) -> Path:
    """The suite run's cache of CI reference runs (``gefen_titan.validation.runs.reference_run``):
    a run of the same identity (recipe, processes, settings) is trained once,
    by whichever worker asks first, and reused by every test that asks for it
    (recipe regression, reshard validation, meshes)."""
    return suite_cache.reference_cache(tmp_path_factory)


@pytest.fixture(scope="session")
def gefen_stepped():
    """(model, container, params before the step) after one Gefen step."""
    from gefen_titan.optim.container import GefenOptimizersContainer

    torch.manual_seed(0)
    model = TinyBlock(dim=256)
    opt = GefenOptimizersContainer.Config(name="Gefen", lr=1e-2).build(model_parts=[model])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.randn(8, 256)).square().mean().backward()
    opt.step()
    return model, opt, before
