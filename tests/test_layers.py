"""The layers of the tree (README, "Layout"): which packages import JAX, and which way imports run."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Bottom to top: a module imports only from its own group or from groups below it. A group is one or
# more module prefixes; the longest prefix that matches a module names its group.
LAYERS = (
    (("jaxcb.host",),),  # requests to packed batches and back; no JAX
    (("kernels_cpu",), ("kernels_pallas",)),
    (("jaxcb.model",),),
    (("jaxcb.device",), ("jaxcb.sim",)),  # the step under JAX; planning without the model
    (("jaxcb.llm", "jaxcb"),),  # the Python interface and the build sequence
    (("serve",),),
    (("jaxcb.cli", "jaxcb.__main__"),),
)


def _group(module: str) -> tuple[int, int, int]:
    """A module's (layer, group, prefix length) by the longest prefix that matches it."""
    best = None
    for rank, groups in enumerate(LAYERS):
        for g, prefixes in enumerate(groups):
            for p in prefixes:
                if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[2]):
                    best = (rank, g, len(p))
    assert best is not None, f"{module} is in no layer"
    return best


def _no_jax_modules() -> list[str]:
    """Every module of jaxcb.host and jaxcb.sim, and the device side's set-up modules that run before JAX."""
    mods = []
    for pkg in ("host", "sim"):
        for f in sorted(os.listdir(os.path.join(ROOT, "jaxcb", pkg))):
            if f.endswith(".py"):
                mods.append(f"jaxcb.{pkg}" + ("" if f == "__init__.py" else "." + f[:-3]))
    return mods + ["jaxcb.device.cpu_dots", "jaxcb.device.compile_cache", "jaxcb.cli.tools", "jaxcb.model.config"]


def test_host_side_modules_do_not_import_jax():
    mods = _no_jax_modules()
    assert "jaxcb.host.scheduler" in mods and "jaxcb.host.engine" in mods and "jaxcb.sim.simulate" in mods
    code = (
        "import sys\n"
        f"import {', '.join(mods)}\n"
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jax'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def _import_graph(root: str) -> dict[str, set[str]]:
    """Module -> the project modules it imports (at the top or inside a function), from the source."""
    import ast
    import os

    mods = {}
    for base in ("jaxcb", "serve", "kernels_cpu", "kernels_pallas"):
        for folder, _, files in os.walk(os.path.join(root, base)):
            if os.sep + "proto" in folder:
                continue  # generated code
            for f in files:
                if f.endswith(".py"):
                    name = os.path.relpath(os.path.join(folder, f), root)[:-3].replace(os.sep, ".")
                    mods[name.removesuffix(".__init__")] = os.path.join(folder, f)
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                targets = [t for t in subs if t in mods]
                if len(targets) < len(subs):
                    targets.append(node.module)  # names defined in the module itself
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != m:
                    graph[m].add(t)
    return graph


def test_no_import_cycles():
    """No module imports one that (directly or not) imports it back, lazy imports included."""
    graph = _import_graph(ROOT)
    reach = {}

    def reachable(m):
        if m not in reach:
            seen, todo = set(), list(graph[m])
            while todo:
                n = todo.pop()
                if n not in seen:
                    seen.add(n)
                    todo.extend(graph[n])
            reach[m] = seen
        return reach[m]

    cycles = sorted(m for m in graph if m in reachable(m))
    assert not cycles, f"modules on an import cycle: {cycles}"
    assert len(graph) > 40  # the walk found the project


def test_imports_run_down_the_layers():
    """No module imports one of a higher layer, or of a sibling group of its own layer (lazy imports
    included): the host side never reaches for the device side, the model never for the runner, the
    engine never for the server."""
    graph = _import_graph(ROOT)
    upward = []
    for m, targets in graph.items():
        rank, group, _ = _group(m)
        for t in targets:
            t_rank, t_group, _ = _group(t)
            if t_rank > rank or (t_rank == rank and t_group != group):
                upward.append(f"{m} -> {t}")
    assert not upward, f"imports that run up the layers: {sorted(upward)}"
    assert any(m.startswith("jaxcb.host.") for m in graph) and any(m.startswith("jaxcb.device.") for m in graph)


def test_no_sys_path_edits():
    """Tools, benchmarks and tests import the project's modules as packages, never through sys.path."""
    edits = []
    for folder in ("jaxcb", "serve", "kernels_cpu", "kernels_pallas", "tests", "bench", "tools"):
        for base, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith(".py") and f != os.path.basename(__file__):
                    with open(os.path.join(base, f)) as fh:
                        text = fh.read()
                    if "sys.path.insert" in text or "sys.path.append" in text:
                        edits.append(os.path.relpath(os.path.join(base, f), ROOT))
    assert not edits, f"sys.path edits in {sorted(edits)}"
