"""Every exception class of the package crosses a rank boundary intact.

DCP gathers a rank's exception to every rank by pickling it (its planning
round and the gather after the read step), and so do
``distributed.all_gather_objects`` and torch.multiprocessing. An exception
that cannot be rebuilt from its pickle turns a refusal into
``TypeError: __init__() missing ... argument`` on every other rank, and the
message that says what to do is lost. The classes are found by walking the
package, so a new one fails here until it has an example below.
"""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil

import pytest

import gefen_titan
import gefen_titan.patches

# One instance of every exception class, with its attributes set (qualified name -> factory).
EXAMPLES = {
    "gefen_titan.checkpoint.errors.GefenCheckpointError": lambda m: m.GefenCheckpointError("refused: x"),
    "gefen_titan.checkpoint.format.digests.CorruptCheckpointError":
        lambda m: m.CorruptCheckpointError("corrupt: x", file="__0_0.distcp", entry="model.w", what="digest"),
    "gefen_titan.checkpoint.checks.load_checks.StepMismatchError":
        lambda m: m.StepMismatchError("step 3, folder step-4"),
    "gefen_titan.checkpoint.checks.entry_values.EntryValueError": lambda m: m.EntryValueError("train_state.step is -1"),
    "gefen_titan.checkpoint.format.schema.FormatError": lambda m: m.FormatError("bad record"),
    "gefen_titan.checkpoint.format.unpickling.ForbiddenObjectError":
        lambda m: m.ForbiddenObjectError("entry train_state.step", "builtins.eval", "/ckpt/step-4"),
    "gefen_titan.checkpoint.format.files.NotARegularFileError":
        lambda m: m.NotARegularFileError("/ckpt/step-4/.digests", "a FIFO (named pipe)"),
    "gefen_titan.checkpoint.format.files.TooLargeError":
        lambda m: m.TooLargeError("/ckpt/step-4/.metadata", 1 << 34, 1 << 30, "the format"),
    "gefen_titan.checkpoint.checks.metadata_fields.MalformedMetadataError":
        lambda m: m.MalformedMetadataError("/ckpt/step-4", "storage_data is list, not a dict"),
    "gefen_titan.checkpoint.format.pickle_budget.OverBudgetError":
        lambda m: m.OverBudgetError(".metadata", "objects nested more than 64 deep", "/ckpt/step-4"),
    "gefen_titan.checkpoint.format.pickle_budget._Refused": lambda m: m._Refused("nested too deep"),
    "gefen_titan.ckpt_tools.view.CkptError": lambda m: m.CkptError("cannot read", "metadata fields"),
    "gefen_titan.data.elastic_dataset.DataLoaderReshardError": lambda m: m.DataLoaderReshardError("no"),
    "gefen_titan.data.elastic_dataset.DataLoaderPositionError": lambda m: m.DataLoaderPositionError("no"),
    "gefen_titan.data.global_loader.DataOrderError": lambda m: m.DataOrderError("no"),
    "gefen_titan.data.indexed.IndexedDataError": lambda m: m.IndexedDataError("no"),
    "gefen_titan.data.registry.UnknownLoaderError": lambda m: m.UnknownLoaderError("no"),
    "gefen_titan.data.stream_reshard.StreamNotResumable": lambda m: m.StreamNotResumable("no"),
    "gefen_titan.distributed.layout.LayoutError": lambda m: m.LayoutError("no"),
    "gefen_titan.optim.block_periods.BlockingError": lambda m: m.BlockingError("no"),
    "gefen_titan.optim.live_state.LiveStateError": lambda m: m.LiveStateError("no"),
    "gefen_titan.optim.muon.matrices.MuonLayoutError": lambda m: m.MuonLayoutError("no"),
    "gefen_titan.optim.kinds.gefen.per_rank_regions.UnsupportedLayout": lambda m: m.UnsupportedLayout("no"),
    "gefen_titan.recipe.errors.RecipeError": lambda m: m.RecipeError("no"),
    "gefen_titan.validation.layouts.LayoutError": lambda m: m.LayoutError("no"),
    "gefen_titan.ft.transport.HealRefused": lambda m: m.HealRefused("heal payload for step 5: its MAC does not match"),
    "gefen_titan.patches._util.PatchTargetChanged": lambda m: m.PatchTargetChanged("moved"),
    "gefen_titan.errors.UserError": lambda m: m.UserError("no"),
}


def _exception_classes() -> dict[str, type]:
    found = {}
    for package in (gefen_titan, gefen_titan.patches):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.endswith("__main__"):
                continue
            module = importlib.import_module(info.name)
            for obj in vars(module).values():
                if (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name):
                    found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_every_exception_class_has_an_example():
    found = _exception_classes()
    assert set(found) == set(EXAMPLES), (
        f"without an example (add one above): {sorted(set(found) - set(EXAMPLES))}; "
        f"gone: {sorted(set(EXAMPLES) - set(found))}")


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_an_exception_pickles_with_its_message_and_attributes(name):
    module = importlib.import_module(name.rpartition(".")[0])
    error = EXAMPLES[name](module)
    assert f"{type(error).__module__}.{type(error).__qualname__}" == name
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    assert str(back) == str(error) and back.args == error.args
    assert vars(back) == vars(error)
