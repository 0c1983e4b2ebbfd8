"""The one codec of the control plane: a message's wire form is derived from its dataclass fields.

`encode(msg)` is the tuple of its fields in declaration order; a field annotated with a message dataclass
(alone, optional, or inside a list, tuple, set or dict) is encoded the same way, recursively; every other
value travels as it is (ints, strings, lists of them, numpy arrays, logprob rows). `decode(cls, data)`
rebuilds the instance without calling its __init__, as pickle does (no validation, no default factories:
every field is on the wire). A field added to a message travels with no edit here.

The per-class encoder and decoder are generated once, from the field list and annotations, into plain
functions (`attrgetter` when no field needs encoding): the step path is hot, and a loop over fields per
call would cost what the positional form saves. Two carriers take the tuples:
- pickle (Ray's actor calls): `@message` gives the class a __reduce__ whose state is the tuple (and a
  __setstate__ that reads it), so pickle sees one reducer per message instead of one per nested dataclass;
  pickle's memo still writes a string shared by several fields once.
- marshal (the shm transport): `dumps(msg)` / `loads(cls, data)` (or `writer(cls)` / `reader(cls)`, bound to
  the class). marshal writes lists, dicts, sets, strings and ints faster than pickle (no memo, no reducers),
  but writes anything with the buffer protocol (a numpy scalar or array) as bytes, silently. So the values a
  field's annotation says are plain are checked to be exactly plain, and the others (arrays, logprob rows,
  `Any`) travel as one pickle beside the tuple (objects shared by several fields stay shared). The check
  reads the first present item of each list, set or dict, not every item: a non-plain value comes with a
  whole container built from numpy (`list(array)` for `array.tolist()`), and a check of every item would
  cost what marshal saves. A message that fails the check, or that marshal refuses, goes whole as pickle.
  Both ends run one Python (Ray requires it), so marshal's version-specific format is no issue.

`@message(inline=False)` marks a class whose instances the parent's tuple holds as objects, which pickle
writes through their own derived __reduce__: for a value shared by several messages of one payload
(pickle's memo writes it once) or one rarely set (its parent keeps an `attrgetter` encoder).
"""

from __future__ import annotations

import copyreg
import dataclasses
import marshal
import pickle
import threading
import types
import typing
from operator import attrgetter
from typing import Any, Callable, TypeVar

_T = TypeVar("_T")
_SCALARS = frozenset({int, float, str, bool, bytes, complex, type(None)})
_SEQUENCES = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"}
PICKLED, FIELDS = 0, 1  # the first item of a marshalled message: its whole pickle, or its fields
# A dataclass field's metadata that keeps it off the wire (a cache): the receiving end gets its default.
LOCAL_ONLY = types.MappingProxyType({"wire": False})
_BY_REFERENCE: set[type] = set()  # classes marked @message(inline=False)
# pickle writes a reduce by this function as NEWOBJ (cls.__new__(cls), no global for the function itself).
_NEWOBJ: Callable[..., Any] = copyreg.__dict__["__newobj__"]

# ---- a field's annotation, as a tree of nodes ---------------------------------------------------------
# ("scalar",) | ("any",) | ("msg", cls) | ("opt", node) | ("seq", kind, node) | ("tup", nodes) |
# ("dict", key node, value node) | ("union", nodes): a union of several non-None types.
Node = tuple[Any, ...]


def _node(tp: Any) -> Node:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp in _SCALARS:
        return ("scalar",)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp) and tp not in _BY_REFERENCE:
        return ("msg", tp)
    if origin is typing.Union or origin is types.UnionType:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return ("opt", _node(rest[0]))
        return ("union", tuple(_node(a) for a in rest))
    if origin in _SEQUENCES:
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return ("tup", tuple(_node(a) for a in args)) if args else ("any",)
        return ("seq", _SEQUENCES[origin], _node(args[0]) if args else ("any",))
    if origin is dict:
        return ("dict", *(_node(a) for a in args)) if args else ("dict", ("any",), ("any",))
    return ("any",)


def _children(node: Node) -> list[Node]:
    kind = node[0]
    if kind == "opt":
        return [node[1]]
    if kind == "seq":
        return [node[2]]
    if kind in ("tup", "union"):
        return list(node[1])
    if kind == "dict":
        return [node[1], node[2]]
    return []


def _holds(node: Node, kinds: tuple[str, ...]) -> bool:
    return node[0] in kinds or any(_holds(c, kinds) for c in _children(node))


# ---- code generation ----------------------------------------------------------------------------------
class _Gen:
    """Writes one class's functions: each node becomes an expression over a variable (None: the value
    travels as it is). `env` collects the globals the generated code reads (nested codecs, helpers)."""

    def __init__(self) -> None:
        self.env: dict[str, Any] = {"_put": _put}
        self.env.update(_deep_plain=_deep_plain, _S=_SCALARS, _SEQ=frozenset(_SEQUENCES), _new=object.__new__)
        self.env.update(_LT=frozenset({list, tuple}), _load=marshal.loads, _unpickle=pickle.loads, _FIELDS=FIELDS)
        self.env.update(_dump=marshal.dumps, _pickle=_pickle, _PICKLED=PICKLED)
        self._n = 0
        self.stack: list[type] = []  # the messages being inlined, outermost first

    def fresh(self) -> str:
        self._n += 1
        return f"x{self._n}"

    def ref(self, cls: type, what: str) -> str:
        """A global name for the nested class's function `what` (encode, decode, encode_m, decode_m, plain)."""
        name = f"_{what}_{cls.__name__}_{id(cls):x}"
        self.env[name] = getattr(_codec(cls), what)
        return name

    def walk(self, node: Node, v: str, *, decode: bool, marshal_form: bool) -> str | None:
        """The expression that encodes (or decodes) the value `v` of this node; None: as it is."""
        kind = node[0]
        if kind == "scalar" or (kind in ("any", "union") and not marshal_form):
            return None
        if kind in ("any", "union"):  # marshal form: a non-plain value goes to the side pickle
            if kind == "union" and not _holds(node, ("any", "msg")):
                return None  # plain data of several shapes (str | list[str]): checked by _deep_plain
            return f"(None if {v} is None else {'side[' if decode else '_put(side, '}{v}{']' if decode else ')'})"
        if kind == "msg":
            if decode:
                what = "decode_m" if marshal_form else "decode"
                return f"{self.ref(node[1], what)}({v}{', side' if marshal_form else ''})"
            # Inlined: the nested message's fields, read in place (no call per message).
            names, nodes = _fields(node[1])
            _refuse_cycle(node[1], self.stack)
            self.stack.append(node[1])
            parts = [
                self.walk(n, f"{v}.{a}", decode=False, marshal_form=marshal_form)
                for a, n in zip(names, nodes, strict=True)
            ]
            self.stack.pop()
            return "(" + "".join(f"{p or f'{v}.{a}'}, " for a, p in zip(names, parts, strict=True)) + ")"
        if kind == "opt":
            inner = self.walk(node[1], v, decode=decode, marshal_form=marshal_form)
            if inner is None or node[1][0] in ("any", "union"):
                return inner  # None travels as it is, or the side's None
            return f"(None if {v} is None else {inner})"
        if kind == "seq":
            x = self.fresh()
            inner = self.walk(node[2], x, decode=decode, marshal_form=marshal_form)
            if inner is None:
                return None
            seq = node[1]
            if node[2][0] == "msg" and decode:  # one loop that builds them all: no frame per item
                got = f"{self.ref(node[2][1], 'decode_list_m' if marshal_form else 'decode_list')}({v}"
                got += ", side)" if marshal_form else ")"
                return got if seq == "list" else f"{seq}({got})"
            if node[2][0] == "msg" and not marshal_form:  # C's map over the class's encoder (attrgetter)
                return f"{seq}(map({self.ref(node[2][1], 'encode')}, {v}))"
            if seq == "list":
                return f"[{inner} for {x} in {v}]"
            if seq == "set":
                return f"{{{inner} for {x} in {v}}}"
            return f"{seq}([{inner} for {x} in {v}])"
        if kind == "tup":
            parts = [self.walk(n, f"{v}[{i}]", decode=decode, marshal_form=marshal_form) for i, n in enumerate(node[1])]
            if all(p is None for p in parts):
                return None
            return "(" + "".join(f"{p or f'{v}[{i}]'}, " for i, p in enumerate(parts)) + ")"
        if kind == "dict":
            x, k = self.fresh(), self.fresh()
            kv = self.walk(node[1], k, decode=decode, marshal_form=marshal_form)
            vv = self.walk(node[2], x, decode=decode, marshal_form=marshal_form)
            if kv is None and vv is None:
                return None
            return f"{{{kv or k}: {vv or x} for {k}, {x} in {v}.items()}}"
        raise AssertionError(node)

    def check(self, node: Node, v: str) -> str | None:
        """The expression that is true when marshal writes `v` faithfully (None: always)."""
        kind = node[0]
        if kind == "scalar":
            return f"type({v}) in _S"
        if kind == "any":
            return None  # goes to the side pickle
        if kind == "union":
            return None if _holds(node, ("any", "msg")) else f"_deep_plain({v})"
        if kind == "msg":  # inlined, as in walk
            scalars: list[str] = []
            parts = self._message_checks(node[1], v, "", scalars)
            if len(scalars) <= 3:
                parts[:0] = [f"type({v}.{a}) in _S" for a in scalars]
            else:  # one C call reads them all (dotted paths reach into inlined messages)
                name = f"_get{self.fresh()}"
                self.env[name] = attrgetter(*scalars)
                parts.insert(0, f"_S.issuperset(map(type, {name}({v})))")
            return "(" + (" and ".join(parts) or "True") + ")"
        if kind == "opt":
            inner = self.check(node[1], v)
            return None if inner is None else f"({v} is None or {inner})"
        if kind == "tup":
            parts = [p for i, n in enumerate(node[1]) if (p := self.check(n, f"{v}[{i}]")) is not None]
            return f"(type({v}) is tuple and len({v}) == {len(node[1])}" + "".join(f" and {p}" for p in parts) + ")"
        if kind == "seq":
            if node[1] in ("list", "tuple") and node[2][0] == "scalar":  # indexed in place: no call
                return f"(type({v}) in _LT and (not {v} or type({v}[0]) in _S))"
            return f"(type({v}) in _SEQ and {self._items(node[2], v)})"
        if kind == "dict":
            return f"(type({v}) is dict and {self._items(node[1], v)} and {self._items(node[2], f'{v}.values()')})"
        raise AssertionError(node)

    def build(self, cls: type, src: str, dst: str, lines: list[str], marshal_form: bool, new: bool = True) -> None:
        """Statements that build `dst`, an instance of cls, from the tuple `src` without its __init__ (new=False:
        fill `dst`, made already); a field that is itself a message is built in place too (no call per message)."""
        names, nodes = _fields(cls)
        klass = f"_cls_{cls.__name__}_{id(cls):x}"
        self.env[klass] = cls
        if new:
            lines.append(f"    {dst} = _new({klass})")
        targets = ", ".join(f"{dst}.{a}" for a in names)
        xs = [self.fresh() for _ in names]
        inner: list[str] = []
        parts = []
        for n, x in zip(nodes, xs, strict=True):
            if n[0] == "msg":
                _refuse_cycle(n[1], self.stack)
                self.stack.append(n[1])
                y = self.fresh()
                self.build(n[1], x, y, inner, marshal_form)
                self.stack.pop()
                parts.append(y)
            else:
                parts.append(self.walk(n, x, decode=True, marshal_form=marshal_form) or x)
        for f in _local_fields(cls):  # not on the wire: its default, as __init__ would set it
            name = f"_default_{cls.__name__}_{f.name}_{id(cls):x}"
            if f.default is not dataclasses.MISSING:
                self.env[name] = f.default
                lines.append(f"    {dst}.{f.name} = {name}")
            else:
                self.env[name] = f.default_factory
                lines.append(f"    {dst}.{f.name} = {name}()")
        if not names:
            return
        if parts == xs:
            lines.append(f"    {targets}, = {src}")
            return
        lines.append(f"    {', '.join(xs)}, = {src}")
        lines.extend(inner)
        lines.append(f"    {targets}, = {', '.join(parts)},")

    def _message_checks(self, cls: type, v: str, prefix: str, scalars: list[str]) -> list[str]:
        """The checks of cls's fields at `v.prefix...`; its scalar fields' paths go to `scalars`."""
        _refuse_cycle(cls, self.stack)
        self.stack.append(cls)
        parts = []
        for a, n in zip(*_fields(cls), strict=True):
            if n[0] == "scalar" or (n[0] == "opt" and n[1][0] == "scalar"):
                scalars.append(prefix + a)
            elif n[0] == "msg":
                parts += self._message_checks(n[1], v, f"{prefix}{a}.", scalars)
            elif (p := self.check(n, f"{v}.{prefix}{a}")) is not None:
                parts.append(p)
        self.stack.pop()
        return parts

    def _items(self, node: Node, v: str) -> str:
        if node[0] == "scalar":  # the first item (a dict's first key), None when empty: in C, no frame
            return f"type(next(iter({v}), None)) in _S"
        x = self.fresh()
        inner = self.check(node, x)
        if inner is None:
            return "True"
        if node[0] == "msg":  # messages are checked one by one: each is its own
            return f"all(map({self.ref(node[1], 'plain')}, {v}))"
        if _holds(node, ("msg",)):
            return f"all({inner} for {x} in {v} if {x} is not None)"
        if node[0] == "opt":  # _first_present skips the Nones
            inner = self.check(node[1], x) or "True"
        return f"(({x} := next(filter(None, {v}), None)) is None or {inner})"  # the first present item


def _put(side: list[Any], value: Any) -> int | None:
    if value is None:
        return None
    side.append(value)
    return len(side) - 1


def _deep_plain(v: Any) -> bool:
    t = type(v)
    if t in _SCALARS:
        return True
    if t in _SEQUENCES:
        return all(map(_deep_plain, v))
    if t is dict:
        return all(map(_deep_plain, v)) and all(map(_deep_plain, v.values()))
    return False


# ---- the per-class codec ------------------------------------------------------------------------------
class _Codec:
    """One class's generated functions: encode/decode (the pickle form: other objects stay in the tuple),
    encode_m/decode_m (the marshal form: other objects go to `side`) and plain (marshal writes it faithfully)."""

    def __init__(self, cls: type) -> None:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"kvray wire: {cls.__name__} must be a dataclass")
        if cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
            raise TypeError(f"kvray wire: {cls.__name__} must not be frozen (decode sets its fields)")
        _refuse_cycle(cls, _BUILDING)
        _BUILDING.add(cls)
        try:
            self._build(cls)
        finally:
            _BUILDING.discard(cls)
        _CODECS[cls] = self

    def _build(self, cls: type) -> None:
        names, nodes = _fields(cls)
        gen = _Gen()
        gen.stack.append(cls)
        gen.env["_cls"] = cls
        src = []

        def encoder(fn: str, marshal_form: bool) -> str:
            parts = [
                gen.walk(n, f"o.{a}", decode=False, marshal_form=marshal_form)
                for a, n in zip(names, nodes, strict=True)
            ]
            args = "o, side" if marshal_form else "o"
            body = "(" + "".join(f"{p or f'o.{a}'}, " for a, p in zip(names, parts, strict=True)) + ")"
            src.append(f"def {fn}({args}):\n    return {body}\n")
            return body

        def decoder(fn: str, marshal_form: bool) -> None:
            lines = [f"def {fn}({'t, side' if marshal_form else 't'}):"]
            gen.build(cls, "t", "o", lines, marshal_form)
            src.append("\n".join([*lines, "    return o\n"]))
            # A list of them (a step's outputs): the loop in one frame.
            lines = [f"def {fn.replace('decode', 'decode_list')}({'ts, side' if marshal_form else 'ts'}):"]
            lines += ["    out = []", "    add = out.append", "    for t in ts:"]
            body: list[str] = []
            gen.build(cls, "t", "o", body, marshal_form)
            lines += ["    " + line for line in body] + ["        add(o)", "    return out\n"]
            src.append("\n".join(lines))

        encoder("encode", False)
        decoder("decode", False)
        # pickle's form: (copyreg.__newobj__, (cls,), the tuple) -> NEWOBJ and BUILD, which calls __setstate__:
        # one global (the class) and one call to load, as a class's own __init__ would cost.
        fill = ["def fill(o, t):", "    if type(o) is not _cls:", "        return _fill_any(o, t)"]
        gen.build(cls, "t", "o", fill, False, new=False)
        src.append("\n".join(fill) + "\n")
        src.append(
            "def reduce(o):\n    if type(o) is not _cls:\n        return _reduce_any(o)\n"
            "    return (_newobj, (_cls,), _encode(o))\n"
        )
        tuple_m = encoder("encode_m", True)
        decoder("decode_m", True)
        # The marshal form's readers, from marshal's bytes or its loaded tuple: decode_m's body inlined (the
        # step's hot path), the side pickle read first.
        for fn, get in (("read", "_load(data)"), ("read_form", "data")):
            lines = [
                f"def {fn}(data):",
                f"    kind, t, side = {get}",
                "    if kind != _FIELDS:",
                "        return _unpickle(t)",
            ]
            lines.append("    if side is not None:\n        side = _unpickle(side)")
            gen.build(cls, "t", "o", lines, True)
            src.append("\n".join([*lines, "    return o\n"]))
        gen.stack.pop()
        plain = gen.check(("msg", cls), "o")
        src.append(f"def plain(o):\n    return {plain}\n")
        # The marshal form's writer: plain's and encode_m's bodies inlined; the side pickle only where some
        # value (here or in a nested message) goes there.
        has_side = "_put(side" in tuple_m
        write = ["def write(o):", "    try:", f"        if type(o) is _cls and {plain}:"]
        if has_side:
            write += ["            side = []", f"            t = {tuple_m}"]
            write += ["            return _dump((_FIELDS, t, _pickle(side) if side else None))"]
        else:
            write += [f"            return _dump((_FIELDS, {tuple_m}, None))"]
        write += [
            "    except ValueError:  # marshal's 'unmarshallable object' (past the first items checked)",
            "        pass",
        ]
        write += ["    return _dump((_PICKLED, _pickle(o), None))\n"]
        src.append("\n".join(write))
        code = "\n".join(src)
        exec(compile(code, f"<kvray wire: {cls.__qualname__}>", "exec"), gen.env)  # our own source
        self.source = code
        self.encode: Callable[[Any], tuple[Any, ...]] = gen.env["encode"]
        if len(names) > 1 and not any(_holds(n, ("msg",)) for n in nodes):
            self.encode = attrgetter(*names)  # nothing to encode: the C getter builds the tuple
        self.decode: Callable[[Any], Any] = gen.env["decode"]
        self.encode_m: Callable[[Any, list[Any] | None], tuple[Any, ...]] = gen.env["encode_m"]
        self.decode_m: Callable[[Any, Any], Any] = gen.env["decode_m"]
        self.decode_list: Callable[[Any], list[Any]] = gen.env["decode_list"]
        self.decode_list_m: Callable[[Any, Any], list[Any]] = gen.env["decode_list_m"]
        self.plain: Callable[[Any], bool] = gen.env["plain"]
        gen.env["_encode"] = self.encode
        gen.env.update(_newobj=_NEWOBJ, _fill_any=_fill_any, _reduce_any=_reduce_any)
        self.fill: Callable[[Any, tuple[Any, ...]], None] = gen.env["fill"]
        if getattr(cls.__reduce__, "wire_reducer", False):  # @message (or a subclass): bind its own pair
            reduce = gen.env["reduce"]
            reduce.wire_reducer = True
            cls.__reduce__, cls.__setstate__ = reduce, self.fill  # type: ignore[method-assign,attr-defined]
        self.write: Callable[[Any], bytes] = gen.env["write"]
        self.read: Callable[[bytes | memoryview], Any] = gen.env["read"]
        self.read_form: Callable[[tuple[Any, ...]], Any] = gen.env["read_form"]


_CODECS: dict[type, _Codec] = {}
_FIELDS_OF: dict[type, tuple[list[str], list[Node]]] = {}
_BUILDING: set[type] = set()  # the classes whose codec is being generated (a cycle among them is refused)
# Codecs are built on first use, and a driver actor serves several clients' calls on as many threads: two
# threads building one class's codec at once would each see the other's class "being generated" and call it
# a cycle. One re-entrant lock: a codec builds its nested classes' codecs on the same thread.
_BUILD_LOCK = threading.RLock()


def _fields(cls: type) -> tuple[list[str], list[Node]]:
    """The class's field names in declaration order and their annotations' nodes (LOCAL_ONLY fields left out)."""
    got = _FIELDS_OF.get(cls)
    if got is None:
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls) if f.metadata.get("wire", True)]
        got = _FIELDS_OF[cls] = (names, [_node(hints[n]) for n in names])
    return got


def _local_fields(cls: type) -> list[dataclasses.Field[Any]]:
    local = [f for f in dataclasses.fields(cls) if not f.metadata.get("wire", True)]
    for f in local:
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise TypeError(f"kvray wire: {cls.__name__}.{f.name} is LOCAL_ONLY: it needs a default to be rebuilt with")
    return local


def _refuse_cycle(cls: type, stack: Any) -> None:
    if cls in stack:
        raise TypeError(f"kvray wire: {cls.__name__} holds itself (a tree of messages travels, not a graph)")


def _codec(cls: type) -> _Codec:
    codec = _CODECS.get(cls)
    if codec is not None:
        return codec
    with _BUILD_LOCK:
        codec = _CODECS.get(cls)  # another thread may have built it while this one waited
        return codec if codec is not None else _Codec(cls)


# ---- the API ------------------------------------------------------------------------------------------
def encode(msg: Any) -> tuple[Any, ...]:
    """The message's fields in declaration order, nested messages as tuples too."""
    return _codec(type(msg)).encode(msg)


def decode(cls: type[_T], data: tuple[Any, ...]) -> _T:
    """The instance of cls that `encode` wrote as data."""
    out: _T = _codec(cls).decode(data)
    return out


def _reduce_any(self: Any) -> tuple[Callable[..., Any], tuple[type], tuple[Any, ...]]:
    """A message's __reduce__ until its codec is built (which binds the class's own, see _Codec)."""
    cls = type(self)
    return _NEWOBJ, (cls,), _codec(cls).encode(self)


def _fill_any(self: Any, data: tuple[Any, ...]) -> None:
    """A message's __setstate__ until its codec is built."""
    _codec(type(self)).fill(self, data)


_reduce_any.wire_reducer = True  # type: ignore[attr-defined]


def message(cls: type[_T] | None = None, *, inline: bool = True) -> Any:
    """Class decorator: the class pickles through this codec. inline=False: see the module docstring."""

    def mark(c: type[_T]) -> type[_T]:
        if not dataclasses.is_dataclass(c):
            raise TypeError(f"kvray wire: @message {c.__name__} must be a dataclass (put @message above @dataclass)")
        if c.__dataclass_params__.frozen:  # type: ignore[attr-defined]
            raise TypeError(f"kvray wire: @message {c.__name__} must not be frozen (decode sets its fields)")
        c.__reduce__, c.__setstate__ = _reduce_any, _fill_any  # type: ignore[method-assign,attr-defined]
        if not inline:
            _BY_REFERENCE.add(c)
        return c

    return mark if cls is None else mark(cls)


def dumps(msg: Any) -> bytes:
    """A message in marshal's bytes: (FIELDS, its tuple, the side pickle or None), or (PICKLED, its pickle,
    None) when it holds values marshal would not write faithfully."""
    return _codec(type(msg)).write(msg)


def loads(cls: type[_T], data: bytes | memoryview) -> _T:
    """The message of class cls that `dumps` wrote."""
    out: _T = _codec(cls).read(data)
    return out


def writer(cls: type[_T]) -> Callable[[_T], bytes]:
    """`dumps` for messages of class cls, bound to its codec (a transport's hot path: no lookup per call)."""
    return _codec(cls).write


def reader(cls: type[_T]) -> Callable[[bytes | memoryview], _T]:
    """`loads` for messages of class cls, bound to its codec."""
    return _codec(cls).read


def form_reader(cls: type[_T]) -> Callable[[tuple[Any, ...]], _T]:
    """`loads` after marshal.loads: for a transport that frames the form in its own tuple."""
    return _codec(cls).read_form


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
