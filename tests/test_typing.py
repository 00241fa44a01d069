"""Type information: the .pyi stubs of fabric's Cython modules must describe
the runtime classes exactly (every public member in both, the same kinds,
parameters and defaults, properties read-only where the runtime's are), and
mypy checks examples/ through them and catches real mistakes."""
from __future__ import annotations

import ast
import fnmatch
import importlib
import inspect
import os
import re
import subprocess
import sys

import pytest

import fabric
from fabric import _buffers
from fabric.backends.interface import Backend
from fabric.protocol import engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MYPY_INI = os.path.join(ROOT, "mypy.ini")
ALLOWLIST = os.path.join(ROOT, "tests", "stubtest_allowlist.txt")

STUBS = ["fabric.protocol.engine", "fabric.backends.interface", "fabric._buffers"]
# names a stub defines for type checkers only (aliases, protocols)
TYPING_ONLY = {"_DLPack", "_Part", "_Sendable", "_Writable"}
# dunders that are API (context managers, awaitables, containers), compared like public names
API_DUNDERS = {"__enter__", "__exit__", "__aenter__", "__aexit__", "__await__", "__len__", "__getitem__",
               "__bytes__", "__eq__", "__iter__", "__contains__", "__call__"}
# checked apart: construction (Cython's __cinit__ shows no signature), buffers, hashing
SPECIAL = {"__new__", "__init__", "__buffer__", "__hash__"}


def stub_path(module: str) -> str:
    return os.path.join(ROOT, *module.split(".")) + ".pyi"


def stub_kind(node) -> str:
    if isinstance(node, ast.AsyncFunctionDef):
        return "async"
    if isinstance(node, ast.FunctionDef):
        names = {d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in node.decorator_list}
        return "property" if "property" in names else "method"
    if isinstance(node, ast.AnnAssign):
        return "classvar" if ast.unparse(node.annotation).startswith("ClassVar") else "attribute"
    if isinstance(node, ast.ClassDef):
        return "class"
    return "alias"


def members(body) -> dict[str, tuple[str, list]]:
    """name -> (kind, [nodes]) for the definitions in a stub's module or class body."""
    out: dict[str, tuple[str, list]] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = node.name
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        else:
            continue
        out.setdefault(name, (stub_kind(node), []))[1].append(node)
    return out


def compared(name: str) -> bool:
    return not name.startswith("_") or name in API_DUNDERS


def runtime_kind(obj) -> str:
    if inspect.isclass(obj):
        return "class"
    if inspect.iscoroutinefunction(obj):
        return "async"
    if callable(obj) and not inspect.isdatadescriptor(obj):
        return "method"
    return "data"


def stub_parameters(node) -> list[tuple[str, str, object]]:
    a = node.args
    params = []
    defaults = [None] * (len(a.posonlyargs) + len(a.args) - len(a.defaults)) + list(a.defaults)
    for arg, default in zip(a.posonlyargs + a.args, defaults):
        kind = "POSITIONAL_ONLY" if arg in a.posonlyargs else "POSITIONAL_OR_KEYWORD"
        params.append((arg.arg, kind, default))
    if a.vararg:
        params.append((a.vararg.arg, "VAR_POSITIONAL", None))
    params += [(arg.arg, "KEYWORD_ONLY", d) for arg, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        params.append((a.kwarg.arg, "VAR_KEYWORD", None))
    out = []
    for name, kind, default in params:
        if default is None:
            value = inspect.Parameter.empty
        elif isinstance(default, ast.Constant) and default.value is Ellipsis:
            value = Ellipsis                    # "some default": not compared
        else:
            value = ast.literal_eval(default)
        out.append((name, kind, value))
    return out


def check_signature(where: str, node, obj, problems: list[str]):
    try:
        runtime = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return                                  # a C slot without a signature (e.g. __await__)
    stub = stub_parameters(node)
    if len(stub) != len(runtime):
        problems.append(f"{where}: stub has {[p[0] for p in stub]}, runtime has {[p.name for p in runtime]}")
        return
    for (name, kind, default), param in zip(stub, runtime):
        positional_only = "POSITIONAL_ONLY" in (kind, param.kind.name)
        if positional_only:
            # called positionally only: the name does not matter, being positional does
            if param.kind.name not in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD") or \
                    kind not in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD"):
                problems.append(f"{where}: parameter {name} is {kind} in the stub, {param.kind.name} at run time")
        elif (name, kind) != (param.name, param.kind.name):
            problems.append(f"{where}: stub parameter {name} ({kind}), runtime {param.name} ({param.kind.name})")
        if default is not Ellipsis and default != param.default:
            problems.append(f"{where}: parameter {name} defaults to {default!r} in the stub, "
                            f"{param.default!r} at run time")


def compare_class(where: str, stub_cls: ast.ClassDef, cls, problems: list[str]):
    stub = {k: v for k, v in members(stub_cls.body).items() if compared(k)}
    runtime = {k: v for k, v in vars(cls).items() if compared(k)}
    for name in sorted(set(runtime) - set(stub)):
        problems.append(f"{where}.{name} exists at run time but not in the stub")
    for name, (kind, nodes) in sorted(stub.items()):
        if name not in runtime:
            problems.append(f"{where}.{name} is in the stub but not at run time")
            continue
        actual = runtime_kind(runtime[name])
        expected = {"property": "data", "attribute": "data"}.get(kind, kind)
        if actual != expected:
            problems.append(f"{where}.{name}: {kind} in the stub, {actual} at run time")
        elif kind in ("method", "async"):
            for node in nodes:                  # each overload
                check_signature(f"{where}.{name}", node, runtime[name], problems)


def test_stubs_describe_the_runtime_modules():
    problems: list[str] = []
    for module_name in STUBS:
        module = importlib.import_module(module_name)
        with open(stub_path(module_name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        stub = members(tree.body)
        runtime = {k for k, v in vars(module).items()
                   if not k.startswith("_") and not inspect.ismodule(v)}
        for name in sorted(runtime - set(stub)):
            problems.append(f"{module_name}.{name} exists at run time but not in the stub")
        for name, (kind, nodes) in sorted(stub.items()):
            if name in TYPING_ONLY:
                assert not hasattr(module, name), f"{module_name}.{name} exists now: describe it"
                continue
            if not hasattr(module, name):
                problems.append(f"{module_name}.{name} is in the stub but not at run time")
                continue
            obj = getattr(module, name)
            if kind == "class":
                compare_class(f"{module_name}.{name}", nodes[0], obj, problems)
            elif kind in ("method", "async"):
                if runtime_kind(obj) != kind:
                    problems.append(f"{module_name}.{name}: {kind} in the stub, {runtime_kind(obj)} at run time")
                check_signature(f"{module_name}.{name}", nodes[0], obj, problems)
            elif runtime_kind(obj) in ("method", "async", "class"):
                problems.append(f"{module_name}.{name}: a value in the stub, {runtime_kind(obj)} at run time")
    assert not problems, "the stubs disagree with the runtime:\n" + "\n".join(problems)


@pytest.fixture(scope="module")
def instances():
    """One live object of every stubbed class."""
    fab = fabric.Fabric("tcp")
    lst = fab.listen("127.0.0.1:0")
    ep = fab.connect(lst.address, timeout=10)
    peer = lst.accept(timeout=10)
    req = ep.isend(b"x")
    msg = peer.recv(timeout=10)
    req.wait(timeout=10)
    yield {"fabric.protocol.engine": {"Worker": ep.worker, "Endpoint": ep, "Listener": lst, "Request": req,
                                      "Message": msg},
           "fabric.backends.interface": {"Backend": fab.backend},
           "fabric._buffers": {"_Recycler": _buffers.recycler()}}
    fab.close()


# what a simple annotation names, for isinstance
NAMES = {"str": str, "int": int, "bool": bool, "float": (int, float), "bytes": bytes, "dict": dict, "list": list,
         "tuple": tuple, "None": type(None), "Any": object, "Backend": Backend, "Worker": engine.Worker,
         "Endpoint": engine.Endpoint, "FabricError": fabric.FabricError}


def annotation_types(node) -> tuple:
    """(int, type(None)) for "int | None", dict for "dict[str, Any]"."""
    text = ast.unparse(node)
    return tuple(NAMES[re.sub(r"\[.*", "", part.strip())] for part in text.split("|"))


def test_stub_properties_read_what_the_runtime_gives_and_are_read_only_where_it_is(instances):
    problems = []
    for module_name, objects in instances.items():
        with open(stub_path(module_name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
        for cls_name, obj in objects.items():
            assert type(obj).__name__ == cls_name or isinstance(obj, getattr(importlib.import_module(module_name),
                                                                               cls_name))
            for name, (kind, nodes) in members(classes[cls_name].body).items():
                if kind not in ("property", "attribute"):
                    continue
                value = getattr(obj, name)
                node = nodes[0]
                annotation = node.returns if kind == "property" else node.annotation
                if not isinstance(value, annotation_types(annotation)):
                    problems.append(f"{cls_name}.{name} is {ast.unparse(annotation)} in the stub, "
                                    f"{type(value).__name__} at run time")
                try:
                    setattr(obj, name, value)
                    writable = True
                except AttributeError:
                    writable = False
                if writable != (kind == "attribute"):
                    problems.append(f"{cls_name}.{name}: {kind} in the stub, but "
                                    f"{'writable' if writable else 'read-only'} at run time")
    assert not problems, "\n".join(problems)


def test_stub_special_members(instances):
    msg = instances["fabric.protocol.engine"]["Message"]
    assert memoryview(msg).tobytes() == b"x"              # __buffer__: the buffer protocol
    with pytest.raises(TypeError):
        hash(msg)                                         # __hash__: ClassVar[None]
    # __new__(backend, options): what Fabric passes
    worker = instances["fabric.protocol.engine"]["Worker"]
    assert isinstance(worker.backend, Backend) and isinstance(worker.options, dict)
    assert _buffers._Recycler(1 << 20).idle_bytes() == 0    # __init__(limit)


def test_the_package_ships_its_type_information():
    """py.typed and every stub are package data (PEP 561: installed
    checkers then use them)."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        patterns = tomllib.load(f)["tool"]["setuptools"]["package-data"]["*"]
    files = ["py.typed"] + [os.path.basename(stub_path(m)) for m in STUBS]
    assert os.path.exists(os.path.join(ROOT, "fabric", "py.typed"))
    for name in files:
        assert any(fnmatch.fnmatch(name, p) for p in patterns), f"{name} is not package data: {patterns}"


def run_mypy(*args, cache=None):
    cmd = [sys.executable, "-m", "mypy", "--config-file", MYPY_INI]
    if cache is not None:
        cmd += ["--cache-dir", str(cache)]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, cwd=ROOT, timeout=540)


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory):
    pytest.importorskip("mypy", reason="mypy is not installed (pip install -e '.[test]')")
    return tmp_path_factory.mktemp("mypy-cache")


@pytest.mark.timeout(600)
def test_stubtest_finds_the_stubs_consistent_with_the_runtime(mypy_cache):
    """mypy's own stub checker, with the Cython machinery allowed for."""
    r = subprocess.run([sys.executable, "-m", "mypy.stubtest", "--concise", "--ignore-disjoint-bases",
                        "--allowlist", ALLOWLIST, "--ignore-unused-allowlist", "--mypy-config-file", MYPY_INI,
                        *STUBS], capture_output=True, text=True, cwd=ROOT, timeout=540,
                       env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert r.returncode == 0, f"stubtest:\n{r.stdout}\n{r.stderr}"


@pytest.mark.timeout(600)
def test_mypy_accepts_the_examples(mypy_cache):
    r = run_mypy("examples/", cache=mypy_cache)
    assert r.returncode == 0 and "Success" in r.stdout, f"mypy examples/:\n{r.stdout}\n{r.stderr}"


GOOD = '''\
import fabric
async def main(fab: fabric.Fabric) -> int:
    ep = await fab.aconnect("127.0.0.1:1")
    await ep.asend([b"header", bytearray(8), memoryview(b"x")])
    return await ep.arecv_into(bytearray(8)) + len(await ep.arecv())
with fabric.Fabric("tcp") as fab, fab.listen() as lst:
    ep = lst.accept(timeout=1.5)
    ep.send(b"x"); ep.isend(bytearray(4)).wait(timeout=1)
    n: int = ep.recv_into(bytearray(8))
    data: bytes = ep.recv().tobytes()
    stream = fab.connect_stream(lst.address)
    stream.write([b"a", b"b"]); chunk: bytes = stream.read(10)
'''

# Each mistake is the snippet's last line; mypy must report it there.
BAD = {
    "too_many_arguments": ('fabric.Fabric().connect(1, 2, 3)', 'Too many arguments for "connect" of "Fabric"'),
    "address_not_a_str": ('fabric.Fabric().connect(50051)', 'Argument 1 to "connect" of "Fabric" has '
                                                           'incompatible type "int"'),
    "no_such_method": ('fabric.connect("h:1").sendd(b"x")', '"Endpoint" has no attribute "sendd"'),
    "private_engine_call": ('fabric.connect("h:1")._try_recv()', '"Endpoint" has no attribute "_try_recv"'),
    "not_a_buffer": ('fabric.connect("h:1").send(42)', 'Argument 1 to "send" of "Endpoint" has incompatible type'),
    "message_is_not_bytes": ('fabric.connect("h:1").recv().decode()', '"Message" has no attribute "decode"'),
    "wrong_result_type": ('n: str = fabric.connect("h:1").recv_into(bytearray(8))', 'Incompatible types in '
                                                                                     'assignment'),
    "timeout_not_a_number": ('fabric.listen().accept(timeout="soon")', 'Argument "timeout" to "accept" of '
                                                                        '"Listener" has incompatible type "str"'),
    "missing_await": ('async def f(ep: fabric.Endpoint) -> None:\n    ep.asend(b"x")',
                      'Value of type "Coroutine[Any, Any, None]" must be used'),
    "stream_read_size": ('fabric.Fabric().connect_stream("h:1").read("10")', 'Argument 1 to "read" of "Stream" '
                                                                            'has incompatible type "str"'),
}


@pytest.mark.timeout(600)
def test_mypy_catches_real_mistakes_through_the_stubs(tmp_path, mypy_cache):
    (tmp_path / "good.py").write_text(GOOD)
    for name, (line, _) in BAD.items():
        (tmp_path / f"bad_{name}.py").write_text("import fabric\n" + line + "\n")
    r = run_mypy(str(tmp_path), cache=mypy_cache)
    errors = re.findall(r"^(?:.*[/\\])?(\w+)\.py:(\d+): error: (.*)$", r.stdout, re.M)
    assert errors, f"mypy reported nothing:\n{r.stdout}\n{r.stderr}"
    assert not [e for e in errors if e[0] == "good"], r.stdout
    for name, (line, expected) in BAD.items():
        last = 1 + line.count("\n") + 1
        found = [msg for module, lineno, msg in errors if module == f"bad_{name}" and int(lineno) == last]
        assert any(expected in msg for msg in found), f"{name}: expected {expected!r} on line {last}:\n{r.stdout}"
