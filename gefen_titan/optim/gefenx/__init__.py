"""The one place that reads and writes gefen-x's private optimizer state,
and the one package that imports gefen-x at all (``lint-imports`` checks it):
Gefen's accessors in ``gefen``, GefenMuon's in ``muon``, the CPU kernel's hook into
their steps in ``routing``, the classification of their constructors' keywords in
``constructor``, all re-exported here
(callers use ``from gefen_titan.optim import gefenx as gx``). Names say whose
state they touch: ``family``'s are unprefixed (every gefen-x optimizer keeps
them: ``gx.period``, ``gx.codebook``, ``gx.global_step``, ``gx.named_params``),
Gefen's own are ``gefen_*`` (``gx.gefen_read``, ``GefenParamState``) and
GefenMuon's ``muon_*`` (``gx.muon_read``, ``gx.muon_sharded_step``); a kind's
constructor and test are ``new_<kind>`` / ``is_<kind>``.

gefen-x 0.5.0 keeps what a checkpoint needs outside any public API: per
parameter ``automatic_period``, ``step``, ``vmean_step``, ``m_codebook``
(uint8 ``[blocks, period]``), ``m_magnitude`` and ``vmean`` (fp32
``[blocks, 1]``) in ``optim.state[p]``, and per optimizer ``_gefen_codebook``
(fp32 ``[256]``), its per-device caches and ``_gefen_global_step`` as
attributes. Every other module of gefen_titan (the registry's factory, the
agreement hook, the checkpoint adapters, the validation hook) goes through
the functions here, so a change of gefen-x's internals is fixed in one file.
``is_gefen`` is exact: gefen-x's subclasses keep other state. GefenMuon's
(``automatic_period``, ``step``, ``m_codebook``, ``m_magnitude``, NorMuon's
``normuon_v`` [rows, 1] and ``normuon_step``; no ``vmean``) and the pieces of
its step that ``gefen_titan.optim.muon`` drives on shards (the momentum
update, Newton-Schulz, NorMuon, the apply) are the ``muon_*`` functions of
the last section.
``tests/unit/test_contract_gefen.py`` pins, against the real gefen-x, every fact
this module relies on (it reads the internals raw on purpose: it is the
specification of this module). ``docs/gefen_internals.md`` explains them.
"""

from __future__ import annotations

# Each part's ``__all__`` is the one list of what it exports; the package
# re-exports them (a star import takes exactly a module's ``__all__``).
from gefen_titan.optim.gefenx import constructor as _constructor_part
from gefen_titan.optim.gefenx import family as _family_part
from gefen_titan.optim.gefenx import gefen as _gefen_part
from gefen_titan.optim.gefenx import muon as _muon_part
from gefen_titan.optim.gefenx import routing as _routing_part
from gefen_titan.optim.gefenx.constructor import *  # noqa: F403
from gefen_titan.optim.gefenx.family import *  # noqa: F403
from gefen_titan.optim.gefenx.gefen import *  # noqa: F403
from gefen_titan.optim.gefenx.muon import *  # noqa: F403
from gefen_titan.optim.gefenx.routing import *  # noqa: F403

__all__ = [*_constructor_part.__all__, *_family_part.__all__, *_gefen_part.__all__, *_muon_part.__all__,
           *_routing_part.__all__]
