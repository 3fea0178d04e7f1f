"""Budgets on what a checkpoint's pickle may build, checked on its opcodes before anything is unpickled.

The allowlists of ``unpickling`` keep a pickle from running code, but a pickle
of allowed types alone can still take a reader down:

* **depth**: a tuple nested a million levels deep is 1 MB of opcodes, and
  Python's ``hash`` of it (a dict key, a set) recurses in C until the
  process segfaults, inside ``Unpickler.load()``;
* **sharing**: one large string referred to 2,000 times through a memo is
  2,000 references to unpickle, but every allowed constructor that copies
  its arguments (``pathlib``'s paths, ``torch.Size``, ``OrderedDict``)
  copies it per use (a 286 KB ``.metadata`` cost 1.5 GB that way);
* **count and length**: objects and strings as many and as long as the
  bytes allow.

``check`` walks the opcodes once (no object is built) and keeps, for every
object the pickle would build, its depth and its size counting a shared
object once per use. Both are exact as they go because an object is never
changed after it was placed in another one: a pickler fills a container
before its parent takes it (only pickles of objects that contain themselves
do otherwise, and no checkpoint writer makes one), so a pickle that does it
anyway is refused. A budget exceeded, or an opcode outside what checkpoint
writers use, is ``OverBudgetError`` naming the file or entry, the budget and
the number. Cost: ~0.7 µs per opcode in CPython (42 ms for a 295 KB
``.metadata`` of 63,000 opcodes, which the C unpickler then reads in 4 ms;
2026-12-06, AMD EPYC Zen 4): the price of reading a hostile pickle without
a C scanner, paid once per reader per load.
"""

from __future__ import annotations

import dataclasses
import pickletools

from gefen_titan.checkpoint.errors import GefenCheckpointError

__all__ = ["Budget", "OverBudgetError", "METADATA", "ENTRY", "LOADER", "check"]

MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Budget:
    """What one pickle may build. ``max_bytes`` and ``max_objects`` grow with the pickle's own length
    (``per_byte`` each), so a large honest save passes and a small hostile one cannot amplify."""

    max_depth: int = 64  # DCP's .metadata is 7 deep, a loader's state ~8, an LR scheduler's 5 (measured)
    max_string: int = 1 * MIB  # one str or bytes: names and paths are < 4 KB
    base_bytes: int = 64 * MIB  # built size (shared objects once per use), plus bytes_per_byte per pickle byte
    bytes_per_byte: int = 64  # DCP's .metadata builds ~7 bytes per byte of pickle (measured; 2026-12-06)
    base_objects: int = 1 << 20
    objects_per_byte: float = 0.5  # DCP's .metadata builds ~0.2 objects per byte

    def bytes_for(self, length: int) -> int:
        return self.base_bytes + self.bytes_per_byte * length

    def objects_for(self, length: int) -> int:
        return self.base_objects + int(self.objects_per_byte * length)


METADATA = Budget()
ENTRY = Budget(max_string=256 * MIB)  # a byte entry may hold a loader's state as one bytes object
LOADER = Budget()


class OverBudgetError(GefenCheckpointError):
    """A pickle in a checkpoint would build more than its budget allows: it was not unpickled."""

    check = "pickle budgets"

    def __init__(self, where: str, what: str, source: str = "") -> None:
        self.where, self.what, self.source = where, what, source
        in_ckpt = f"checkpoint {source}: " if source else ""
        super().__init__(
            f"{in_ckpt}{where}: {what}, beyond what a checkpoint's pickle may build (a reader would run out of "
            "memory or crash): refused before unpickling it. No save of gefen-titan or torchtitan writes this "
            "(edited, or damaged): restore the checkpoint from a copy or resume from another step. Nothing was "
            "loaded.")

    def __reduce__(self) -> tuple:  # pickled to every rank by DCP's gather: keep the fields
        return type(self), (self.where, self.what, self.source), self.__dict__


# What each opcode does to the stack, by kind (the byte's index in _KIND): its arity where it has one.
_LEAF, _NEW, _NEW_MARKED, _FILL, _FILL_MARKED, _MARK_OP, _POP, _POP_MARK, _DUP, _PUT, _MEMOIZE, _GET, _NOOP, \
    _STOP = range(14)
_KINDS = {
    _LEAF: ("INT BININT BININT1 BININT2 LONG LONG1 LONG4 STRING BINSTRING SHORT_BINSTRING BINBYTES SHORT_BINBYTES "
            "BINBYTES8 BYTEARRAY8 UNICODE SHORT_BINUNICODE BINUNICODE BINUNICODE8 NONE NEWTRUE NEWFALSE FLOAT "
            "BINFLOAT EMPTY_LIST EMPTY_TUPLE EMPTY_DICT EMPTY_SET GLOBAL PERSID EXT1 EXT2 EXT4"),
    _NEW: "TUPLE1 TUPLE2 TUPLE3 STACK_GLOBAL BINPERSID REDUCE NEWOBJ NEWOBJ_EX",  # from the top n
    _NEW_MARKED: "TUPLE LIST DICT FROZENSET INST OBJ",  # from the items above MARK
    _FILL: "APPEND SETITEM BUILD",  # the object below the top n takes them
    _FILL_MARKED: "APPENDS SETITEMS ADDITEMS",  # the object below MARK takes the items above it
    _MARK_OP: "MARK", _POP: "POP", _POP_MARK: "POP_MARK", _DUP: "DUP", _PUT: "PUT BINPUT LONG_BINPUT",
    _MEMOIZE: "MEMOIZE", _GET: "GET BINGET LONG_BINGET", _NOOP: "PROTO FRAME READONLY_BUFFER", _STOP: "STOP",
}
_ARITY = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3, "STACK_GLOBAL": 2, "BINPERSID": 1, "REDUCE": 2, "NEWOBJ": 2,
          "NEWOBJ_EX": 3, "APPEND": 1, "SETITEM": 2, "BUILD": 1}
_KIND = [-1] * 256  # -1: an opcode no checkpoint writer uses (NEXT_BUFFER, READWRITE_BUFFER, unknown bytes)
_N = [0] * 256  # how many stack items it takes (_NEW, _FILL)
_ARG = [0] * 256  # its argument: n > 0 bytes; -1 a line (-6: two); -2/-3/-4/-5 a length of 1/4s/4/8 bytes first
_OPS = {op.name: op for op in pickletools.opcodes}
for _kind, _names in _KINDS.items():
    for _name in _names.split():
        _op = _OPS[_name]
        _c = ord(_op.code)
        _KIND[_c], _N[_c] = _kind, _ARITY.get(_name, 0)
        _ARG[_c] = 0 if _op.arg is None else (-6 if _op.arg.name == "stringnl_noescape_pair" else _op.arg.n)
_OBJECT = 56  # bytes counted per object built, and 8 per reference it holds
_MARK = -1


class _Refused(Exception):
    pass


def _scan(raw: bytes, budget: Budget) -> None:
    """The opcode walk of ``check``; raises ``_Refused(what)``. One loop with locals: this runs on every
    ``.metadata`` a load reads, so it is kept to a few operations per opcode."""
    max_depth, max_string = budget.max_depth, budget.max_string
    max_bytes, max_objects = budget.bytes_for(len(raw)), budget.objects_for(len(raw))
    depth: list[int] = []
    size: list[int] = []
    placed: list[bool] = []  # held by another object (then never changed again)
    stack: list[int] = []
    memo: dict[int, int] = {}
    pos, end = 0, len(raw)
    while pos < end:
        c = raw[pos]
        pos += 1
        kind, arg = _KIND[c], _ARG[c]
        length = 0
        if arg > 0:
            start, pos = pos, pos + arg
        elif arg == -2:
            length = raw[pos] if pos < end else 0
            pos += 1 + length
        elif arg == -3 or arg == -4:
            length = int.from_bytes(raw[pos:pos + 4], "little", signed=arg == -3)
            pos += 4 + length
        elif arg == -5:
            length = int.from_bytes(raw[pos:pos + 8], "little")
            pos += 8 + length
        elif arg < 0:
            start = pos
            for _ in range(2 if arg == -6 else 1):
                pos = raw.find(b"\n", pos) + 1
                if not pos:
                    return  # truncated: the unpickler's to refuse
            length = pos - start
        if pos > end or length < 0:
            return  # truncated: the unpickler's to refuse
        if kind == _MEMOIZE or kind == _PUT:
            if not stack:
                raise _Refused("a memo put on an empty stack")
            key = len(memo) if kind == _MEMOIZE else (int(raw[start:pos - 1]) if arg == -1
                                                       else int.from_bytes(raw[start:pos], "little"))
            memo[key] = stack[-1]
        elif kind == _GET:
            key = int(raw[start:pos - 1]) if arg == -1 else int.from_bytes(raw[start:pos], "little")
            if key not in memo:
                raise _Refused(f"a memo get of {key}, which was never put")
            stack.append(memo[key])
        elif kind == _LEAF or kind == _NEW or kind == _NEW_MARKED:
            if length > max_string:
                raise _Refused(f"a string of {length:,} bytes (at most {max_string:,})")
            if kind == _LEAF:
                children: list[int] = []
            elif kind == _NEW:
                n = _N[c]
                if len(stack) < n:
                    raise _Refused("an opcode that pops more than the stack holds")
                children = stack[len(stack) - n:]
                del stack[len(stack) - n:]
            else:
                children = _pop_mark(stack)
            d, s = 0, _OBJECT + length + 8 * len(children)
            for child in children:
                if child == _MARK:
                    raise _Refused("a MARK where an object belongs")
                if depth[child] > d:
                    d = depth[child]
                s += size[child]
                placed[child] = True
            node = len(depth)
            if node >= max_objects:
                raise _Refused(f"more than {max_objects:,} objects")
            if d >= max_depth:
                raise _Refused(f"objects nested more than {max_depth} deep")
            if s > max_bytes:
                raise _Refused(f"objects of more than {max_bytes:,} bytes, each shared one counted per use")
            depth.append(d + 1)
            size.append(s)
            placed.append(False)
            stack.append(node)
        elif kind == _FILL or kind == _FILL_MARKED:
            if kind == _FILL:
                n = _N[c]
                if len(stack) < n + 1:
                    raise _Refused("an opcode that pops more than the stack holds")
                children = stack[len(stack) - n:]
                del stack[len(stack) - n:]
            else:
                children = _pop_mark(stack)
            node = stack[-1] if stack else _MARK
            if node == _MARK or placed[node]:
                raise _Refused("an object filled after another one took it (pickles of objects that contain "
                               "themselves do this; no checkpoint writer makes one)")
            d, s = depth[node], size[node]
            for child in children:
                if child == _MARK or child == node:
                    raise _Refused("an object that holds itself or a MARK")
                if depth[child] >= d:
                    d = depth[child] + 1
                s += 8 + size[child]
                placed[child] = True
            if d > max_depth:
                raise _Refused(f"objects nested more than {max_depth} deep")
            if s > max_bytes:
                raise _Refused(f"objects of more than {max_bytes:,} bytes, each shared one counted per use")
            depth[node], size[node] = d, s
        elif kind == _MARK_OP:
            stack.append(_MARK)
        elif kind == _POP:
            if not stack:
                raise _Refused("a POP on an empty stack")
            stack.pop()
        elif kind == _POP_MARK:
            _pop_mark(stack)
        elif kind == _DUP:
            if not stack:
                raise _Refused("a DUP on an empty stack")
            stack.append(stack[-1])
        elif kind == _STOP:
            return
        elif kind != _NOOP:
            raise _Refused(f"opcode {c:#04x}, which no checkpoint writer uses")


def _pop_mark(stack: list[int]) -> list[int]:
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] == _MARK:
            out = stack[i + 1:]
            del stack[i:]
            return out
    raise _Refused("an opcode that pops to a MARK the stack does not hold")


def check(raw: bytes | bytearray | memoryview, where: str, source: str = "", budget: Budget = METADATA) -> None:
    """Raise ``OverBudgetError`` unless the pickle ``raw`` stays within ``budget`` (module docstring).

    ``where`` names the file or entry in the message, ``source`` the checkpoint. Bytes that are no
    pickle at all (cut short) are left to the unpickler to refuse as damaged.
    """
    try:
        _scan(bytes(raw), budget)
    except _Refused as e:
        raise OverBudgetError(where, str(e), source) from None
