"""The disk cache of compiled kernels: a key that is the same in a new process and changes whenever the compiled
code could, for every kernel the passes lower; entries that survive damage. The load path itself runs on the
GPU (`tests/test_engine.py::test_a_second_process_loads_every_kernel_from_the_disk_cache`)."""

import subprocess
import sys
import types

import numpy as np
import pytest

from codegen.lower import kernel_cache
from codegen.lower.cuda import cuda
from runtime.synthetic import write_model
from tests.passes import PassRunner

CC = (9, 0)
ARGS = ("array(float32, 1d, C)", "int64")

FACTORY_SOURCE = '''
import math
from codegen.lower.cuda import cuda

@cuda.jit(device=True)
def scale(x, by):
    return x * by

def make(n, by):
    @cuda.jit
    def kernel(out):
        i = cuda.grid(1)
        if i < n:
            out[i] = scale(math.sqrt(out[i]), by)
    return kernel
'''


def _factory(source: str = FACTORY_SOURCE):
    module = types.ModuleType("stratum_test_factory")
    exec(compile(source, "stratum_test_factory.py", "exec"), module.__dict__)
    return module.make


def test_the_key_is_the_same_in_a_new_process():
    here = kernel_cache.key(_factory()(64, 2.0).py_func, ARGS, CC)
    script = ("from tests.test_kernel_cache import _factory, ARGS, CC\nfrom codegen.lower import kernel_cache\n"
              "print(kernel_cache.key(_factory()(64, 2.0).py_func, ARGS, CC))")
    there = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.strip()
    assert here is not None and here == there


def test_the_key_changes_with_everything_the_code_depends_on():
    make = _factory()
    base = kernel_cache.key(make(64, 2.0).py_func, ARGS, CC)
    others = [
        kernel_cache.key(make(65, 2.0).py_func, ARGS, CC),                                    # a closure value
        kernel_cache.key(make(64, 3.0).py_func, ARGS, CC),
        kernel_cache.key(make(64, 2.0).py_func, ("array(float32, 2d, C)", "int64"), CC),       # argument types
        kernel_cache.key(make(64, 2.0).py_func, ARGS, (8, 9)),                                 # the GPU
        kernel_cache.key(_factory(FACTORY_SOURCE.replace("x * by", "x * by + 1"))(64, 2.0).py_func,
                         ARGS, CC),                                                            # a device function
        kernel_cache.key(_factory(FACTORY_SOURCE.replace("math.sqrt", "math.exp"))(64, 2.0).py_func,
                         ARGS, CC),                                                            # the kernel's code
    ]
    assert None not in others and len({base, *others}) == len(others) + 1


def test_the_key_changes_with_the_jit_options():
    """Two kernels of the same code compiled with different launch bounds are different machine code."""
    function = _factory()(64, 2.0).py_func
    options = {"debug": 0, "fastmath": False, "link": (), "extensions": [], "launch_bounds": None}
    plain = kernel_cache.key(function, ARGS, CC, options)
    bounded = kernel_cache.key(function, ARGS, CC, {**options, "launch_bounds": (256, 4)})
    assert None not in (plain, bounded) and plain != bounded
    assert plain == kernel_cache.key(function, ARGS, CC, dict(reversed(options.items())))
    assert kernel_cache.key(function, ARGS, CC, {**options, "link": ("kernel.cu",)}) is None   # its contents unread


def test_a_kernel_holding_an_unknown_object_gets_no_key():
    opaque = object()

    @cuda.jit
    def kernel(out):
        out[0] = 1 if opaque is None else 2
    assert kernel_cache.key(kernel.py_func, ARGS, CC) is None


def _kernels(value, found: dict, seen: set) -> dict:
    """The jitted kernels a launch function reaches through its closures."""
    if id(value) in seen:
        return found
    seen.add(id(value))
    py_function = getattr(value, "py_func", None)
    if py_function is not None and not getattr(value, "_device", True):
        found[id(value)] = value
    function = value if isinstance(value, types.FunctionType) else None
    for cell in (function.__closure__ or ()) if function else ():
        _kernels(cell.cell_contents, found, seen)
    return found


@pytest.mark.parametrize("architecture, types_", [("qwen3moe", None),
                                                  ("glm4moe", {"experts": "q4_0", "dense": "q8_0"})])
def test_every_kernel_of_both_passes_has_a_key_of_its_own(tmp_path, architecture, types_):
    runner = PassRunner(write_model(tmp_path / "model.gguf", architecture, seed=3, types=types_), kv="q8_0",
                        max_tokens=16)
    kernels = {}
    for kind, tokens in (("prefill", 4), ("decode", 1), ("decode", 3)):
        for step in runner.program(kind, tokens).steps:
            _kernels(step.launch, kernels, set())
    keys = [kernel_cache.key(k.py_func, ARGS, CC) for k in kernels.values()]
    unreadable = [k.py_func.__qualname__ for k, key in zip(kernels.values(), keys) if key is None]
    assert len(kernels) > 10 and not unreadable
    assert len(set(keys)) == len(keys)


def test_entries_round_trip_and_damage_reads_as_a_miss(tmp_path, monkeypatch, rng):
    monkeypatch.setenv("STRATUM_KERNEL_CACHE", str(tmp_path / "kernels"))
    cubin = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
    entry_key = kernel_cache.key(_factory()(64, 2.0).py_func, ARGS, CC)
    assert kernel_cache.load(entry_key) is None
    kernel_cache.store(entry_key, "_Z6kernel", cubin)
    assert kernel_cache.load(entry_key) == ("_Z6kernel", cubin)
    (tmp_path / "kernels" / f"{entry_key}.kernel").write_bytes(b"_Z6kernel")      # cut short: no cubin
    assert kernel_cache.load(entry_key) is None
    assert list((tmp_path / "kernels").glob("*.tmp")) == []


def test_the_folder_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("STRATUM_KERNEL_CACHE", "off")
    assert kernel_cache.folder() is None
    kernel_cache.store("abc", "name", b"cubin")         # a cache that is off writes nothing anywhere
    assert kernel_cache.load("abc") is None and list(tmp_path.iterdir()) == []
    monkeypatch.delenv("STRATUM_KERNEL_CACHE")
    assert kernel_cache.folder() == tmp_path / "stratum" / "kernels"
    kernel_cache.store("abc", "name", b"cubin")
    assert kernel_cache.load("abc") == ("name", b"cubin")
