"""Compiled kernels kept on disk, so a new process loads them in milliseconds instead of compiling (a minute).

numba's own cache cannot serve this project: its kernels are closures over shapes and over other compiled
functions, which numba refuses to cache. Here a kernel's key is a digest of everything its machine code
depends on:

- the kernel's Python code, read recursively: its bytecode and constants, the values its closure holds and
  the globals its code names (numbers, enums, named tuples, numpy arrays, and the device functions it calls,
  read the same way);
- its argument types, its jit options (launch bounds, fastmath...), the GPU's compute capability, and the
  Python, numba, numba-cuda and llvmlite versions.

A kernel whose code holds something this module cannot read (an arbitrary object) gets no key and is compiled
as before; so does any file that fails to load. Entries are written whole (a temporary file, then a rename),
so two processes compiling at once cannot leave half a file.

The folder is `$STRATUM_KERNEL_CACHE`, else `$XDG_CACHE_HOME/stratum/kernels`, else
`~/.cache/stratum/kernels`; `STRATUM_KERNEL_CACHE=off` turns the cache off.
"""

import dataclasses
import enum
import hashlib
import os
import sys
import tempfile
import types
from importlib import metadata
from pathlib import Path

import numpy as np

SCHEMA = 2      # bump when the entry format or the key's recipe changes


class Unreadable(Exception):
    """The kernel's code holds a value whose effect on the compiled code this module cannot describe."""


def folder() -> Path | None:
    """Where entries live, or None when the cache is off."""
    chosen = os.environ.get("STRATUM_KERNEL_CACHE")
    if chosen is not None:
        return None if chosen.strip().lower() in ("", "off", "0", "no") else Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "stratum" / "kernels"


def key(py_function, argument_types, compute_capability, options: dict | None = None) -> str | None:
    """The digest naming one compiled kernel, or None when its code or its jit `options` (the dispatcher's
    targetoptions: launch bounds, fastmath, linked files...) cannot be read (see the module's notes)."""
    parts = [f"schema {SCHEMA}", _toolchain(), f"cc {tuple(compute_capability)}",
             "args " + ", ".join(map(str, argument_types))]
    try:
        parts.append("options " + ", ".join(f"{name}={_option(value)}"
                                            for name, value in sorted((options or {}).items())))
        parts.append(_describe(py_function, set()))
    except Unreadable:
        return None
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _option(value) -> str:
    """A jit option as text: plain values and sequences of them (a linked file would need its contents read)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (tuple, list)) and all(v is None or isinstance(v, (bool, int, float)) for v in value):
        return repr(tuple(value))
    raise Unreadable(f"jit option {value!r}")


def load(entry_key: str | None) -> tuple[str, bytes] | None:
    """(entry function name, cubin) stored under the key, or None."""
    path = _path(entry_key)
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except OSError:
        return None
    name, sep, cubin = data.partition(b"\0")
    return (name.decode(), cubin) if sep and cubin else None


def store(entry_key: str | None, name: str, cubin: bytes) -> None:
    """Keep a compiled kernel; a cache that cannot be written (read-only home, full disk) is skipped."""
    path = _path(entry_key)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".tmp") as handle:
            handle.write(name.encode() + b"\0" + bytes(cubin))
        os.replace(handle.name, path)
    except OSError:
        return


def _path(entry_key: str | None) -> Path | None:
    root = folder()
    return None if root is None or entry_key is None else root / f"{entry_key}.kernel"


def _toolchain() -> str:
    versions = []
    for package in ("numba", "numba-cuda", "llvmlite"):
        try:
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{package} absent")
    return f"python {sys.version_info[:3]}; " + "; ".join(versions)


def _describe(value, seen: set) -> str:
    """Text that changes whenever `value`'s effect on compiled code can change."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}={value.value!r}"
    if isinstance(value, (np.generic, np.dtype)):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, np.ndarray):
        return f"ndarray {value.dtype} {value.shape} {hashlib.sha256(np.ascontiguousarray(value)).hexdigest()}"
    if isinstance(value, (tuple, list, frozenset)):
        items = sorted(map(repr, value)) if isinstance(value, frozenset) else [_describe(v, seen) for v in value]
        return f"{type(value).__name__}({', '.join(items)})"
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    if isinstance(value, type) and value.__module__ in ("builtins", "numpy"):     # np.int32(...) in a kernel
        return f"class {value.__module__}.{value.__qualname__}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = (f"{f.name}={_describe(getattr(value, f.name), seen)}" for f in dataclasses.fields(value))
        return f"{type(value).__qualname__}({', '.join(fields)})"
    if isinstance(value, types.FunctionType):
        return _describe_function(value, seen)
    definition = getattr(value, "_defn", None)         # a numba intrinsic: its typing function holds its codegen
    if isinstance(definition, types.FunctionType):
        return f"intrinsic {_describe_function(definition, seen)}"
    py_function = getattr(value, "py_func", None)      # a numba dispatcher (a kernel or a device function)
    if isinstance(py_function, types.FunctionType):
        return f"jit {_describe_function(py_function, seen)}"
    if _is_numba_type(value):
        return f"numba type {value!r}"
    raise Unreadable(f"{type(value).__qualname__} {value!r}")


def _describe_function(function: types.FunctionType, seen: set) -> str:
    name = f"{function.__module__}.{function.__qualname__}"
    if id(function) in seen:        # recursion, or a helper already described in this key
        return f"function {name} (above)"
    seen.add(id(function))
    code = function.__code__
    closure = [_describe(cell.cell_contents, seen) for cell in function.__closure__ or ()]
    named = [f"{n}={_describe(function.__globals__[n], seen)}" for n in _global_names(code)
             if n in function.__globals__]
    return (f"function {name} code {_describe_code(code)} closure [{'; '.join(closure)}] "
            f"globals [{'; '.join(named)}] defaults {_describe(function.__defaults__, seen)}")


def _describe_code(code: types.CodeType) -> str:
    consts = (_describe_code(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts)
    return f"{code.co_code.hex()} consts ({', '.join(consts)}) names {code.co_names}"


def _global_names(code: types.CodeType) -> list[str]:
    """Every name a code object and the code nested in it may look up (attribute names included: a global
    that happens to share one is described too, which costs nothing)."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_global_names(const))
    return sorted(set(names))


def _is_numba_type(value) -> bool:
    return any(cls.__module__.startswith("numba.core.types") for cls in type(value).__mro__)
