"""The restricted unpickler of DCP's ``.metadata``: an interpreter of the pickle's
opcodes that runs nothing the format does not need.

Modelled on torch's weights-only unpickler (``torch/_weights_only_unpickler.py``), for the
protocols (2 to 5) ``pickle.dumps`` writes ``.metadata`` in:

* a global (GLOBAL, STACK_GLOBAL) is looked up in :data:`METADATA_GLOBALS`, never
  imported by the name the pickle gives: torch's DCP metadata classes, the
  ``_StorageInfo`` record :mod:`~raycheckpoint._internal.dcp.writer` writes,
  ``torch.Size``, the layout and memory-format lookups, ``OrderedDict``, paths, and as
  plain values torch's dtypes, layouts and memory formats; anything else is refused;
* NEWOBJ creates instances of the metadata classes only; REDUCE calls an admitted
  class or lookup only; BUILD sets state only on an instance of a metadata class;
  APPEND(S) fill lists only, SETITEM(S) dicts only, ADDITEMS sets only;
* the opcodes that reach other code (INST, OBJ, EXT*, PERSID, out-of-band buffers) and
  protocol 0's text opcodes are refused.

With ``inert=True`` every admitted global is an inert stand-in (:class:`Inert`) and no
module is imported: the same decisions, with no torch (``raycheckpoint verify``).
Entry points: :mod:`~raycheckpoint._internal.dcp.safe_pickle`.
"""

from __future__ import annotations

import importlib
import re
import struct
from collections import OrderedDict
from typing import Any

from raycheckpoint.errors import IntegrityError

CLASS, CALL, VALUE = "class", "call", "value"
DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"

# (module, name) -> what the pickle may do with it: CLASS (create instances with NEWOBJ or
# REDUCE, set their state with BUILD), CALL (REDUCE only: a constructor or a lookup with no
# side effect), VALUE (push it; never call it)
METADATA_GLOBALS: dict[tuple[str, str], str] = {
    **{(DCP_METADATA_MODULE, name): CLASS for name in (
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
        "BytesStorageMetadata", "TensorProperties", "StorageMeta")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): CLASS,  # our writer's record
    (DCP_METADATA_MODULE, "_MEM_FORMAT_ENCODING"): CALL,  # an Enum: a lookup by value
    ("torch", "Size"): CALL,
    ("torch.serialization", "_get_layout"): CALL,  # a lookup by name
    ("collections", "OrderedDict"): CALL,
    ("pathlib", "PurePosixPath"): CALL,  # StorageMeta.checkpoint_id may be a path
    ("pathlib", "PosixPath"): CALL,
}
# torch.<name> that may be a dtype, layout or memory format (pickled as a global: torch.float32)
TORCH_VALUE = re.compile(r"(q?u?int|float|bfloat|complex|bits)\w*|bool|half|double|long|short"
                         r"|c(half|float|double)|strided|sparse_\w+|_mkldnn|jagged|\w+_format")

WHAT_TO_DO = ("nothing in it was run. Restore the file from a trusted copy, or resume from "
              "another checkpoint")


class Inert:
    """What an inert unpickler puts where a global, or an object made from one, would be."""

    __slots__ = ("instance", "kind", "name")

    def __init__(self, name: str, kind: str, instance: bool = False) -> None:
        self.name, self.kind, self.instance = name, kind, instance


class _Refused(Exception):
    """The pickle does something DCP metadata never does (the message says what)."""


_MAPPINGS = (dict, OrderedDict)  # what SETITEM(S) may fill
_U32, _U64, _I32, _U16, _F64 = (struct.Struct(f) for f in ("<I", "<Q", "<i", "<H", ">d"))


class RestrictedUnpickler:
    """Interprets one pickle holding DCP metadata (see the module doc); ``rel`` names the
    file in errors.  :meth:`load` raises IntegrityError for anything refused or malformed."""

    def __init__(self, data: bytes | bytearray | memoryview, rel: str, *, inert: bool = False
                 ) -> None:
        self.data = bytes(data)
        self.rel = rel
        self.inert = inert
        self.pos = 0  # of the opcode being run, for errors
        self._globals: dict[tuple[str, str], Any] = {}
        self._kinds: dict[int, str] = {}  # id of a resolved global (kept alive here) -> kind
        self._classes: dict[type, Any] = {}  # the CLASS globals resolved -> their __setstate__
        self._state_keys: set[frozenset[str]] = set()  # BUILD states' attribute names, checked

    def load(self) -> Any:
        try:
            return self._run()
        except _Refused as e:
            raise IntegrityError(f"{self.rel}: refused to unpickle: {e} (a forged or foreign "
                                 f"file); {WHAT_TO_DO}", path=self.rel) from None
        except (IntegrityError, MemoryError):
            raise
        except Exception as e:  # noqa: BLE001 - any failure decoding the bytes is the file's
            raise IntegrityError(f"{self.rel}: unreadable pickle at byte {self.pos} "
                                 f"({type(e).__name__}: {e}); {WHAT_TO_DO}",
                                 path=self.rel) from None

    # ---- globals and the operations that call code ------------------------------------------

    def _global(self, module: Any, name: Any) -> Any:
        if type(module) is not str or type(name) is not str:
            raise _Refused("a global named by something other than strings")
        key = (module, name)
        if key in self._globals:
            return self._globals[key]
        kind = METADATA_GLOBALS.get(key)
        if kind is None and module == "torch" and TORCH_VALUE.fullmatch(name):
            kind = VALUE
        if kind is None:
            raise _Refused(f"it names {module}.{name}, which DCP metadata never holds")
        if self.inert:
            obj: Any = Inert(f"{module}.{name}", kind)
        else:
            obj = getattr(importlib.import_module(module), name, None)
            if kind == VALUE:
                import torch

                if not isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                    raise _Refused(f"it names {module}.{name}, which is no dtype, layout or "
                                   "memory format")
            elif obj is None or (kind == CLASS and not isinstance(obj, type)):
                raise _Refused(f"it names {module}.{name}, which this torch does not have")
            if kind == CLASS:
                self._classes[obj] = getattr(obj, "__setstate__", None)
        self._globals[key] = obj
        self._kinds[id(obj)] = kind
        return obj

    def _kind(self, obj: Any) -> str | None:
        if self.inert:
            return obj.kind if type(obj) is Inert and not obj.instance else None
        return self._kinds.get(id(obj))

    def _reduce(self, func: Any, args: Any) -> Any:
        if self._kind(func) not in (CLASS, CALL):
            raise _Refused(f"it calls {_describe(func)}, which is not an admitted class or "
                           "function")
        if type(args) is not tuple:
            raise _Refused("REDUCE with arguments that are not a tuple")
        if self.inert:
            return Inert(func.name, func.kind, instance=True)
        return func(*args)

    def _new(self, cls: Any, args: Any, kwargs: Any) -> Any:
        if self._kind(cls) != CLASS:
            raise _Refused(f"it creates an instance of {_describe(cls)}, which is not an "
                           "admitted class")
        if type(args) is not tuple or type(kwargs) is not dict:
            raise _Refused("NEWOBJ with arguments that are not a tuple")
        if self.inert:
            return Inert(cls.name, cls.kind, instance=True)
        return cls.__new__(cls, *args, **kwargs)

    def _build(self, inst: Any, state: Any) -> None:
        if self.inert:
            if not (type(inst) is Inert and inst.instance and inst.kind == CLASS):
                raise _Refused(f"it sets state on {_describe(inst)}")
            return
        if type(inst) not in self._classes:
            raise _Refused(f"it sets state on {_describe(inst)}, which is not an instance of "
                           "a metadata class")
        setstate = self._classes[type(inst)]
        if setstate is not None:
            setstate(inst, state)
            return
        slots = None
        if type(state) is tuple and len(state) == 2:
            state, slots = state
        for part in (state, slots):
            if part is None:
                continue
            keys = frozenset(part) if type(part) is dict else None
            if keys not in self._state_keys:
                if keys is None or not all(type(k) is str and not k.startswith("__")
                                           for k in keys):
                    raise _Refused(f"state for {type(inst).__name__} that is not a mapping of "
                                   "attribute names")
                self._state_keys.add(keys)
        if state:
            inst.__dict__.update(state)
        for k, v in (slots or {}).items():
            setattr(inst, k, v)

    # ---- the interpreter ----------------------------------------------------------------------

    def _run(self) -> Any:  # one branch per opcode, the frequent first
        data = self.data
        stack: list[Any] = []
        memo: dict[int, Any] = {}
        append, pop = stack.append, stack.pop
        marks: list[int] = []  # the floors of the enclosing MARKs
        floor = 0  # where the innermost open MARK's items begin on the stack

        def take(at: int, n: int) -> bytes:
            chunk = data[at:at + n]
            if n < 0 or len(chunk) != n:
                raise _Refused(f"truncated: {n} bytes wanted at byte {at} of {len(data)}")
            return chunk

        def top() -> Any:
            if len(stack) <= floor:
                raise _Refused("an operation on an empty stack")
            return stack[-1]

        def pop1() -> Any:
            value = top()
            pop()
            return value

        def pop_mark() -> list[Any]:
            nonlocal floor
            if not marks:
                raise _Refused("no MARK on the stack")
            items = stack[floor:]
            del stack[floor:]
            floor = marks.pop()
            return items

        pos = 0
        while True:
            self.pos = pos
            op = data[pos]
            pos += 1
            if op == 0x94:  # MEMOIZE
                if len(stack) <= floor:
                    raise _Refused("MEMOIZE on an empty stack")
                memo[len(memo)] = stack[-1]
            elif op == 0x6A:  # LONG_BINGET
                append(memo[_U32.unpack_from(data, pos)[0]])
                pos += 4
            elif op == 0x68:  # BINGET
                append(memo[data[pos]])
                pos += 1
            elif op == 0x85:  # TUPLE1
                if len(stack) <= floor:
                    raise _Refused("TUPLE1 on an empty stack")
                stack[-1] = (stack[-1],)
            elif op == 0x28:  # MARK
                marks.append(floor)
                floor = len(stack)
            elif op == 0x29:  # EMPTY_TUPLE
                append(())
            elif op == 0x4B:  # BININT1
                append(data[pos])
                pos += 1
            elif op == 0x81:  # NEWOBJ
                if len(stack) < floor + 2:
                    raise _Refused("NEWOBJ on a short stack")
                args = pop()
                stack[-1] = self._new(stack[-1], args, {})
            elif op == 0x62:  # BUILD
                if len(stack) < floor + 2:
                    raise _Refused("BUILD on a short stack")
                state = pop()
                self._build(stack[-1], state)
            elif op == 0x7D:  # EMPTY_DICT
                append({})
            elif op == 0x75:  # SETITEMS
                items = pop_mark()
                target = top()
                if type(target) not in _MAPPINGS or len(items) % 2:
                    raise _Refused(f"SETITEMS on {_describe(target)}")
                for i in range(0, len(items), 2):
                    target[items[i]] = items[i + 1]
            elif op == 0x52:  # REDUCE
                if len(stack) < floor + 2:
                    raise _Refused("REDUCE on a short stack")
                args = pop()
                stack[-1] = self._reduce(stack[-1], args)
            elif op == 0x8C:  # SHORT_BINUNICODE
                n = data[pos]
                append(take(pos + 1, n).decode("utf-8", "surrogatepass"))
                pos += 1 + n
            elif op == 0x4D:  # BININT2
                append(_U16.unpack_from(data, pos)[0])
                pos += 2
            elif op == 0x86:  # TUPLE2
                b, a = pop1(), pop1()
                append((a, b))
            elif op == 0x89:  # NEWFALSE
                append(False)
            elif op == 0x88:  # NEWTRUE
                append(True)
            elif op == 0x4E:  # NONE
                append(None)
            elif op == 0x74:  # TUPLE
                append(tuple(pop_mark()))
            elif op == 0x87:  # TUPLE3
                c, b, a = pop1(), pop1(), pop1()
                append((a, b, c))
            elif op == 0x4A:  # BININT
                append(_I32.unpack_from(data, pos)[0])
                pos += 4
            elif op == 0x5D:  # EMPTY_LIST
                append([])
            elif op in (0x65, 0x61):  # APPENDS, APPEND
                items = pop_mark() if op == 0x65 else [pop1()]
                target = top()
                if type(target) is not list:
                    raise _Refused(f"APPEND on {_describe(target)}")
                target.extend(items)
            elif op == 0x73:  # SETITEM
                value, key = pop1(), pop1()
                target = top()
                if type(target) not in _MAPPINGS:
                    raise _Refused(f"SETITEM on {_describe(target)}")
                target[key] = value
            elif op == 0x6C:  # LIST
                append(pop_mark())
            elif op == 0x64:  # DICT
                items = pop_mark()
                if len(items) % 2:
                    raise _Refused("DICT of an odd number of items")
                append({items[i]: items[i + 1] for i in range(0, len(items), 2)})
            elif op == 0x47:  # BINFLOAT
                append(_F64.unpack_from(data, pos)[0])
                pos += 8
            elif op in (0x8A, 0x8B):  # LONG1, LONG4
                n, pos = (data[pos], pos + 1) if op == 0x8A else (_I32.unpack_from(data, pos)[0],
                                                                  pos + 4)
                append(int.from_bytes(take(pos, n), "little", signed=True))
                pos += n
            elif op in (0x58, 0x8D, 0x42, 0x8E, 0x43, 0x96):  # long strings, bytes, bytearray
                size = _U64 if op in (0x8D, 0x8E, 0x96) else _U32
                if op == 0x43:  # SHORT_BINBYTES
                    n, pos = data[pos], pos + 1
                else:
                    n, pos = size.unpack_from(data, pos)[0], pos + size.size
                chunk = take(pos, n)
                pos += n
                append(chunk.decode("utf-8", "surrogatepass") if op in (0x58, 0x8D)
                       else bytearray(chunk) if op == 0x96 else chunk)
            elif op == 0x8F:  # EMPTY_SET
                append(set())
            elif op == 0x90:  # ADDITEMS
                items = pop_mark()
                target = top()
                if type(target) is not set:
                    raise _Refused(f"ADDITEMS on {_describe(target)}")
                target.update(items)
            elif op == 0x91:  # FROZENSET
                append(frozenset(pop_mark()))
            elif op in (0x71, 0x72):  # BINPUT, LONG_BINPUT
                if op == 0x71:
                    at, pos = data[pos], pos + 1
                else:
                    at, pos = _U32.unpack_from(data, pos)[0], pos + 4
                memo[at] = top()
            elif op == 0x93:  # STACK_GLOBAL
                name, module = pop1(), pop1()
                append(self._global(module, name))
            elif op == 0x63:  # GLOBAL: "module\nname\n"
                lines = data[pos:pos + 512].split(b"\n", 2)
                if len(lines) < 3:
                    raise _Refused("truncated or overlong GLOBAL")
                append(self._global(lines[0].decode("utf-8"), lines[1].decode("utf-8")))
                pos += len(lines[0]) + len(lines[1]) + 2
            elif op == 0x92:  # NEWOBJ_EX
                kwargs, args = pop1(), pop1()
                append(self._new(pop1(), args, kwargs))
            elif op == 0x30:  # POP (an item, or an empty MARK)
                if marks and floor == len(stack):
                    floor = marks.pop()
                else:
                    pop1()
            elif op == 0x31:  # POP_MARK
                pop_mark()
            elif op == 0x32:  # DUP
                append(top())
            elif op == 0x95:  # FRAME: a length to read ahead; every byte is here already
                take(pos, 8)
                pos += 8
            elif op == 0x80:  # PROTO
                if not 2 <= data[pos] <= 5:
                    raise _Refused(f"pickle protocol {data[pos]}")
                pos += 1
            elif op == 0x2E:  # STOP
                value = pop1()
                if stack or marks:
                    raise _Refused("items left on the stack at STOP")
                return value
            else:  # INST, OBJ, EXT*, PERSID, BINPERSID, out-of-band buffers, protocol 0 text
                raise _Refused(f"opcode {bytes([op])!r} at byte {pos - 1}, which DCP metadata "
                               "never uses")


def _describe(obj: Any) -> str:
    if type(obj) is Inert:
        return obj.name + (" (an instance)" if obj.instance else "")
    if isinstance(obj, type):
        return f"class {obj.__module__}.{obj.__qualname__}"
    return f"a {type(obj).__module__}.{type(obj).__qualname__}"
