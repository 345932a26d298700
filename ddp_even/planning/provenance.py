"""What a count reused across epochs or jobs was computed from, so that it is checked before use.

A count computed once and used later (the rows a predicate keeps, cached on disk; a plan worked
out from footers; a saved loader state) holds only while the things it was computed from are
unchanged: the data (its files and footers), the reader settings that decide what is read and
in which order, the code of a predicate or a transform, the batch size, the sharding, the
number of ranks. :class:`Provenance` names those things, each by a short digest, so that a
reused count can be checked where it is used and a mismatch named in one line.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import pickle
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Provenance", "UnidentifiableError", "Untold", "code_identity"]


class UnidentifiableError(ValueError):
    """``obj`` shows neither its code nor its state (a C object whose repr names only its
    address): anything keyed by it could not tell it from another, so nothing is."""


# How deep references are followed (a function calling a function ...); deeper code counts
# by its qualified name only.
_MAX_DEPTH = 8


def code_identity(obj: Any) -> bytes:
    """A digest of what ``obj`` computes: equal in every process for the same code and values.

    Code counts by what it does, not by where it lives: a function by its bytecode, constants
    and names, its defaults, the values its closure holds, and the globals it reads (functions
    among them recursively, modules by name); an object by its state and the code of the
    methods it is called by and of those they reach through ``self``; a ``functools.partial``
    by its function and arguments, a bound method (also a builtin's, such as
    ``{1, 2}.__contains__``) by what it is bound to. A mutable global (a list the function
    appends to, a counter, a logger) counts by its type only, since it changes while the job
    runs: data that decides what a predicate keeps belongs in a default, a closure or an
    immutable global. Line numbers, comments and formatting do not change the identity (pickling
    by reference, as ``dill`` does, would miss an edit to an importable function). Raises
    :class:`UnidentifiableError` for an object that shows neither code nor state.

    Example::

        >>> def keep(x):
        ...     return x % 3 != 0
        >>> def keep_edited(x):
        ...     return x % 4 != 0
        >>> code_identity(keep) == code_identity(keep_edited)
        False
    """
    return hashlib.sha256(_identity(obj, set(), 0)).digest()


# Values that count by their repr, and code, which counts by what it does.
_VALUES = (bool, int, float, complex, str, bytes)
_CODE = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)


def _identity(obj: Any, seen: set[int], depth: int) -> bytes:
    if obj is None or isinstance(obj, _VALUES):
        return type(obj).__name__.encode() + b":" + repr(obj).encode()
    if id(obj) in seen or depth > _MAX_DEPTH:
        return b"ref:" + _name_of(obj)
    seen = seen | {id(obj)}
    deeper = depth + 1
    if isinstance(obj, types.ModuleType):
        return b"module:" + obj.__name__.encode()
    if isinstance(obj, types.FunctionType):
        return _function_identity(obj, seen, deeper)
    if isinstance(obj, types.MethodType):
        bound = _identity(obj.__self__, seen, deeper)
        return b"method:" + _identity(obj.__func__, seen, deeper) + bound
    if isinstance(obj, types.CodeType):
        return _code_identity(obj, seen, deeper)
    if isinstance(obj, functools.partial):
        return (
            b"partial:"
            + _identity(obj.func, seen, deeper)
            + _identity(obj.args, seen, deeper)
            + _identity(obj.keywords, seen, deeper)
        )
    if isinstance(obj, _BUILTIN_CALLABLES):
        owner = getattr(obj, "__self__", None)
        # A builtin method bound to a value (``{1, 2}.__contains__``) computes with it.
        unbound = owner is None or isinstance(owner, types.ModuleType)  # a module's function
        bound_to = b"" if unbound else _identity(owner, seen, deeper)
        return b"builtin:" + _name_of(obj) + bound_to
    if isinstance(obj, type):
        return b"name:" + _name_of(obj)
    if isinstance(obj, list | tuple):
        return (
            type(obj).__name__.encode()
            + b"["
            + b",".join(_identity(item, seen, deeper) for item in obj)
            + b"]"
        )
    if isinstance(obj, set | frozenset):
        return b"set{" + b",".join(sorted(_identity(item, seen, deeper) for item in obj)) + b"}"
    if isinstance(obj, Mapping):
        items = sorted(
            (_identity(key, seen, deeper), _identity(value, seen, deeper))
            for key, value in obj.items()
        )
        return b"map{" + b",".join(key + b"=" + value for key, value in items) + b"}"
    if isinstance(obj, np.ndarray):
        return b"array:" + str(obj.dtype).encode() + repr(obj.shape).encode() + obj.tobytes()
    return _object_identity(obj, seen, deeper)


_BUILTIN_CALLABLES = (
    types.BuiltinFunctionType,
    types.MethodWrapperType,
    types.WrapperDescriptorType,
    types.MethodDescriptorType,
)


def _function_identity(function: types.FunctionType, seen: set[int], depth: int) -> bytes:
    parts = [
        b"function:" + _name_of(function),
        _code_identity(function.__code__, seen, depth),
        _identity(function.__defaults__, seen, depth),
        _identity(function.__kwdefaults__, seen, depth),
    ]
    for cell in function.__closure__ or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell (a name bound later)
            parts.append(b"empty-cell")
        else:
            parts.append(_identity(contents, seen, depth))
    for name in sorted(_global_names(function.__code__)):
        if name in function.__globals__:
            value = function.__globals__[name]
            described = (
                _identity(value, seen, depth)
                if _is_fixed(value)
                else b"state:" + _name_of(type(value))
            )
            parts.append(name.encode() + b"=" + described)
    return b"|".join(parts)


def _is_fixed(value: Any) -> bool:
    """Whether a global is code or an immutable value, which counts in full (a mutable one
    counts by its type: see :func:`code_identity`)."""
    if isinstance(value, tuple | frozenset):
        return all(_is_fixed(item) for item in value)
    return value is None or isinstance(value, _VALUES + _CODE)


def _code_identity(code: types.CodeType, seen: set[int], depth: int) -> bytes:
    constants = b",".join(_identity(constant, seen, depth) for constant in code.co_consts)
    return b"code:" + code.co_code + b"|" + constants + b"|" + ",".join(code.co_names).encode()


def _global_names(code: types.CodeType) -> set[str]:
    """Names a code object (and the code nested in it) may read from its globals."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _global_names(constant)
    return names


def _object_identity(obj: Any, seen: set[int], depth: int) -> bytes:
    """An instance: its class, its state, and the code of the methods it is called by
    (``__call__``; a petastorm predicate's ``do_include`` and ``get_fields``) and of every
    method of its class those reach through ``self``."""
    parts = [b"object:" + _name_of(type(obj))]
    state = _state_of(obj)
    if state is not None:
        parts.append(_identity(state, seen, depth))
    methods = _methods_identity(type(obj), seen, depth)
    parts.extend(methods)
    if state is None and not methods:
        # A C object: what it holds is what pickling it keeps (an itemgetter its keys), where
        # it pickles; one that does not (a lock, a ufunc made by frompyfunc) cannot be told
        # from another of its type.
        try:
            parts.append(pickle.dumps(obj, protocol=4))
        except Exception as error:
            raise UnidentifiableError(
                f"{type(obj).__module__}.{type(obj).__qualname__} shows neither its code nor "
                f"its state, and does not pickle ({error})"
            ) from error
    return b"|".join(parts)


# The methods an object is called by: any callable's __call__, and petastorm's predicate
# protocol (its reader calls get_fields, then do_include on every row group).
_ENTRY_METHODS = ("__call__", "do_include", "get_fields")


def _methods_identity(cls: type, seen: set[int], depth: int) -> list[bytes]:
    """The code of ``cls``'s entry methods and of every method, property or static method of
    ``cls`` they reach by name (any attribute their code loads: ``self.helper()``,
    ``super().do_include()``), each definition along the MRO, named by where it is defined."""
    found: dict[bytes, bytes] = {}
    wanted = list(_ENTRY_METHODS)
    followed: set[str] = set()
    while wanted:
        name = wanted.pop()
        if name in followed:
            continue
        followed.add(name)
        for base in cls.__mro__:
            if base is object:
                continue
            for function in _functions_of(vars(base).get(name)):
                where = _name_of(base) + b"." + name.encode()
                found[where] = _function_identity(function, seen, depth)
                wanted.extend(_global_names(function.__code__) - followed)
    return [where + b"=" + code for where, code in sorted(found.items())]


def _functions_of(attribute: Any) -> list[types.FunctionType]:
    """The Python functions behind a class attribute: a method, a static or class method, a
    property's accessors; none for anything else (a value, a C method)."""
    if isinstance(attribute, staticmethod | classmethod):
        attribute = attribute.__func__
    if isinstance(attribute, property):
        accessors = [attribute.fget, attribute.fset, attribute.fdel]
        return [accessor for accessor in accessors if isinstance(accessor, types.FunctionType)]
    return [attribute] if isinstance(attribute, types.FunctionType) else []


def _state_of(obj: Any) -> dict[str, Any] | None:
    """An instance's fields: a dataclass's, or its ``__dict__`` and ``__slots__``."""
    if dataclasses.is_dataclass(obj):
        return {field.name: getattr(obj, field.name) for field in dataclasses.fields(obj)}
    state = getattr(obj, "__dict__", None)
    slots: list[str] = []
    for cls in type(obj).__mro__:
        declared = cls.__dict__.get("__slots__", ())
        slots.extend([declared] if isinstance(declared, str) else declared)
    slots = [name for name in slots if name not in ("__dict__", "__weakref__")]
    if slots:
        state = dict(state or {})
        state.update({name: getattr(obj, name) for name in slots if hasattr(obj, name)})
    return state


def _name_of(obj: Any) -> bytes:
    module = getattr(obj, "__module__", None) or type(obj).__module__
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}.{name}".encode()


@dataclass(frozen=True)
class Untold:
    """A part of a provenance that its source hides (a process pool keeps a reader's seed in
    its worker processes): a count or state that names one cannot be checked against it."""

    why: str


_UNTOLD = "untold: "


@dataclass(frozen=True)
class Provenance:
    """What something reused was computed from: named parts, each a short digest.

    A part given as :class:`Untold` (or whose code cannot be identified) is kept as what hides
    it: :meth:`compare` lists it apart from the parts that differ.

    Example::

        >>> saved = Provenance.of(data=b"footers v1", batch_size=4, seed=7)
        >>> now = Provenance.of(data=b"footers v1", batch_size=8, seed=Untold("a process pool"))
        >>> saved.compare(now)
        (['batch_size'], ['seed'])
        >>> saved.compare(saved)
        ([], [])
    """

    parts: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, **parts: Any) -> Provenance:
        """Each part's value digested (code by :func:`code_identity`)."""
        return cls(tuple((name, _short(value)) for name, value in parts.items()))

    @classmethod
    def from_dict(cls, parts: Mapping[str, str]) -> Provenance:
        """A provenance read back from :meth:`as_dict` (a saved state holds it so)."""
        return cls(tuple((str(name), str(value)) for name, value in parts.items()))

    def as_dict(self) -> dict[str, str]:
        return dict(self.parts)

    def compare(self, other: Provenance) -> tuple[list[str], list[str]]:
        """``(differ, untold)``: the parts whose values differ from ``other``'s (or that only
        one of the two has), and the parts that either cannot tell, each in order. When the
        ``reader`` differs, it alone differs: another reader's parts mean other things (and
        some it has not at all), so naming them would say what is not so."""
        ours, theirs = dict(self.parts), dict(other.parts)
        differ: list[str] = []
        untold: list[str] = []
        for name in [*ours, *(name for name in theirs if name not in ours)]:
            values = (ours.get(name), theirs.get(name))
            if any(value is not None and value.startswith(_UNTOLD) for value in values):
                untold.append(name)
            elif values[0] != values[1]:
                differ.append(name)
        return (["reader"] if "reader" in differ else differ), untold

    def untold(self) -> dict[str, str]:
        """The parts this provenance cannot tell, with what hides each."""
        return {
            name: value.removeprefix(_UNTOLD)
            for name, value in self.parts
            if value.startswith(_UNTOLD)
        }


def _short(value: Any) -> str:
    if isinstance(value, Untold):
        return _UNTOLD + value.why
    try:
        return hashlib.sha256(_identity(value, set(), 0)).hexdigest()[:16]
    except UnidentifiableError as error:
        return _UNTOLD + str(error)
