"""The implementations of mpips.worker.interfaces provide every member of their Protocol, with the
Protocol's parameters in the same order.  Read from the source with ``ast`` (the MPI ones
are not imported: unit tests never load mpi4py.MPI)."""
import ast
import inspect
import os

import pytest

from mpips.worker import interfaces

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPLEMENTATIONS = [
    (interfaces.ParamStore, "mpips/worker/client.py", "PSClient"),
    (interfaces.ParamStore, "mpips/worker/local.py", "LocalPS"),
    (interfaces.Backend, "mpips/job/loop.py", "LocalBackend"),
    (interfaces.Backend, "mpips/job/distributed.py", "DistBackend"),
]


def protocol_members(proto):
    """({method: [parameter names]}, {attribute names}) a Protocol declares."""
    methods = {name: list(inspect.signature(fn).parameters)[1:]
               for name, fn in vars(proto).items()
               if inspect.isfunction(fn) and not name.startswith("_")}
    return methods, set(proto.__annotations__)


def class_members(source, name):
    """({method: [parameter names]}, {attribute names}) of class `name` in `source`."""
    cls = next(n for n in ast.walk(ast.parse(source))
               if isinstance(n, ast.ClassDef) and n.name == name)
    methods, attrs = {}, set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            methods[node.name] = [a.arg for a in node.args.args[1:] + node.args.kwonlyargs]
            attrs.add(node.name)                    # a property counts as an attribute
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            attrs |= {t.id for t in targets if isinstance(t, ast.Name)}
    for node in ast.walk(cls):                      # self.x = ... / self.a, self.b = ...
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id == "self":
            attrs.add(node.attr)
    return methods, attrs


def test_reader_sees_a_missing_member():
    src = "class A:\n    x = 1\n    def __init__(self):\n        self.y, self.z = 1, 2\n" \
          "    def pull(self, plan, out, step=0):\n        pass\n"
    methods, attrs = class_members(src, "A")
    assert methods["pull"] == ["plan", "out", "step"] and {"x", "y", "z"} <= attrs
    want, _ = protocol_members(interfaces.ParamStore)
    assert methods["pull"] != want["pull"]


@pytest.mark.parametrize("proto,path,name", IMPLEMENTATIONS, ids=[i[2] for i in IMPLEMENTATIONS])
def test_implementation_follows_its_protocol(proto, path, name):
    want_methods, want_attrs = protocol_members(proto)
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        methods, attrs = class_members(fh.read(), name)
    assert want_methods and want_attrs
    for method, params in want_methods.items():
        assert method in methods, f"{name} lacks {method}()"
        assert methods[method] == params, f"{name}.{method}{methods[method]} != {params}"
    assert want_attrs <= attrs, f"{name} lacks {sorted(want_attrs - attrs)}"
