"""Shared fixtures: a tiny random-weight GGUF model for most tests, the real SmolLM2 for a few.

Every engine a test makes through `make_llm` is checked at teardown: the page pool must be whole
again (nothing in use, free + in use == total)."""

from __future__ import annotations

import faulthandler
import importlib.util
import json
import os
import shutil
import sys
import tempfile

import numpy as np
import pytest


GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "smollm2")


def pytest_unconfigure(config):
    """A test that leaves a live server or thread behind must not hang the run after it has passed
    (CI once waited 90 minutes on an unstopped gRPC aio server): if the process has not exited two
    minutes after pytest is done, print every thread's stack and exit non-zero."""
    if hasattr(config, "workerinput"):  # an xdist worker waits, idle, until the other workers finish: not a hang
        return
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAXCB_TEST_XLA_CACHE"], ignore_errors=True)
    faulthandler.dump_traceback_later(120, exit=True, file=sys.__stderr__)


# XLA:CPU's dot library (jaxcb.device.cpu_dots): jaxlib's default in this process and every server and CLI the
# tests start, so that their outputs compare on any CPU (auto would measure an unknown CPU at the first
# engine and might pick another library). tests/test_cpu_dots.py covers auto and forces each library.
os.environ.setdefault("JAXCB_CPU_DOTS", "default")

# The weights' huge pages (jaxcb.device.huge_pages): a second of collapsing per real model, on a thread
# beside the tests of a 2-core machine; tests/test_huge_pages.py turns them on.
os.environ.setdefault("JAXCB_HUGE_PAGES", "0")

# The tests' own programs (references, eager ops, the engine's small helper programs) compile as the
# engine's "fast" mode does, in this process only: most of them run once, and compiling was most of the
# in-process test time (the two native-kernel test files: 55 s -> 29 s). Engine steps still compile as
# their config says (jaxcb.device.runner.COMPILER_OPTIONS spells "optimized" out, so the real models'
# steps are those users get). XLA reads XLA_FLAGS when its backend starts: the dot choice's flags go in
# first (as the engine's start does), the backend starts, and the environment that servers and CLIs
# the tests start inherit is put back as it was.
import jax  # noqa: E402

from jaxcb.device import cpu_dots  # noqa: E402

jax.config.update("jax_disable_most_optimizations", True)
cpu_dots.setup()
_flags = os.environ.get("XLA_FLAGS")
# (XLA:CPU's flag only where JAX runs on the CPU: on a GPU or TPU VM the tests run on the accelerator.)
_ACCELERATOR = any(importlib.util.find_spec(p) for p in ("jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu"))
if not _ACCELERATOR or os.environ.get("JAX_PLATFORMS") == "cpu":
    os.environ["XLA_FLAGS"] = f"{_flags or ''} --xla_cpu_use_fusion_emitters=false"
jax.devices()
if _flags is None:
    os.environ.pop("XLA_FLAGS", None)
else:
    os.environ["XLA_FLAGS"] = _flags


# One persistent compile cache for the whole test session: made by the first pytest process (the xdist
# controller, or a lone pytest), inherited by its workers and by every server and CLI they start, so that
# a step shape compiled once is loaded, not compiled again, by every later engine with the same model and
# config. Loads count as compilations (jaxcb.device.runner.compilation_count), so "nothing compiled after
# warm-up" still means no program was made after it. Not the user's ~/.cache; removed at the end.
if "JAXCB_TEST_XLA_CACHE" not in os.environ:
    os.environ["JAXCB_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="jaxcb-test-xla-")
    _OWN_CACHE = True
else:
    _OWN_CACHE = False
os.environ["JAXCB_COMPILE_CACHE"] = os.environ["JAXCB_TEST_XLA_CACHE"]
os.environ["JAXCB_CPU_DOTS_CACHE"] = os.path.join(os.environ["JAXCB_TEST_XLA_CACHE"], "cpu-dots.json")


@pytest.fixture(scope="session", autouse=True)
def compile_cache_dir():
    """The session's compile cache, in use in this process too (engines built in-process by the tests)."""
    from jaxcb.device import compile_cache

    path = compile_cache.enable(os.environ["JAXCB_TEST_XLA_CACHE"])
    assert path is not None
    return path


# Every compiled program XLA:CPU keeps holds about 27 memory maps of JIT code and data (measured: 300 small
# programs kept, 8,613 maps; dropped, 538), and jit caches keep every program a test file made (an engine's
# steps now go with its runner, jaxcb.device.runner.step_functions; other jitted functions' stay). Past Linux's
# vm.max_map_count (65,530 by default) the next mmap fails and XLA segfaults compiling or serializing: a test
# worker got there after some 800 tests (stop 60's CI lost its run to it, pytest-xdist then hanging). So each
# test file's programs are let go when it ends, and within a file once they hold a third of the limit
# (test_families.py alone reached 32,624 maps); a test after which they cannot be let go fails, naming itself.
def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


MAX_MAPS = _read_int("/proc/sys/vm/max_map_count")  # (None where /proc does not say: nothing is checked)


def _maps() -> int:
    """This process's memory maps."""
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def _let_go_of_compiled_programs() -> None:
    import gc

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="module", autouse=True)
def _programs_of_each_file():
    yield
    _let_go_of_compiled_programs()


@pytest.fixture(autouse=True)
def _programs_within_the_map_limit(request):
    yield
    if MAX_MAPS is not None and _maps() > MAX_MAPS / 3:
        _let_go_of_compiled_programs()
        maps = _maps()
        assert maps < MAX_MAPS / 2, (f"{request.node.nodeid} left this process holding {maps} memory maps of the "
                                     f"{MAX_MAPS} vm.max_map_count allows: compiled programs kept alive past it")


@pytest.fixture(scope="session")
def tiny_gguf_path(tmp_path_factory):
    from tests.tiny_gguf import write_tiny_gguf  # (the gguf package's writer: only where a GGUF is written)

    path = str(tmp_path_factory.mktemp("models") / "tiny.gguf")
    write_tiny_gguf(path)
    return path


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    """The small server config (server_util.SMALL_CONFIG) as a file, for `jaxcb serve` processes."""
    from tests.server_util import SMALL_CONFIG

    path = tmp_path_factory.mktemp("server") / "small.toml"
    path.write_text(SMALL_CONFIG)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model(tiny_gguf_path):
    from jaxcb.llm import load_model

    return load_model(tiny_gguf_path)


@pytest.fixture
def make_llm(tiny_model):
    """make_llm(**engine_config) -> LLM on the tiny model; pools are checked whole at teardown."""
    from jaxcb.host.engine_config import make_config
    from jaxcb.llm import LLM

    made = []

    def make(model=None, **config):
        config.setdefault("num_pages", 256)
        config.setdefault("max_context", 256)
        config.setdefault("decode_batch", (1, 2, 4, 8))
        config.setdefault("prefill_tokens", (16, 32, 64))
        from tests.server_util import compile_mode  # (server_util imports gRPC: only where servers are tested)

        cfg, params, tok, eos = model or tiny_model
        config.setdefault("compile", compile_mode(cfg))
        config_obj = make_config(**config)
        llm = LLM.from_params(cfg, params, tok, config=config_obj, eos_ids=eos)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        assert not llm.engine.has_work(), "a test left requests in the engine"
        llm.engine.pool.check_all_free()
        if llm.engine.window_group is not None:
            llm.engine.window_group.pool.check_all_free()


@pytest.fixture(scope="session")
def gemma3_model():
    from jaxcb.llm import load_model

    return load_model("gemma3-270m")


@pytest.fixture(scope="session")
def smollm2_model():
    import jax.numpy as jnp

    from jaxcb.llm import load_model

    return load_model(dtype=jnp.float32)  # (float32 on an accelerator too, where the default is bfloat16)


@pytest.fixture(scope="session")
def golden():
    with open(GOLDEN + ".json") as f:
        data = json.load(f)
    data["prefill_logits"] = np.load(GOLDEN + "_prefill_logits.npz")["logits"]
    return data


# The longest test files first (measured: `make test` prints the slowest tests): xdist's --dist loadfile
# hands files to its two workers in collection order (the Makefile turns off xdist's own reordering by
# test count, which put the one-test stress and mesh files last, each running alone at the end while the
# other worker waited), so a long file collected last would leave one worker running alone at the end.
LONGEST_FIRST = ("test_cpu_dots.py", "test_speculative.py", "test_stress.py", "test_kernels.py", "test_quant.py",
                 "test_parallel.py", "test_multihost.py", "test_model_parity.py", "test_server.py", "test_gemma3.py",
                 "test_engine.py", "test_paged_attention.py", "test_openai_api.py", "test_export.py", "test_lora.py",
                 "test_cli.py", "test_families.py", "test_native_matmul.py", "test_parallel_golden.py",
                 "test_routing.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))


# Where a test's time goes: with JAXCB_TEST_TIMES=FILE, each test appends one JSON line to FILE with its
# wall time, the seconds JAX spent tracing, lowering and compiling (or loading from the compile cache)
# and the number of programs compiled in this process (servers and CLIs a test starts are not counted). For finding what to cut.
_TIMES = os.environ.get("JAXCB_TEST_TIMES")
_JAX_SECONDS: dict[str, float] = {}


@pytest.fixture(autouse=True)
def _time_jax_work(request):
    if not _TIMES:
        yield
        return
    import time

    import jax

    if not _JAX_SECONDS:
        _JAX_SECONDS["installed"] = 0.0

        def listen(event, seconds, **kwargs):
            _JAX_SECONDS[event] = _JAX_SECONDS.get(event, 0.0) + seconds
            if event.endswith("backend_compile_duration"):
                _JAX_SECONDS["compiles"] = _JAX_SECONDS.get("compiles", 0.0) + 1

        jax.monitoring.register_event_duration_secs_listener(listen)
    before, start = dict(_JAX_SECONDS), time.perf_counter()
    yield
    wall = time.perf_counter() - start
    spent = {k.rsplit("/", 1)[-1]: round(v - before.get(k, 0.0), 2) for k, v in _JAX_SECONDS.items()
             if k != "installed" and v - before.get(k, 0.0) > 0.05}  # and "compiles": how many programs
    with open(_TIMES, "a") as f:
        f.write(json.dumps({"test": request.node.nodeid, "wall": round(wall, 2), **spent}) + "\n")
