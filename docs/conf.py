"""Sphinx configuration of fabric's documentation: bash tools/docs.sh builds it."""
from __future__ import annotations

import os
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DOCS)
# the working tree's fabric (built in place), and the docs' own extensions
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(DOCS, "_ext"))
sys.path.insert(0, DOCS)
# nothing the build runs reads a tuning profile or the developer's knobs
os.environ["FABRIC_PROFILE"] = "none"
for _name in [n for n in os.environ if n.startswith("FABRIC_")]:
    if _name != "FABRIC_PROFILE":
        del os.environ[_name]
os.environ.setdefault("UCX_LOG_FILE", "stderr")

import fabric  # noqa: E402

project = "fabric"
author = "the fabric authors"
copyright = "the fabric authors"
release = fabric.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.doctest",
    "myst_parser",        # CHANGELOG.md, included by changelog.rst
    "fabric_docs",        # _ext/fabric_docs.py: .pyi signatures, docstring fixes, generated tables
    "perf_figures",       # perf_figures.py: the performance page's tables and plots from bench/results
]

exclude_patterns = ["_build", "_generated/*.rst", "Thumbs.db", ".DS_Store"]
templates_path: list[str] = []
source_suffix = {".rst": "restructuredtext"}
root_doc = "index"
nitpicky = True

# -- autodoc ----------------------------------------------------------------
# (no "members" default: Sphinx 9 then ignores a directive's own list of
# members; every directive in docs/api says :members: itself)
autodoc_default_options = {"undoc-members": True, "member-order": "bysource", "show-inheritance": True}
autodoc_docstring_signature = True      # Cython's embedded first-line signatures
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_inherit_docstrings = True
autodoc_class_signature = "mixed"
autodoc_preserve_defaults = True
python_use_unqualified_type_names = True
# fabric's docstrings are plain prose with `code` in single backquotes
default_role = "literal"

# No intersphinx (CI may not reach other sites): names outside fabric are
# shown unlinked. These are the ones fabric's signatures mention.
nitpick_ignore = [
    ("py:class", n) for n in (
        "Buffer", "Self", "Sequence", "Generator", "collections.abc.Sequence", "collections.abc.Generator",
        "os.PathLike", "PathLike", "ssl.SSLContext", "asyncio.Lock", "asyncio.AbstractEventLoop",
        "typing_extensions.Buffer", "typing_extensions.Self", "ModuleType", "argparse.Namespace",
        "grpc.Channel", "grpc.Server", "grpc.RpcError", "grpc.Call", "grpc.Future", "grpc.ChannelCredentials",
        "grpc.ServerCredentials", "grpc.aio.Channel", "grpc.aio.Server", "grpc.aio.ServicerContext",
        "grpc.aio.Metadata", "grpc.aio._channel.Channel", "grpc.aio._server.Server", "grpc._channel.Channel",
        "grpc.StatusCode", "grpc.Compression", "grpc.aio._base_server.ServicerContext", "Metadata",
        "distributed.comm.core.Comm", "distributed.comm.core.Connector", "distributed.comm.core.BaseListener",
        "distributed.comm.registry.Backend", "Comm", "Connector", "BaseListener", "Backend.__init__",
        "torch._C._distributed_c10d.ProcessGroup", "torch._C._distributed_c10d.Backend",
        "torch.distributed.ProcessGroup", "torch.distributed.Backend", "ProcessGroup", "torch.Tensor",
        "Exception", "Worker", "Future",
    )
]
nitpick_ignore_regex = [
    # grpc's inherited docstrings name grpc's own types
    ("py:(class|obj|exc|meth|func|attr|data|mod)", r"grpc\..*"),
    ("py:(class|obj|exc|meth|func|attr|data|mod)", r"(distributed|torch|dask)\..*"),
    # the standard library's own types, named in signatures
    ("py:(class|obj|exc|data)", r"(collections\.abc|typing|argparse|datetime|asyncio|concurrent\.futures"
                                r"|os|ssl|socket|types|enum|weakref|threading)\..*"),
]

# -- doctest ----------------------------------------------------------------
doctest_global_setup = """
import fabric
"""
doctest_test_doctest_blocks = ""       # only the explicit doctest/testcode directives run
trim_doctest_flags = True

# -- HTML -------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = f"fabric {release}"
html_static_path = ["_static"]
html_css_files = ["fabric.css"]
html_last_updated_fmt = None
html_show_sourcelink = False
html_copy_source = False
html_theme_options = {
    "navbar_align": "left",
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
    "show_version_warning_banner": False,
    "check_switcher": False,
}
html_sidebars = {"index": []}

# -- completeness -------------------------------------------------------------
# _ext/fabric_docs.py warns for any public name of these modules without a
# target in the site (their __all__, else the classes and functions they define).
fabric_docs_public = [
    "fabric", "fabric.aio", "fabric.stream", "fabric.options", "fabric.grpc", "fabric.grpc.aio",
    "fabric.dask", "fabric.torch", "fabric.auth", "fabric.address", "fabric.backends",
    "fabric.backends.interface", "fabric.info", "fabric.perf",
]
