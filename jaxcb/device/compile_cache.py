"""JAX's persistent compilation cache: a second start loads the compiled buckets instead of compiling.

Every bucket shape is one XLA program; compiling all of them is most of a cold start. With the cache
directory set, each compiled program is written there and a later process with the same model,
configuration, jax version and device loads it back. A directory that cannot be written is not an
error: the engine warns and compiles as if there were no cache.
"""

from __future__ import annotations

import os
import sys
import tempfile


def default_dir() -> str:
    """$JAXCB_COMPILE_CACHE, else jaxcb/xla under $XDG_CACHE_HOME (default ~/.cache)."""
    if os.environ.get("JAXCB_COMPILE_CACHE"):
        return os.environ["JAXCB_COMPILE_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxcb", "xla")


def enable(path: str | None = None) -> str | None:
    """Use `path` (default: default_dir(); "off": none) as JAX's compilation cache; returns the directory
    in use, or None when caching is off or the directory is not writable (with a warning on stderr)."""
    if path == "off":
        return None
    path = os.path.abspath(path or default_dir())
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as e:
        print(f"jaxcb: warning: compile cache {path} is not writable ({e.strerror or e}); "
              "running without a persistent compile cache", file=sys.stderr, flush=True)
        return None
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every bucket, however quick
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path
