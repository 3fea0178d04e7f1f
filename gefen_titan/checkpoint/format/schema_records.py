"""The Gefen checkpoint format's records: the header, the frame every kind's v2/v3 optimizer record
shares, and the checks of values every kind shares (the codebook).

With ``schema`` (keys), the format's definition; each kind's own records
subclass the frame in its folder (``optim.kinds.gefen.records``,
``optim.kinds.gefen_muon.records``). The JSON of every record is part of
the format: ranks compare the bytes of the records they write (DCP keeps one
copy), so ``to_json`` must stay byte-for-byte what earlier versions wrote.
"""

from __future__ import annotations

import contextlib
import json
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Self, TypeVar

import torch

from gefen_titan.checkpoint.format.schema import (
    AGREED_VERSIONS,
    FORMAT,
    V1,
    V2,
    V3,
    VERSION,
    VERSIONS,
    FormatError,
    K,
    grid_shape,
    header_key,
)

__all__ = ["Header", "KindParamRecord", "KindOptimizerRecord", "loads_json", "record_fields", "record_fqns",
           "check_codebook"]


def loads_json(raw: Any, what: str) -> Any:
    """A record's JSON; FormatError for anything else."""
    if not isinstance(raw, str):
        raise FormatError(f"{what} is {type(raw).__name__}, not a JSON string")
    try:
        return json.loads(raw)
    except ValueError as e:
        raise FormatError(f"{what} is not JSON ({e})") from None


@contextlib.contextmanager
def record_fields(what: str) -> Iterator[None]:
    """Turn a missing or mistyped field of a parsed record into a FormatError."""
    try:
        yield
    except FormatError:
        raise
    except KeyError as e:
        raise FormatError(f"{what} is corrupt (field {e} missing)") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise FormatError(f"{what} is corrupt ({e})") from None


@dataclass(frozen=True)
class Header:
    """``gefen/format``: the format version and the blocking that wrote it."""

    version: int
    blocking: str | None  # "agreed" (v2, v3, v4) | "per_rank" (v1; absent in early v1 writers)

    @classmethod
    def for_blocking(cls, blocking: str) -> Header:
        return cls(VERSION, "agreed") if blocking == "agreed" else cls(V1, "per_rank")

    @property
    def implied_blocking(self) -> str:
        return "agreed" if self.version in AGREED_VERSIONS else "per_rank"

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "version": self.version, "blocking": self.blocking})

    @classmethod
    def from_json(cls, raw: Any) -> Header:
        """Raises FormatError for anything but a gefen-titan v1, v2, v3 or v4 header."""
        data = loads_json(raw, f"the gefen-titan header {header_key()}")
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") not in VERSIONS:
            raise FormatError(
                f"checkpoint format {data} is not {FORMAT} v{V1}, v{V2}, v{V3} or v{VERSION}; it was written by "
                "another "
                "gefen-titan version. Load it with that version or exclude the optimizer")
        return cls(int(data["version"]), data.get("blocking"))


# ------------------------------------------------------------------ v2, v3: every kind's optimizer record
# A kind's records (Gefen's in ``optim.kinds.gefen.records``, GefenMuon's in ``...gefen_muon.records``)
# subclass these two: what they share is written once, so the kinds' JSON keeps one frame. Their text is
# the format: keys sorted, the same keys and types as before (tests/unit/test_kinds.py pins one record of each kind).
@dataclass
class KindParamRecord(ABC):
    """One parameter in a kind's optimizer record: name, shape, period (0: no state yet), step, then the
    kind's own fields: its second counter (``COUNTER`` names the field and its JSON key) and its group."""

    COUNTER: ClassVar[str]  # "vmean_step" (Gefen), "rows_step" (GefenMuon)

    fqn: str
    shape: tuple[int, ...]
    period: int  # 0: no state yet
    step: int

    @property
    def grid(self) -> tuple[int, ...] | None:
        return grid_shape(self.shape, self.period) if self.period else None

    @abstractmethod
    def group_json(self) -> dict[str, Any]:
        """The group's keys as the kind writes them (its keys, JSON types)."""

    def to_dict(self) -> dict[str, Any]:
        return {"fqn": self.fqn, "shape": list(self.shape), "period": self.period, "step": self.step,
                self.COUNTER: getattr(self, self.COUNTER), "group": self.group_json()}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Self:
        # The group is kept as saved: the kind's check (check_hyper, check_muon_hyper) says what is wrong with it.
        return cls(str(raw["fqn"]), tuple(int(s) for s in raw["shape"]), int(raw["period"]), int(raw["step"]),
                   int(raw[cls.COUNTER]), dict(raw["group"]))


P = TypeVar("P", bound=KindParamRecord)


@dataclass
class KindOptimizerRecord(Generic[P]):
    """One optimizer's record of any kind: ``deterministic``, the global step, its parameters in order
    (``PARAM`` records), written by agreed blocking. A kind whose record names it adds the key (``json_fields``)
    and checks it on read (``check_frame``)."""

    PARAM: ClassVar[type[KindParamRecord]]
    WHAT: ClassVar[str]  # what errors call a record: f"{WHAT} {opt}"

    deterministic: bool
    global_step: int
    params: list[P] = field(default_factory=list)
    blocking: str = "agreed"

    def json_fields(self) -> dict[str, Any]:
        return {"blocking": self.blocking, "deterministic": self.deterministic, "global_step": self.global_step,
                "params": [p.to_dict() for p in self.params]}

    def to_json(self) -> str:
        return json.dumps(self.json_fields(), sort_keys=True)

    @classmethod
    def check_frame(cls, data: dict[str, Any], what: str) -> None:
        if data.get("blocking") != "agreed":
            raise FormatError(f"{what} is not an agreed-blocking record")

    @classmethod
    def from_json(cls, raw: Any, opt: str) -> Self:
        what = f"{cls.WHAT} {opt}"
        data = loads_json(raw, what)
        with record_fields(what):
            cls.check_frame(data, what)
            return cls(bool(data["deterministic"]), int(data["global_step"]),
                       [cls.PARAM.from_dict(p) for p in data["params"]])


def record_fqns(raw: Any, what: str) -> list[str]:
    """The parameter names of an optimizer record of any kind and version
    (``gefen/optimizer/{opt}`` v1, v2 or v3, ``gefen/muon/{opt}``): which
    optimizer kind saved each parameter."""
    data = loads_json(raw, what)
    with record_fields(what):
        return [str(p["fqn"]) for p in data["params"]]


# ------------------------------------------------------------------ checks
def check_codebook(cb: torch.Tensor, what: str) -> torch.Tensor:
    """Gefen's load validation: fp32 [256], finite, sorted, ends exactly -1 and +1."""
    cb = cb.float()
    if cb.numel() != K or not torch.isfinite(cb).all() or cb[0] != -1 or cb[-1] != 1 or (cb[1:] < cb[:-1]).any():
        raise FormatError(f"{what} is corrupt (must be {K} sorted finite values from -1 to 1)")
    return cb
