"""Sphinx glue for fabric's documentation (docs/conf.py loads it).

- Signatures from the .pyi stubs: fabric's Cython classes (fabric.protocol.engine,
  fabric.backends.interface, ...) are documented by importing the built modules,
  whose embedded signatures carry no types. For every object of a compiled
  module with a ``.pyi`` beside it, the stub's signature (annotations, return
  type, overloads) replaces the runtime one, and a property's stub return type
  is shown under its docstring. The stubs' private aliases (``_Sendable``,
  ``_Writable``) are spelt out.
- Docstrings as written in fabric/: a Markdown table in a docstring (the knob
  table of fabric.options) becomes an RST table, and an indented example block
  after a paragraph becomes a literal block, so fabric's docstrings need no
  RST of their own.
- ``.. command-output:: ARGS``: runs ``python ARGS`` (the docs' own interpreter,
  repository root, no stdin, FABRIC_* and UCX_* variables removed, no tuning
  profile) at build time and shows what it printed: CLI help and
  ``python -m fabric info --protocols`` never go stale.
- ``.. fabric-knobs::``: the knob table from fabric.options (names, environment
  variables, defaults per backend, help), generated, not pasted.
"""
from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
from typing import Any

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The stubs' private aliases, as a reader should see them.
ALIASES = {
    "_Part": "Buffer",
    "_DLPack": "Buffer",
    "_Sendable": "Buffer | Sequence[Buffer]",
    "_Writable": "Buffer",
    "_Data": "Buffer | Sequence[Buffer]",       # fabric.stream (a TYPE_CHECKING alias)
}


# --------------------------------------------------------------------- stubs

class Stub:
    """The definitions of one .pyi file, by qualified name."""

    def __init__(self, path: str) -> None:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        self.defs: dict[str, list[ast.AST]] = {}
        self._walk(tree.body, "")

    def _walk(self, body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defs.setdefault(prefix + node.name, []).append(node)
                if isinstance(node, ast.ClassDef):
                    self._walk(node.body, prefix + node.name + ".")
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                self.defs.setdefault(prefix + node.target.id, []).append(node)


_stubs: dict[str, Stub | None] = {}


def stub_for(module: str | None) -> Stub | None:
    """The stub of a compiled module (None for a Python module or no stub)."""
    if not module or not module.startswith("fabric"):
        return None
    if module not in _stubs:
        mod = sys.modules.get(module)
        path = getattr(mod, "__file__", "") or ""
        stub = None
        if path.endswith((".so", ".pyd")):
            pyi = os.path.join(os.path.dirname(path), module.rsplit(".", 1)[-1] + ".pyi")
            if os.path.exists(pyi):
                stub = Stub(pyi)
        _stubs[module] = stub
    return _stubs[module]


def _unalias(text: str) -> str:
    for alias, spelt in ALIASES.items():
        text = re.sub(rf"\b{re.escape(alias)}\b", spelt, text)
    return text


def _where(obj: Any) -> tuple[str | None, str | None]:
    """(module, qualified name) of a compiled object, for the stub lookup."""
    owner = getattr(obj, "__objclass__", None)
    if owner is not None:
        return owner.__module__, f"{owner.__qualname__}.{obj.__name__}"
    return getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)


def _is_overload(node: ast.AST) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "overload" for d in getattr(node, "decorator_list", []))


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> str:
    args = node.args
    if method and not any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list):
        args = ast.arguments(posonlyargs=list(args.posonlyargs), args=list(args.args), vararg=args.vararg,
                             kwonlyargs=args.kwonlyargs, kw_defaults=args.kw_defaults,
                             kwarg=args.kwarg, defaults=args.defaults)
        if args.posonlyargs:
            args.posonlyargs.pop(0)
        elif args.args:
            args.args.pop(0)
    text = f"({ast.unparse(args)})"
    if node.returns is not None:
        text += f" -> {ast.unparse(node.returns)}"
    return _unalias(text)


def process_signature(app, what, name, obj, options, signature, return_annotation):
    if what in ("attribute", "property"):
        return None            # a property's type is shown under its docstring (process_docstring_types)
    if signature is None:
        # autodoc found no signature at all (Sphinx 9 then has no slot for
        # one): a stub signature can only replace an existing one
        return None
    module, qualname = _where(obj)
    stub = stub_for(module)
    if stub is None or not qualname:
        if name.startswith("fabric") and any(a in (signature or "") + (return_annotation or "") for a in ALIASES):
            return _unalias(signature), _unalias(return_annotation) if return_annotation else return_annotation
        return None
    found = stub.defs.get(qualname)
    if what == "class":
        init = stub.defs.get(f"{qualname}.__init__") or stub.defs.get(f"{qualname}.__new__")
        if not init:
            return "", None        # made by fabric (Fabric.connect, ...), never by the user
        return _signature(init[0], method=True).split(" -> ")[0], None
    if not found or not isinstance(found[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    defs = [d for d in found if _is_overload(d)] or found
    method = "." in qualname
    sigs = [_signature(d, method) for d in defs]
    return "\n".join(sigs), None


def process_docstring_types(app, what, name, obj, options, lines):
    """A property of a compiled class: its type from the stub."""
    if what not in ("attribute", "property") or not inspect.isgetsetdescriptor(obj):
        return
    module, qualname = _where(obj)
    stub = stub_for(module)
    found = stub.defs.get(qualname or "") if stub else None
    if not found:
        return
    node = found[0]
    ann = getattr(node, "returns", None) or getattr(node, "annotation", None)
    if ann is not None:
        lines.extend(["", f"*Type:* ``{_unalias(ast.unparse(ann))}``"])


# ---------------------------------------------------------------- docstrings

_TABLE_ROW = re.compile(r"^\s*\|.*\|\s*$")
_TABLE_RULE = re.compile(r"^\s*\|[\s:|-]+\|\s*$")


def _markdown_tables(lines: list[str]) -> list[str]:
    """Markdown pipe tables -> list-table directives."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        if (_TABLE_ROW.match(lines[i]) and i + 1 < len(lines) and _TABLE_RULE.match(lines[i + 1])):
            rows = [lines[i]]
            i += 2
            while i < len(lines) and _TABLE_ROW.match(lines[i]):
                rows.append(lines[i])
                i += 1
            cells = [[c.strip() for c in r.strip().strip("|").split("|")] for r in rows]
            out += ["", ".. list-table::", "   :header-rows: 1", ""]
            for row in cells:
                for j, cell in enumerate(row):
                    out.append(("   * - " if j == 0 else "     - ") + (cell or " "))
            out.append("")
            continue
        out.append(lines[i])
        i += 1
    return out


def _literal_examples(lines: list[str]) -> list[str]:
    """An indented block right after a paragraph (not already introduced by
    ``::`` or a directive) is an example: make it a literal block."""
    out: list[str] = []
    for i, line in enumerate(lines):
        starts_block = (line.startswith("  ") and i > 0 and lines[i - 1].strip() == ""
                        and i > 1 and lines[i - 2].strip() and not lines[i - 2].startswith(" ")
                        and not lines[i - 2].rstrip().endswith("::")
                        and not lines[i - 2].lstrip().startswith((".. ", "* ", "- ", "1. ")))
        if starts_block:
            out.insert(len(out) - 1, "::")
            out.insert(len(out) - 1, "")
        out.append(line)
    return out


_LIST_ITEM = re.compile(r"^\s*([-*+]|\d+[.)])\s+\S")


def _lists_after_paragraphs(lines: list[str]) -> list[str]:
    """A Markdown list that starts right under a paragraph line gets the blank
    line RST needs before it."""
    out: list[str] = []
    for line in lines:
        if (_LIST_ITEM.match(line) and out and out[-1].strip() and not _LIST_ITEM.match(out[-1])
                and not out[-1].startswith(" ") and not line.startswith(" ")):
            out.append("")
        out.append(line)
    return out


_CODE_SPAN = re.compile(r"(``.+?``|`[^`]+`)")


def _escape_stars(lines: list[str]) -> list[str]:
    """Python's ``*`` and ``**`` in prose (``Fabric(backend, **options)``) are
    not RST emphasis; fabric's docstrings never mean emphasis by them."""
    out: list[str] = []
    literal = False
    for i, line in enumerate(lines):
        if literal and line.strip() and not line.startswith(" "):
            literal = False
        if not literal:
            parts = _CODE_SPAN.split(line)
            line = "".join(p if k % 2 else re.sub(r"(?<!\\)\*(?=[\w*,)(])", r"\\*", p)
                           for k, p in enumerate(parts))
        if line.rstrip().endswith("::"):
            literal = True
        out.append(line)
    return out


_FOREIGN = {"grpc": "grpcio's", "distributed": "Dask's", "dask": "Dask's", "torch": "PyTorch's"}


def _import_path(dotted: str) -> Any:
    import importlib
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def _public_path(cls: type) -> str:
    module = ".".join(p for p in cls.__module__.split(".") if not p.startswith("_"))
    return f"{module}.{cls.__qualname__}"


def foreign_docstring(what: str, name: str) -> str | None:
    """Where a fabric member's docstring came from when autodoc inherited it
    from another library (grpc, distributed, torch): ``grpc.Channel.close``."""
    if what not in ("method", "attribute", "property", "classmethod", "staticmethod"):
        return None
    owner_name, _, attr = name.rpartition(".")
    try:
        owner = _import_path(owner_name)
    except (ImportError, AttributeError):
        return None
    if not isinstance(owner, type):
        return None
    for cls in owner.__mro__:
        member = cls.__dict__.get(attr)
        if member is not None and getattr(member, "__doc__", None):
            if cls.__module__.split(".")[0] in _FOREIGN:
                return f"{_public_path(cls)}.{attr}"
            return None
    return None


def process_docstring_text(app, what, name, obj, options, lines):
    if not name.startswith("fabric"):
        return
    foreign = foreign_docstring(what, name)
    if foreign is not None:
        owner = _FOREIGN[foreign.split(".")[0]]
        lines[:] = [f"As ``{foreign}``, whose contract this implements (see {owner} documentation).", ""]
        return
    fixed = _literal_examples(_markdown_tables(list(lines)))
    fixed = _escape_stars(_lists_after_paragraphs(fixed))
    lines[:] = fixed


# ------------------------------------------------------- cross-references

def _documented(env) -> tuple[dict[str, str], dict[str, list[str]]]:
    """(real dotted path -> documented name, last name part -> documented names)."""
    cache = getattr(env, "_fabric_docs_aliases", None)
    objects = env.domains["py"].objects
    if cache is not None and cache[0] == len(objects):
        return cache[1], cache[2]
    real: dict[str, str] = {}
    short: dict[str, list[str]] = {}
    for fullname, entry in objects.items():
        if not fullname.startswith("fabric") or getattr(entry, "aliased", False):
            continue
        short.setdefault(fullname.rsplit(".", 1)[-1], []).append(fullname)
        try:
            obj = _import_path(fullname)
        except Exception:
            continue
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if isinstance(module, str) and isinstance(qualname, str):
            real.setdefault(f"{module}.{qualname}", fullname)
    env._fabric_docs_aliases = (len(objects), real, short)
    return real, short


def missing_reference(app, env, node, contnode):
    """A reference to a fabric object by the name it is defined under
    (fabric.protocol.engine.Endpoint) or by its bare name in a signature
    (Endpoint, Backend) goes to where it is documented (fabric.Endpoint); a
    private fabric name (fabric.aio._Driver) is shown, unlinked."""
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    real, short = _documented(env)
    found = real.get(target)
    if found is None and "." not in target and target in short:
        here = node.get("py:module") or ""
        found = max(short[target], key=lambda n: (len(os.path.commonprefix([n, here + "."])), -len(n)))
    if found is None and target.startswith("fabric.") and "." in target:
        # a name fabric re-exports from one of its modules
        _, _, last = target.rpartition(".")
        same = [n for n in short.get(last, []) if target.startswith(n.rpartition(".")[0] + ".")]
        if len(same) == 1:
            found = same[0]
    if found is not None:
        domain = env.domains["py"]
        new = node.deepcopy()
        new["reftarget"] = found
        new["refspecific"] = False
        return domain.resolve_xref(env, node.get("refdoc", env.docname), app.builder, "obj", found, new,
                                   contnode)
    if target.startswith("fabric") and any(part.startswith("_") for part in target.split(".")[1:]):
        return contnode
    return None


# -------------------------------------------------------------- directives

def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FABRIC_", "UCX_"))}
    env["FABRIC_PROFILE"] = "none"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["COLUMNS"] = "100"
    return env


class CommandOutput(SphinxDirective):
    """``.. command-output:: -m fabric info --protocols`` (arguments to python)."""

    required_arguments = 1
    final_argument_whitespace = True
    option_spec = {"prompt": directives.unchanged, "timeout": directives.positive_int}

    def run(self):
        args = self.arguments[0].split()
        try:
            p = subprocess.run([sys.executable, *args], cwd=ROOT, env=_clean_env(), stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, timeout=self.options.get("timeout", 120))
        except subprocess.TimeoutExpired:
            raise self.error(f"command-output: python {' '.join(args)} timed out")
        if p.returncode != 0:
            raise self.error(f"command-output: python {' '.join(args)} exited {p.returncode}:\n{p.stderr}")
        prompt = self.options.get("prompt", "$ python " + " ".join(args))
        text = (prompt + "\n" if prompt else "") + p.stdout.rstrip()
        block = nodes.literal_block(text, text)
        block["language"] = "text"
        return [block]


class FabricKnobs(SphinxDirective):
    """The knob table, from fabric.options and the backends' own defaults."""

    option_spec: dict[str, Any] = {}

    def run(self):
        from fabric import backends, info, options
        per_backend = {}
        for name in ("tcp", "ucx", "verbs"):
            backend, _ = backends.probe(name)
            if backend is not None:
                per_backend[name] = backend.default_options()
        lines = [".. list-table::", "   :header-rows: 1", "   :widths: 18 22 12 18 30", "",
                 "   * - option", "     - environment", "     - default", "     - backend defaults",
                 "     - meaning"]
        for knob, (kind, _lo, _hi) in options.KNOBS.items():
            default = options.COMMON_DEFAULTS[knob]
            shown = info.human_size(default) if kind == "size" else str(default)
            own = [f"{b}: {info.human_size(d[knob]) if kind == 'size' else d[knob]}"
                   for b, d in per_backend.items() if knob in d]
            lines += [f"   * - ``{knob}``", f"     - ``{options.env_name(knob)}``", f"     - {shown}",
                      "     - " + (", ".join(own) or " "), f"     - {options.HELP[knob]}"]
        node = nodes.container()
        self.state.nested_parse(StringList(lines, source="fabric.options"), self.content_offset, node)
        return node.children


# -------------------------------------------------- every public name documented

def public_names(module_name: str) -> list[str]:
    """A module's public names: its __all__, else what it defines (classes,
    functions) under names without a leading underscore."""
    import importlib
    mod = importlib.import_module(module_name)
    names = getattr(mod, "__all__", None)
    if names is not None:
        return list(names)
    return [n for n, v in vars(mod).items()
            if not n.startswith("_") and (inspect.isclass(v) or inspect.isfunction(v) or inspect.isbuiltin(v))
            and getattr(v, "__module__", None) == module_name]


def check_public_names(app, env):
    """Warn for any public name of the modules in ``fabric_docs_public`` that
    has no target in the site (so :class:`fabric.X` never dangles)."""
    objects = env.domains["py"].objects
    for module_name in app.config.fabric_docs_public:
        try:
            names = public_names(module_name)
        except ImportError as e:
            logger.warning(f"fabric_docs: cannot import {module_name}: {e}", type="fabric", subtype="public")
            continue
        if module_name not in env.domains["py"].modules:
            logger.warning(f"fabric_docs: module {module_name} has no page", type="fabric", subtype="public")
        for name in names:
            if f"{module_name}.{name}" not in objects:
                logger.warning(f"fabric_docs: {module_name}.{name} is public but not documented",
                               type="fabric", subtype="public")


def process_bases(app, name, obj, options, bases):
    """No "Bases: object" line: only bases that say something."""
    bases[:] = [b for b in bases if b is not object]


def setup(app):
    app.connect("autodoc-process-bases", process_bases)
    app.add_config_value("fabric_docs_public", [], "env")
    app.connect("env-check-consistency", check_public_names)
    app.connect("autodoc-process-signature", process_signature)
    app.connect("autodoc-process-docstring", process_docstring_text)
    app.connect("autodoc-process-docstring", process_docstring_types)
    app.connect("missing-reference", missing_reference)
    app.add_directive("command-output", CommandOutput)
    app.add_directive("fabric-knobs", FabricKnobs)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
