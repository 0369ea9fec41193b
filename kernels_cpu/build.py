"""Builds the native CPU kernels (paged_attention.cc, matmul.cc, head.cc) into one shared library, once per source,
CPU and jaxlib.

    python -m kernels_cpu.build        # prints the library's path (make setup runs it)

The library goes to ~/.cache/jaxcb/kernels/<key>/ (JAXCB_KERNEL_CACHE overrides the folder). The key
hashes the source, the compiler flags and the jaxlib version, so a cache carried to another CPU or
jaxlib builds anew. The ISA flags are those the CPU lists (AVX2/FMA, AVX-512): never -march=native,
which on these virtual machines can enable extensions that are listed but not granted. Nothing here
runs on a GPU or TPU machine unless asked: the kernels are for the CPU backend only, and a machine
without a C++ compiler simply keeps the plain-JAX attention.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("jaxcb.kernels_cpu")

HERE = Path(__file__).parent
SOURCES = [HERE / "paged_attention.cc", HERE / "matmul.cc", HERE / "head.cc"]
HEADERS = [HERE / "int8.h", HERE / "parallel.h", HERE / "vec.h"]


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa_flags(flags: set[str] | None = None) -> list[str]:
    """Compiler ISA flags for the extensions this CPU lists (x86-64); none elsewhere."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = cpu_flags() if flags is None else flags
    out = []
    if {"avx2", "fma", "f16c"} <= flags:
        out += ["-mavx2", "-mfma", "-mf16c"]
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        out += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
        if "avx512_vnni" in flags:
            out += ["-mavx512vnni"]
        if "avx512_bf16" in flags:
            out += ["-mavx512bf16"]
    return out


def compile_command(output: str, sources: list[str] | None = None) -> list[str]:
    import jax

    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
    return [cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd", "-fno-math-errno",
            *isa_flags(), *os.environ.get("JAXCB_KERNEL_FLAGS", "").split(), "-I", jax.ffi.include_dir(),
            *map(str, SOURCES if sources is None else sources), "-o", output]


def cache_dir() -> Path:
    root = os.environ.get("JAXCB_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jaxcb", "kernels")
    return Path(root)


def library_path() -> Path:
    import jaxlib

    key = hashlib.sha256()
    for source in SOURCES + HEADERS:
        key.update(source.read_bytes())
    key.update(" ".join(compile_command("x")[1:]).encode())  # flags and include dir, not the compiler's path
    key.update(jaxlib.__version__.encode())
    return cache_dir() / key.hexdigest()[:16] / "libjaxcb_cpu_kernels.so"


def build() -> Path:
    """The library's path, compiling it first if it is not in the cache (under a file lock, so
    concurrent processes build it once)."""
    path = library_path()
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return path
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            compile_library(tmp)
        except Exception:
            os.unlink(tmp)
            raise
        os.replace(tmp, path)
    return path


def compile_library(output: str, folder: Path = HERE) -> None:
    """compile_command for the sources in `folder` (this one; bench.attention_cpu --compare builds another
    revision's copy), with each source compiled to an object file in its own process at once (the sources
    take 9-31 s each on a 2-core machine), then linked."""
    sources = [str(folder / s.name) for s in SOURCES]
    cmd = compile_command(output, sources)
    flags = [a for a in cmd[1:cmd.index(sources[0])] if a != "-shared"]
    log.info("building the CPU kernels: %s", " ".join(cmd))
    with tempfile.TemporaryDirectory() as objects:
        outs = [os.path.join(objects, f"{i}.o") for i in range(len(sources))]
        jobs = [subprocess.Popen([cmd[0], *flags, "-c", src, "-o", out], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True) for src, out in zip(sources, outs)]
        errors = [job.communicate()[1] for job in jobs]
        failed = [err for job, err in zip(jobs, errors) if job.returncode != 0]
        if not failed:
            link = subprocess.run([cmd[0], "-shared", "-fPIC", *outs, "-o", output], capture_output=True, text=True)
            failed = [link.stderr] if link.returncode != 0 else []
        if failed:
            raise RuntimeError(f"building the CPU kernels failed:\n{failed[0][-4000:]}")


if __name__ == "__main__":
    try:
        print(build())
    except Exception as e:  # the engine falls back to plain JAX; setup must not fail for this
        print(f"kernels_cpu: not built ({e}); the plain-JAX attention will be used", file=sys.stderr)
