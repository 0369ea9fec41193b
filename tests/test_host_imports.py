import subprocess
import sys


def test_host_side_modules_do_not_import_jax():
    code = (
        "import sys\n"
        "import jaxcb.page_pool, jaxcb.scheduler, jaxcb.buckets, jaxcb.request, jaxcb.engine_config, jaxcb.engine\n"
        "import jaxcb.prefix_cache, jaxcb.memory_plan, jaxcb.bucket_plan, jaxcb.compile_cache\n"
        "import jaxcb.trace, jaxcb.simulate, jaxcb.cli_tools\n"
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jax'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


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
    import os

    graph = _import_graph(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
