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
the number. Cost: ~0.4 µs per opcode in CPython (24 ms for a 295 KB
``.metadata`` of 63,000 opcodes, which the C unpickler reads in 3 ms), so
it reads what is small (a byte entry's ``data.pkl``, a loader's state: KBs)
and ``.metadata`` only where its tuples may nest past what hashing survives;
``.metadata`` is otherwise guarded inside the C unpickler
(``unpickling.unpickle_metadata``).
"""

from __future__ import annotations

import dataclasses
import pickletools
import struct

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


# What each opcode does, as one small int per opcode byte (the loop below branches on it, most frequent first).
(_MEMO, _BINGET, _LONG_BINGET, _LEAF, _LEAF_N, _LEAF_1, _LEAF_4, _LEAF_4S, _LEAF_8, _NEW_N, _NEW_MARK, _FILL_N,
 _FILL_MARK, _MARK_OP, _POP, _POP_MARK, _DUP, _BINPUT, _LONG_BINPUT, _SKIP, _STOP, _TEXT) = range(22)
_OP = [-1] * 256  # -1: an opcode no checkpoint writer uses (NEXT_BUFFER, READWRITE_BUFFER, unknown bytes)
_N = [0] * 256  # bytes of a fixed argument, or stack items taken
for _kind, _n, _names in (
        (_MEMO, 0, "MEMOIZE"), (_BINGET, 0, "BINGET"), (_LONG_BINGET, 0, "LONG_BINGET"),
        (_LEAF, 0, "NONE NEWTRUE NEWFALSE EMPTY_LIST EMPTY_TUPLE EMPTY_DICT EMPTY_SET"),
        (_LEAF_N, 1, "BININT1 EXT1"), (_LEAF_N, 2, "BININT2 EXT2"), (_LEAF_N, 4, "BININT EXT4"),
        (_LEAF_N, 8, "BINFLOAT"), (_LEAF_1, 0, "SHORT_BINUNICODE SHORT_BINBYTES SHORT_BINSTRING LONG1"),
        (_LEAF_4, 0, "BINUNICODE BINBYTES"), (_LEAF_4S, 0, "BINSTRING LONG4"),
        (_LEAF_8, 0, "BINUNICODE8 BINBYTES8 BYTEARRAY8"),
        (_NEW_N, 1, "TUPLE1 BINPERSID"), (_NEW_N, 2, "TUPLE2 STACK_GLOBAL REDUCE NEWOBJ"),
        (_NEW_N, 3, "TUPLE3 NEWOBJ_EX"), (_NEW_MARK, 0, "TUPLE LIST DICT FROZENSET OBJ"),
        (_FILL_N, 1, "APPEND BUILD"), (_FILL_N, 2, "SETITEM"), (_FILL_MARK, 0, "APPENDS SETITEMS ADDITEMS"),
        (_MARK_OP, 0, "MARK"), (_POP, 0, "POP"), (_POP_MARK, 0, "POP_MARK"), (_DUP, 0, "DUP"),
        (_BINPUT, 0, "BINPUT"), (_LONG_BINPUT, 0, "LONG_BINPUT"), (_SKIP, 8, "FRAME"), (_SKIP, 1, "PROTO"),
        (_SKIP, 0, "READONLY_BUFFER"), (_STOP, 0, "STOP"),
        # Protocols 0-2 (torch.save writes protocol 2: GLOBAL): an argument of one line, or two (GLOBAL, INST).
        (_TEXT, 0, "INT LONG STRING UNICODE FLOAT GET PUT PERSID"), (_TEXT, 2, "GLOBAL INST")):
    for _name in _names.split():
        _c = ord(next(op for op in pickletools.opcodes if op.name == _name).code)
        _OP[_c], _N[_c] = _kind, _n
_TEXT_KINDS = {ord(op.code): op.name for op in pickletools.opcodes if op.name in
               ("INT", "LONG", "STRING", "UNICODE", "FLOAT", "GET", "PUT", "PERSID", "GLOBAL", "INST")}
_U32, _I32, _U64 = (struct.Struct(f).unpack_from for f in ("<I", "<i", "<Q"))
_OBJECT = 56  # bytes counted per object built, and 8 per reference it holds
_MARK = -1


class _Refused(Exception):
    pass


def _scan(raw: bytes, budget: Budget) -> None:
    """The opcode walk of ``check``; raises ``_Refused(what)``. One loop over locals: it runs on every
    ``.metadata`` a load reads, so each opcode costs a table lookup and a few branches. An object is
    one int in ``info``, its size (shared objects once per use) << 8 | its depth."""
    max_depth, max_string = budget.max_depth, budget.max_string
    max_bytes, max_objects = budget.bytes_for(len(raw)), budget.objects_for(len(raw))
    info: list[int] = []
    placed = bytearray()  # held by another object (then never changed again)
    stack: list[int] = []
    memo: list[int] = []  # MEMOIZE's and in-order puts
    puts: dict[int, int] = {}  # puts at other indices
    op_of, n_of = _OP, _N
    pos, end = 0, len(raw)
    while pos < end:
        c = raw[pos]
        op = op_of[c]
        pos += 1
        if op == _MEMO:
            if not stack:
                raise _Refused("a memo put on an empty stack")
            memo.append(stack[-1])
            continue
        if op == _BINGET or op == _LONG_BINGET:
            key, pos = _memo_key(raw, pos, op == _BINGET)
            if 0 <= key < len(memo):
                stack.append(memo[key])
            elif key in puts:
                stack.append(puts[key])
            else:
                raise _Refused(f"a memo get of {key}, which was never put")
            continue
        if op == _TEXT:  # rare: protocols 0-2
            op, key, pos = _text(raw, pos, c)
            if op == _BINGET:
                if key not in puts and not 0 <= key < len(memo):
                    raise _Refused(f"a memo get of {key}, which was never put")
                stack.append(puts[key] if key in puts else memo[key])
                continue
            if op == _BINPUT:
                if not stack:
                    raise _Refused("a memo put on an empty stack")
                puts[key] = stack[-1]
                continue
            length = key  # a new object from its line
        elif _LEAF <= op <= _LEAF_8:
            length = 0
            if op == _LEAF_N:
                pos += n_of[c]
            elif op == _LEAF_1:
                length = raw[pos] if pos < end else 0
                pos += 1 + length
            elif op == _LEAF_4:
                length = _U32(raw, pos)[0] if pos + 4 <= end else 0
                pos += 4 + length
            elif op == _LEAF_4S:
                length = _I32(raw, pos)[0] if pos + 4 <= end else 0
                pos += 4 + length
            elif op == _LEAF_8:
                length = _U64(raw, pos)[0] if pos + 8 <= end else 0
                pos += 8 + length
        else:
            length = -1
        if length >= 0:  # a new object from nothing
            if pos > end:
                return  # cut short: the unpickler's to refuse
            if length > max_string:
                raise _Refused(f"a string of {length:,} bytes (at most {max_string:,})")
            if len(info) >= max_objects:
                raise _Refused(f"more than {max_objects:,} objects")
            stack.append(len(info))
            info.append((_OBJECT + length) << 8 | 1)
            placed.append(0)
            continue
        if _NEW_N <= op <= _FILL_MARK:
            if op == _NEW_N or op == _FILL_N:
                n = n_of[c]
                if len(stack) < n + (op == _FILL_N):
                    raise _Refused("an opcode that pops more than the stack holds")
                children = stack[len(stack) - n:]
                del stack[len(stack) - n:]
            else:
                children = _pop_mark(stack)
            fill = op == _FILL_N or op == _FILL_MARK
            if fill:
                node = stack[-1] if stack else _MARK
                if node == _MARK or placed[node]:
                    raise _Refused("an object filled after another one took it (pickles of objects that "
                                   "contain themselves do this; no checkpoint writer makes one)")
                v = info[node]
                depth, size = (v & 255) - 1, v >> 8
            else:
                depth, size = 0, _OBJECT
            for child in children:
                if child == _MARK or (fill and child == node):
                    raise _Refused("an object that holds itself or a MARK where an object belongs")
                v = info[child]
                if (v & 255) > depth:
                    depth = v & 255
                size += 8 + (v >> 8)
                placed[child] = 1
            if depth >= max_depth:
                raise _Refused(f"objects nested more than {max_depth} deep")
            if size > max_bytes:
                raise _Refused(f"objects of more than {max_bytes:,} bytes, each shared one counted per use")
            if fill:
                info[node] = size << 8 | (depth + 1)
                continue
            if len(info) >= max_objects:
                raise _Refused(f"more than {max_objects:,} objects")
            stack.append(len(info))
            info.append(size << 8 | (depth + 1))
            placed.append(0)
        elif op == _MARK_OP:
            stack.append(_MARK)
        elif op == _BINPUT or op == _LONG_BINPUT:
            key, pos = _memo_key(raw, pos, op == _BINPUT)
            if not stack:
                raise _Refused("a memo put on an empty stack")
            if key == len(memo):
                memo.append(stack[-1])
            else:
                puts[key] = stack[-1]
        elif op == _SKIP:
            pos += n_of[c]
        elif op == _POP:
            if not stack:
                raise _Refused("a POP on an empty stack")
            stack.pop()
        elif op == _POP_MARK:
            _pop_mark(stack)
        elif op == _DUP:
            if not stack:
                raise _Refused("a DUP on an empty stack")
            stack.append(stack[-1])
        elif op == _STOP:
            return
        else:
            raise _Refused(f"opcode {c:#04x}, which no checkpoint writer uses")


def _memo_key(raw: bytes, pos: int, short: bool) -> tuple[int, int]:
    """The memo index of a BIN(GET|PUT) (one byte) or LONG_BIN(GET|PUT) (four), and the position after it;
    -1 where the pickle is cut short (no memo holds it: refused as a get, kept apart as a put)."""
    if short:
        return (raw[pos] if pos < len(raw) else -1), pos + 1
    return (_U32(raw, pos)[0] if pos + 4 <= len(raw) else -1), pos + 4


def _text(raw: bytes, pos: int, c: int) -> tuple[int, int, int]:
    """A text opcode (protocols 0-2) at ``pos``: (``_BINGET`` / ``_BINPUT`` and the memo key, or ``_LEAF``
    and its argument's length; the position after its line(s)). GLOBAL and INST take two lines; INST
    (a class called on the items above MARK) is refused: no checkpoint writer uses it."""
    name = _TEXT_KINDS[c]
    if name == "INST":
        raise _Refused("opcode INST, which no checkpoint writer uses")
    start = pos
    for _ in range(2 if name == "GLOBAL" else 1):
        pos = raw.find(b"\n", pos) + 1
        if not pos:
            return _LEAF, 0, len(raw) + 1  # cut short: the unpickler's to refuse
    if name in ("GET", "PUT"):
        try:
            key = int(raw[start:pos - 1])
        except ValueError:
            return _LEAF, 0, len(raw) + 1  # not a pickle: the unpickler's to refuse
        return (_BINGET if name == "GET" else _BINPUT), key, pos
    return _LEAF, pos - start, pos


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
