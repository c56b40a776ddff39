"""The import graph of mpips/: no cycle, no module imports an entry point, imports at the top,
no arrow up the layers (LAYERS below; docs/architecture.md draws them).

The graph is read from the source with ``ast`` (nothing is imported): an edge A -> B for
every ``import B`` / ``from B import x`` in A, and A -> B.x when x is a submodule, at any
depth (function-level imports count too: a cycle hidden inside a function is still one).
"""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY_POINTS = {"mpips.train", "mpips.infer", "mpips.export", "mpips.serve", "mpips.plot"}
# Each top-level module or folder of mpips/ and its layer: a module imports only from a lower
# layer, or from its own folder (or, for a leaf module, nothing of a peer at its own layer).
LAYERS = {
    "kernels": 0,
    "schema": 1, "metrics": 1, "tiering": 1,
    "config": 2,
    "data": 3, "models": 3, "tables": 3,
    "comm": 4,
    "worker": 5, "server": 5,
    "checkpoint": 6,
    "serving": 7,
    "job": 8,
    "train": 9, "infer": 9, "export": 9, "serve": 9, "plot": 9,
}
# Imports allowed inside functions, each for a reason other than dodging a cycle.
LAZY_OK = {
    ("mpips.train", "mpi4py"),             # --local runs without MPI
    ("mpips.train", "mpips.job.distributed"),  # imports mpi4py.MPI at its top (same reason)
    ("mpips.comm.cluster", "mpi4py"),           # role arithmetic is used (and tested) without MPI
    ("mpips.infer", "mpi4py"),             # one-process scoring runs without MPI
    ("mpips.serving.shared", "mpi4py"),    # one server process runs without MPI
    ("mpips.serve", "mpips.serving"),      # without the serve extra: one line naming it
    ("mpips.job.tracking", "tensorboardX"),  # optional extra, ~0.5 s: only with --tensorboard
    ("mpips.serving.server", "mpips.serving.grpc_v2"),   # only with --grpc-port, after a fork
    ("mpips.serving.shared", "prometheus_client"),       # reads PROMETHEUS_MULTIPROC_DIR on
    ("mpips.serving.shared", "mpips.serving.api"),       # import: after the master sets it
    ("mpips.tables.disk", "lmdb"),         # the disk extra: only with --table-memory
}


def module_files(root, package):
    """{module name: path} of every .py file under root/package."""
    out = {}
    for dirpath, _, files in os.walk(os.path.join(root, package)):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), root)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(dirpath, f)
    return out


def imports_of(name, path, is_package):
    """[(imported module, lineno, at module level)] of one file."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    top = set(map(id, tree.body))
    for node in tree.body:                  # `if sys.version_info ...:` / `try:` blocks
        if isinstance(node, (ast.If, ast.Try)):
            top |= set(map(id, ast.walk(node)))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_package else name.split(".")[:-1]
                pkg = pkg[:len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            out.append((base, node.lineno, id(node) in top))
            out += [(f"{base}.{a.name}", node.lineno, id(node) in top) for a in node.names]
    return out


def import_graph(root, package):
    """{module: {imported module of the package}}, and [(module, target, line)] of lazy ones."""
    files = module_files(root, package)
    graph, lazy = {}, []
    for name, path in files.items():
        graph[name] = set()
        for target, line, at_top in imports_of(name, path, path.endswith("__init__.py")):
            if not at_top:
                lazy.append((name, target, line))
            if target in files and target != name:
                graph[name].add(target)
    return graph, lazy


def find_cycle(graph):
    """One cycle [a, b, ..., a] of a {node: {successors}} graph, or None."""
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == "open":
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = "done"
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_find_cycle_on_toy_graphs():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    assert find_cycle({"x": {"y"}, "y": set(), "a": {"b"}, "b": {"a", "y"}}) == ["a", "b", "a"]


def test_parser_sees_a_cycle_hidden_in_a_function(tmp_path):
    pkg = tmp_path / "toy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from toy.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from toy import c\n    return c\n")
    (pkg / "c.py").write_text("import toy.a\n")
    (pkg / "d.py").write_text("from . import a\n")
    graph, lazy = import_graph(str(tmp_path), "toy")
    assert graph["toy.d"] == {"toy", "toy.a"}
    assert lazy == [("toy.b", "toy", 2), ("toy.b", "toy.c", 2)]
    assert find_cycle(graph) == ["toy.a", "toy.b", "toy.c", "toy.a"]


@pytest.fixture(scope="module")
def mpips_graph():
    return import_graph(ROOT, "mpips")


def test_mpips_has_no_import_cycle(mpips_graph):
    graph, _ = mpips_graph
    assert len(graph) > 30
    assert find_cycle(graph) is None


def test_nothing_imports_an_entry_point(mpips_graph):
    graph, _ = mpips_graph
    bad = sorted((m, t) for m, ts in graph.items() for t in ts & ENTRY_POINTS)
    assert bad == []


def test_mpips_imports_no_tool_folder():
    """data_prep/ and bench/ are tools over mpips (the embedded dataset's generator lives in
    mpips.data.synth); nothing in the package reaches up into them."""
    bad = sorted((name, target) for name, path in module_files(ROOT, "mpips").items()
                 for target, _, _ in imports_of(name, path, path.endswith("__init__.py"))
                 if target.split(".")[0] in ("data_prep", "bench", "tests"))
    assert bad == []


def test_imports_at_module_top(mpips_graph):
    _, lazy = mpips_graph
    def allowed(m, t):
        parts = t.split(".")
        return any((m, ".".join(parts[:k])) in LAZY_OK for k in range(1, len(parts) + 1))
    bad = [(m, t, line) for m, t, line in lazy if not allowed(m, t)]
    assert bad == []


def layer_violations(graph):
    """[(a, b)] of edges a -> b that point up the layers or sideways between two folders."""
    bad = []
    for a, targets in graph.items():
        for b in targets:
            pa, pb = a.split("."), b.split(".")
            if len(pb) < 2:             # `from mpips import checkpoint`: the (empty) package root
                continue
            if pa[1] == pb[1]:          # within one folder
                continue
            if LAYERS[pb[1]] >= LAYERS[pa[1]]:
                bad.append((a, b))
    return sorted(bad)


def test_layer_check_sees_an_arrow_up():
    assert layer_violations({"mpips.tables.x": {"mpips.job.y", "mpips.kernels.z"}}) == [("mpips.tables.x", "mpips.job.y")]
    assert layer_violations({"mpips.data.x": {"mpips.models.y"}}) == [("mpips.data.x", "mpips.models.y")]
    assert layer_violations({"mpips.job.a": {"mpips.job.b", "mpips.serving.c", "mpips"}}) == []


def test_every_top_level_name_has_a_layer(mpips_graph):
    graph, _ = mpips_graph
    assert {m.split(".")[1] for m in graph if m != "mpips"} <= set(LAYERS)


def test_no_arrow_up_the_layers(mpips_graph):
    graph, _ = mpips_graph
    assert layer_violations(graph) == []


def test_package_top_holds_only_entry_points_and_leaves():
    top = {f[:-3] for f in os.listdir(os.path.join(ROOT, "mpips")) if f.endswith(".py")} - {"__init__"}
    leaves = {"config", "schema", "metrics", "tiering"}
    assert top <= {e.split(".")[1] for e in ENTRY_POINTS} | leaves


def test_no_module_above_600_lines():
    long = {}
    for name, path in module_files(ROOT, "mpips").items():
        n = sum(1 for _ in open(path, encoding="utf-8"))
        if n > 600:
            long[name] = n
    assert long == {}
