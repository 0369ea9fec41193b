"""How XLA:CPU runs the dots jaxcb leaves to it: the dot library, the ISA ceiling and the compute dtype,
chosen per CPU before JAX starts its CPU backend, and reported (start banner, GetServerInfo).

jaxlib ships optional dot libraries behind XLA_FLAGS (YNNPACK, its default in 0.10.2; XNNPACK; oneDNN;
XLA's own emitter); which is fastest depends on the CPU (on an AMD EPYC with AVX-512 the default measured
fastest and oneDNN did not compile the layer scan; other CPUs are measured once where they run). XLA
reads XLA_FLAGS once, when its CPU backend starts, so the choice is made here, in plain Python with no
JAX import, and written into the environment before the first device call.

The choice, in order: `--cpu-dots` / `[model] cpu_dots` / $JAXCB_CPU_DOTS naming a library; dot flags the
user already put in XLA_FLAGS (kept, reported as such); the rule for CPU families measured before; for any
other CPU a one-off measurement (a subprocess per library timing the model-shaped dot scan below),
cached in ~/.cache/jaxcb/cpu-dots.json by CPU model, flags and jaxlib version.

    python -m jaxcb.device.cpu_dots              # what auto chooses here, and why
    python -m jaxcb.device.cpu_dots --measure    # run the measurement (every library, this CPU) and cache it
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import platform
import subprocess
import sys

from jaxcb.host.engine_config import CPU_DOTS_CHOICES
from jaxcb.host.errors import InvalidConfig

# jaxlib 0.10.2 compiles dots into YNNPACK fusions by default; the others are reached by clearing that
# and naming theirs (checked in the compiled HLO by tests/test_cpu_dots.py).
CHOICES = CPU_DOTS_CHOICES  # the one list, with the other config choices
LIBRARIES = CHOICES[1:]
_NO_YNN = "--xla_cpu_experimental_ynn_fusion_type="
FLAGS = {"default": (),  # whatever this jaxlib does (0.10.2: YNNPACK fusions)
         "ynn": ("--xla_cpu_experimental_ynn_fusion_type=dot",),
         "xnn": (_NO_YNN, "--xla_cpu_use_xnnpack=true"),  # plain dot ops, run by XNNPACK where it takes them
         "onednn": (_NO_YNN, "--xla_cpu_use_onednn=true", "--xla_cpu_experimental_onednn_fusion_type=dot"),
         "eigen": (_NO_YNN, "--xla_cpu_use_xnnpack=false")}  # XLA's own dot emitter
DOT_FLAG_PREFIXES = ("--xla_cpu_experimental_onednn_fusion_type", "--xla_cpu_experimental_xnn_fusion_type",
                     "--xla_cpu_experimental_ynn_fusion_type", "--xla_cpu_max_isa", "--xla_cpu_use_onednn",
                     "--xla_cpu_use_xnnpack")
AMX_CAP = "AVX512_BF16"  # the ISA ceiling where the CPU lists AMX but the kernel does not grant it
MARGIN = 1.10  # a library other than XLA's default must measure at least this much faster to be chosen
ENV = "JAXCB_CPU_DOTS"


@dataclasses.dataclass(frozen=True)
class CpuInfo:
    vendor: str
    model: str
    flags: frozenset
    amx_usable: bool

    @property
    def key(self) -> str:
        """What a cached measurement is valid for: the CPU and the jaxlib that measured it."""
        return hashlib.sha256(f"{self.vendor}|{self.model}|{sorted(self.flags)}|{_jaxlib_version()}".encode()
                              ).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class DotChoice:
    library: str  # one of LIBRARIES, or "xla_flags" when the user's XLA_FLAGS set it
    isa: str  # the --xla_cpu_max_isa ceiling, "" = everything the CPU has
    compute_dtype: str  # the CPU's compute dtype (the engine's default for --dtype)
    reason: str

    def xla_flags(self) -> tuple[str, ...]:
        flags = FLAGS.get(self.library, ())
        return flags + ((f"--xla_cpu_max_isa={self.isa}",) if self.isa else ())

    def describe(self) -> str:
        return f"{self.library}, isa {self.isa or 'all'}, compute {self.compute_dtype} ({self.reason})"


_applied: DotChoice | None = None


def cpu_info(cpuinfo: str | None = None) -> CpuInfo:
    """The CPU's vendor, model name and flags (/proc/cpuinfo's first processor)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    fields = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = frozenset(fields.get("flags", "").split())
    return CpuInfo(vendor=fields.get("vendor_id", platform.machine()), model=fields.get("model name", ""),
                   flags=flags, amx_usable="amx_tile" in flags and _amx_granted())


def _amx_granted() -> bool:
    """Whether the kernel supports AMX tile data for user processes (ARCH_GET_XCOMP_SUPP, bit 18): a VM can
    list `amx_tile` in /proc/cpuinfo and still not grant it (llama.cpp built for it dies with SIGILL)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        mask = ctypes.c_uint64(0)
        if libc.syscall(158, 0x1021, ctypes.byref(mask)) != 0:  # SYS_arch_prctl, ARCH_GET_XCOMP_SUPP
            return False
        return bool(mask.value & (1 << 18))
    except (OSError, AttributeError):
        return False


def _jaxlib_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jaxlib")
    except PackageNotFoundError:
        return "?"


def rule(info: CpuInfo) -> tuple[str, str] | None:
    """The library for a CPU family measured before (`python -m jaxcb.device.cpu_dots --measure`), with why;
    None = not known: measure it."""
    if info.vendor == "AuthenticAMD" and "avx512f" in info.flags:
        return "default", "AMD with AVX-512: no library measured 10% faster than jaxlib's default"
    return None


def cache_path() -> str:
    """$JAXCB_CPU_DOTS_CACHE, else jaxcb/cpu-dots.json under $XDG_CACHE_HOME (default ~/.cache)."""
    if os.environ.get("JAXCB_CPU_DOTS_CACHE"):
        return os.environ["JAXCB_CPU_DOTS_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxcb", "cpu-dots.json")


def _user_dot_flags() -> list[str]:
    return [f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith(DOT_FLAG_PREFIXES)]


def _accelerator_expected() -> bool:
    """JAX_PLATFORMS names no CPU first, or the machine has a GPU or TPU device node: the engine will not
    compute on the CPU, so a measurement would be wasted."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0] != "cpu"
    import glob

    return any(glob.glob(p) for p in ("/dev/nvidia[0-9]*", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*"))


def choose(setting: str | None = None, *, info: CpuInfo | None = None, measure: bool = True) -> DotChoice:
    """The dot settings for this process: `setting` (a library, or "auto"/None) else $JAXCB_CPU_DOTS."""
    if setting in (None, "auto"):  # a library named by the flag or config comes before the environment
        setting = os.environ.get(ENV) or "auto"
    if setting not in CHOICES:
        raise InvalidConfig(f"cpu_dots: {setting!r} is not one of {CHOICES}")
    info = info or cpu_info()
    isa = AMX_CAP if "amx_tile" in info.flags and not info.amx_usable else ""
    compute = "float32"  # bfloat16 ran slower than float32 on every CPU measured (--measure --dtypes ...)
    if setting != "auto":
        failure = probe(setting, isa) if setting != "default" else None
        if failure:
            raise InvalidConfig(f"cpu_dots: {setting!r} does not run on this CPU ({failure}); use \"auto\" or "
                             f"another of {LIBRARIES}")
        return DotChoice(setting, isa, compute, "asked for")
    user = _user_dot_flags()
    if user:
        return DotChoice("xla_flags", "", compute, "set in XLA_FLAGS: " + " ".join(user))
    known = rule(info)
    if known is not None:
        return DotChoice(known[0], isa, compute, known[1])
    cached = _read_cache().get(info.key)
    if cached is None and measure and not _accelerator_expected():
        cached = measure_libraries(isa)
        _write_cache(info.key, cached)
    if cached is None:
        return DotChoice("default", isa, compute, "CPU not measured yet")
    return DotChoice(pick(cached), isa, compute, "measured on this CPU: " + _summary(cached))


def pick(rates: dict) -> str:
    """The library with the best float32 rates (geometric mean over the measured row counts), if it beats
    XLA's default by MARGIN; else the default."""
    def score(lib):
        vals = [v for k, v in rates.get(lib, {}).items() if k.startswith("float32")]
        return math.prod(vals) ** (1 / len(vals)) if vals else 0.0

    best = max(LIBRARIES, key=score)
    return best if score(best) >= MARGIN * score("default") else "default"


def _summary(rates: dict) -> str:
    return ", ".join(f"{lib} {rates[lib].get('float32@32', 0):.0f}/{rates[lib].get('float32@512', 0):.0f}"
                     for lib in LIBRARIES if lib in rates) + " GFLOP/s at 32/512 rows"


def _read_cache() -> dict:
    try:
        with open(cache_path()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, rates: dict) -> None:
    data = _read_cache()
    data[key] = rates
    try:
        os.makedirs(os.path.dirname(cache_path()), exist_ok=True)
        tmp = cache_path() + f".{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, cache_path())
    except OSError as e:
        print(f"jaxcb: warning: cannot write {cache_path()} ({e}); the dot measurement will run again",
              file=sys.stderr)


def backend_started() -> bool:
    """Whether this process's XLA backends (which read XLA_FLAGS once) have started."""
    xb = sys.modules.get("jax._src.xla_bridge")
    return bool(xb is not None and getattr(xb, "_backends", None))


def apply(choice: DotChoice) -> DotChoice:
    """Put the choice's flags into XLA_FLAGS for the CPU backend about to start; returns what holds in
    this process (the choice, or if the backend already started, what its XLA_FLAGS said then)."""
    global _applied
    if _applied is not None:
        return _applied
    if backend_started():
        _applied = _from_xla_flags("JAX had started before the choice: ")
        return _applied
    extra = [f for f in choice.xla_flags() if f not in os.environ.get("XLA_FLAGS", "").split()]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS", "")] + extra))
    _applied = choice
    return choice


def setup(setting: str | None = None) -> DotChoice:
    """choose + apply: what the CLI and the Python API call before the engine's first device call."""
    if _applied is not None:
        return _applied
    return apply(choose(setting))


def current() -> DotChoice:
    """What this process runs with (after setup; else what XLA_FLAGS says)."""
    if _applied is not None:
        return _applied
    return _from_xla_flags("no choice made: ")


def _from_xla_flags(why: str) -> DotChoice:
    """What XLA_FLAGS alone gives: the operator's dot flags, or XLA's defaults."""
    flags = _user_dot_flags()
    return DotChoice("xla_flags" if flags else "default", "", "float32", why + (" ".join(flags) or "XLA's defaults"))


# --- the measurement: a subprocess per library, since XLA_FLAGS is read once per process ---

def measure_libraries(isa: str = "", rows=(32, 512), dtypes=("float32",), layers=30, k=576, n=1536,
                      libraries=LIBRARIES, quiet: bool = False) -> dict:
    """GFLOP/s of a scan of `layers` (rows x k) @ (k x n) @ (n x k) dot pairs per library and dtype,
    keyed "dtype@rows"; a library that fails to run is left out."""
    out = {}
    for lib in libraries:
        rates, error = _run_worker(lib, isa, rows, dtypes, (layers, k, n))
        if rates:
            out[lib] = rates
        elif not quiet:
            print(f"jaxcb: dot library {lib} did not run here: {error}", file=sys.stderr)
    return out


def probe(library: str, isa: str = "") -> str | None:
    """None if `library` compiles and runs a small layer scan on this CPU, else why not (oneDNN's dot
    fusion in jaxlib 0.10.2 dies with SIGILL on the AMD VMs): run in a subprocess, as a failure can kill
    the process. Cached with the measurements."""
    key = f"probe:{cpu_info().key}:{library}:{isa}"
    cache = _read_cache()
    if key not in cache:
        rates, error = _run_worker(library, isa, (8,), ("float32",), (2, 64, 128))
        cache[key] = None if rates else (error or "no result")
        _write_cache(key, cache[key])
    return cache[key]


def _run_worker(lib, isa, rows, dtypes, shape) -> tuple[dict, str]:
    env = dict(os.environ, XLA_FLAGS=" ".join(
        [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DOT_FLAG_PREFIXES)]
        + list(DotChoice(lib, isa, "float32", "").xla_flags())), JAX_PLATFORMS="cpu")
    env.pop(ENV, None)
    cmd = [sys.executable, "-m", "jaxcb.device.cpu_dots", "--worker", "--rows", *map(str, rows),
           "--dtypes", *dtypes, "--shape", *map(str, shape)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    except subprocess.TimeoutExpired:
        return {}, "timed out after 600 s"
    lines = proc.stdout.strip().splitlines()
    rates = json.loads(lines[-1]) if proc.returncode == 0 and lines else {}
    if rates:
        return rates, ""
    err = [l for l in proc.stderr.strip().splitlines() if "libtpu" not in l]
    if proc.returncode < 0:
        import signal

        why = f"killed by {signal.Signals(-proc.returncode).name}"
    else:
        why = f"exit {proc.returncode}"
    return {}, f"{why}: {' | '.join(err[-2:])[-300:]}"


def _worker(rows, dtypes, layers, k, n) -> dict:
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((layers, k, n)).astype(np.float32) / np.sqrt(k)
    w2 = rng.standard_normal((layers, n, k)).astype(np.float32) / np.sqrt(n)
    rates = {}
    for dtype in dtypes:
        if dtype == "int8":  # int8 weights with a float32 scale per column, dequantized inside the step
            s1, s2 = np.abs(w1).max(1, keepdims=True) / 127, np.abs(w2).max(1, keepdims=True) / 127
            ws = (jnp.asarray(np.round(w1 / s1).astype(np.int8)), jnp.asarray(s1),
                  jnp.asarray(np.round(w2 / s2).astype(np.int8)), jnp.asarray(s2))

            def layer(h, w):
                a = h @ (w[0].astype(jnp.float32) * w[1])
                return h + jax.nn.silu(a) @ (w[2].astype(jnp.float32) * w[3])
            cdt = jnp.float32
        else:
            cdt = jnp.dtype(dtype)
            ws = (jnp.asarray(w1, cdt), jnp.asarray(w2, cdt))

            def layer(h, w):
                return h + jax.nn.silu(h @ w[0]) @ w[1]

        step = jax.jit(lambda x, ws: jax.lax.scan(lambda h, w: (layer(h, w), None), x, ws)[0])
        for m in rows:
            x = jnp.asarray(rng.standard_normal((m, k)), cdt)
            try:
                step(x, ws).block_until_ready()
            except Exception as e:  # a library that cannot compile this (oneDNN on some CPUs): no rate
                print(f"{dtype} at {m} rows: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                continue
            best = float("inf")
            for _ in range(7):
                t = time.perf_counter()
                step(x, ws).block_until_ready()
                best = min(best, time.perf_counter() - t)
            rates[f"{dtype}@{m}"] = round(4 * m * k * n * layers / best / 1e9, 1)
    return rates


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxcb.device.cpu_dots", description=__doc__.split("\n\n")[0])
    p.add_argument("--measure", action="store_true", help="measure every library here and cache the result")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rows", type=int, nargs="+", default=[32, 512])
    p.add_argument("--dtypes", nargs="+", default=["float32"])
    p.add_argument("--shape", type=int, nargs=3, default=[30, 576, 1536], metavar=("LAYERS", "K", "N"))
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args.rows, args.dtypes, *args.shape)))
        return 0
    info = cpu_info()
    print(f"CPU: {info.model} ({info.vendor}); AMX listed {'amx_tile' in info.flags}, usable {info.amx_usable}")
    if args.measure:
        choice = choose("auto", info=info, measure=False)
        rates = measure_libraries(choice.isa, args.rows, args.dtypes, *args.shape)
        for lib, r in rates.items():
            print(f"  {lib:8s} " + "  ".join(f"{key} {v:6.1f}" for key, v in r.items()) + "  GFLOP/s")
        if args.dtypes == ["float32"] and args.rows == [32, 512] and args.shape == [30, 576, 1536]:
            _write_cache(info.key, rates)
            print(f"cached in {cache_path()}; measured pick: {pick(rates)}")
    print("auto chooses:", choose("auto", info=info, measure=False).describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
