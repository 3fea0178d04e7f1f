"""What a load of the optimizer knows before DCP reads its state: one read, shared by every check.

``read_load_context`` makes the load's one small collective read: the
header, every optimizer record and every codebook of every kind (and v1's
rank tables), parsed into a ``LoadContext`` that the container's kinds
check (``kinds_refusal``) and every ``StateAdapter.prepare_load`` plan from,
and checked by the records stage of ``checkpoint.checks.load_checks`` (what ``ckpt
verify`` runs: the checks that need no live model), whose refusal comes
after the model-aware checks (``LoadContext.records_refusal``). Every check
of this phase notes its refusal in the phase's ``errors.Verdict``, which the
container settles once, on every rank.
Reading them once keeps a load's planning to one round of DCP's collectives
however many optimizer kinds the run holds; which entries count as small is
the format's to say (``schema.SMALL_KINDS``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gefen_titan.checkpoint.checks import load_checks
from gefen_titan.checkpoint.errors import Verdict, convert_advice
from gefen_titan.checkpoint.format import schema, schema_records
from gefen_titan.checkpoint.io.storage import read_small

__all__ = ["FLAT_KIND", "LoadContext", "kinds_refusal", "read_load_context"]

# The kind a checkpoint's flat torch state (``state.<fqn>.*``, ``param_groups.<fqn>.*``:
# AdamW, Adam) is reported as; a live optimizer without records of its own is of it.
FLAT_KIND = "AdamW"


@dataclass(frozen=True)
class LoadContext:
    """The optimizer's part of a checkpoint, as far as a load's planning needs it."""

    checkpoint_id: str
    entries: dict[str, Any]
    """Every entry of the optimizer (keys without the component prefix) -> its DCP metadata."""
    small: dict[str, Any]
    """Every small entry (``schema.SMALL_KINDS``), read: the header, records (JSON), codebooks."""
    header: schema_records.Header | None
    """The parsed header; None where the checkpoint has no Gefen state."""
    records_refusal: str | None = None
    """The records stage's verdict (``load_checks.record_problems``): None, or the refusal the
    container notes after the model-aware checks (the kinds', the adapters' ``prepare_load``), so
    that a checkpoint of another model or recipe is named as such; what only the records stage
    sees (what ``ckpt verify`` also reports) refuses the load then, before anything is read."""
    saved: Any = None
    """The records stage's parsed records (``record_checks.SavedRecords``: every kind's, checked;
    None without Gefen state): what the adapters plan from."""

    def keys_of(self, key_kind: str) -> list[str]:
        """The entries of one key kind (``schema.parse_key``), sorted."""
        return sorted(k for k in self.entries if (pk := schema.parse_key(k)) is not None and pk.kind == key_kind)

    def foreign_keys(self) -> list[str]:
        """Entries of torch's flat optimizer state (another optimizer's), sorted."""
        return sorted(k for k in self.entries if k.startswith("state."))


def read_load_context(checkpoint_id: str, metadata: Any, prefix: str, verdict: Verdict) -> LoadContext:
    """The load's one small read. Collective: every rank reads the same entries, and a damaged one
    raises the same ``GefenCheckpointError`` on every rank; an unreadable header is noted in ``verdict``."""
    entries = {k[len(prefix):]: v for k, v in metadata.state_dict_metadata.items() if k.startswith(prefix)}
    kinds = {k: pk.kind for k in entries if (pk := schema.parse_key(k)) is not None and pk.kind in schema.SMALL_KINDS}
    small = read_small(checkpoint_id, metadata, prefix,
                       sorted(k for k, kind in kinds.items() if schema.SMALL_KINDS[kind] == "tensor"),
                       sorted(k for k, kind in kinds.items() if schema.SMALL_KINDS[kind] == "str"))
    header, error = None, None
    if schema.header_key() in small:
        try:
            header = schema_records.Header.from_json(small[schema.header_key()])
        except schema.FormatError as e:
            error = str(e)
    verdict.refuse(error)
    # The records stage of load_checks: the same function ckpt verify runs; noted last (records_refusal).
    saved, problems = load_checks.read_records(entries, small, prefix)
    return LoadContext(checkpoint_id, entries, small, header,
                       load_checks.refusal(checkpoint_id, problems) if problems else None, saved)


def kinds_refusal(ctx: LoadContext, live: dict[str, str], saved_by: dict[str, str],
                  hint: Callable[[str, str], str] | None = None) -> str | None:
    """Why a checkpoint that saved a live parameter under another optimizer kind is refused (None:
    it did not). ``live``: fqn -> the registry name stepping it;
    ``saved_by``: record kind (``schema.parse_key``) -> the registry name
    that writes it. The kinds without records of their own (AdamW, Adam)
    count as one, ``FLAT_KIND``, since their flat state is the same.

    Without this check the adapters would each see parameters without state
    of their own kind and call the checkpoint foreign (or DCP would miss the
    flat keys); the fix is a setting, which the message names (``hint(was,
    now)`` adds the one its caller knows, e.g. GefenMuonHybrid's keys).
    """
    error = None
    try:
        saved = {fqn: kind_name for key_kind, kind_name in saved_by.items() for k in ctx.keys_of(key_kind)
                 for fqn in schema_records.record_fqns(ctx.small[k], f"optimizer record {k}")}
        saved.update({fqn: FLAT_KIND for fqn in live if fqn not in saved and f"param_groups.{fqn}.lr" in ctx.entries})
        moved: dict[tuple[str, str], list[str]] = {}
        for fqn, kind_name in live.items():
            kind_name = kind_name if kind_name in saved_by.values() else FLAT_KIND
            if saved.get(fqn, kind_name) != kind_name:
                moved.setdefault((saved[fqn], kind_name), []).append(fqn)
        error = "; ".join(
            f"{len(fqns)} parameter(s) ({', '.join(sorted(fqns)[:3])}{' ...' if len(fqns) > 3 else ''}) were saved "
            f"by {was} and the recipe gives them to {now}: "
            + ((hint(was, now) + ", or ") if hint is not None and hint(was, now) else "")
            + ((convert + ", or ") if (convert := convert_advice(ctx.checkpoint_id, was, now)) else "")
            + f"give them to {was} again (a [[optimizer.param_groups]] entry with optimizer_name = \"{was}\" "
            "whose pattern matches them, as in the run that wrote it), or start the optimizer fresh with "
            "checkpoint.exclude_from_loading = [\"optimizer\"]" for (was, now), fqns in sorted(moved.items())) or None
    except schema.FormatError as e:
        error = str(e)
    return error
