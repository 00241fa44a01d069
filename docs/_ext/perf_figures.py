"""The performance page's tables and plots, made at build time from the JSON
files the benchmarks wrote (bench/results/). No figure is typed into the
page: each table cell, plot point and inline value is read from a file, and
each table and plot says which file and which command produced it.

Directives and role (FILE is a name in bench/results/ or a path from the
repository root; PATH is a dotted path into the JSON, list items by index)::

    .. perf-table:: compare.json
       :rows: lat_us                    # the mapping (or list of records) of rows
       :select: 8, 1024, 65536          # these rows, in this order (default: all)
       :columns: fabric/tcp=fabric tcp, socket   # KEY[=LABEL], in order (default: all)
       :ratios: fabric/tcp vs socket    # A vs B[=LABEL]: A's value / B's, per row
       :row-format: size                # row keys are byte counts (8 -> 8 B, 1048576 -> 1 MiB)
       :format: .1f                     # a number's format (default: 4 significant digits)
       :caption: 8 B to 64 MiB round trips (us)

    .. perf-plot:: compare.json
       :rows: lat_us
       :columns: fabric/tcp, socket
       :logx: / :logy:                  # log axes
       :kind: line | bar                # line: numeric row keys on x; bar: one group per row
       :xlabel: / :ylabel: / :title:

    :perf-value:`compare.json:machine.cpus`   one value inline (FILE:PATH[:FORMAT])

More table/plot options: ``:transpose:`` (the mapping is column -> row ->
cell), ``:row-key: FIELD`` (rows from a list of records), ``:row-columns:
PATH`` (the columns of a row are under PATH in it), ``:value: KEY`` (a dict
cell's number, for ratios, plots and the default cell text), ``:cell:
TEMPLATE`` (a Python format string over a dict cell's keys, or ``{value}``),
``:unit: KEY`` (a row's unit, shown after its label), ``:series: PATH`` with
``:series-label:``, ``:points:`` and ``:x:`` (fabric-perf's schema: a list of
runs, each with a list of points), ``:header:`` (the row column's title),
``:command:`` (when neither the JSON nor bench/RESULTS.md records the
command) and ``:script:`` (rebuild the command from the JSON's ``args``).

A missing or malformed file, a path that is not there, a row or column that
no data has: a Sphinx warning at the directive (so ``tools/docs.sh --check``
fails), and the page says the figure is unavailable; the build goes on.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import posixpath
import re
from typing import Any

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective, SphinxRole

logger = logging.getLogger(__name__)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "bench", "results")
RESULTS_MD = os.path.join(ROOT, "bench", "RESULTS.md")


class DataError(Exception):
    """What is wrong with a figure's data (becomes a Sphinx warning)."""


# ------------------------------------------------------------------ reading

_cache: dict[str, tuple[float, Any]] = {}


def resolve_file(name: str) -> str:
    name = name.strip()
    path = name if os.path.isabs(name) else (
        os.path.join(ROOT, name) if os.sep in name or "/" in name else os.path.join(RESULTS, name))
    return os.path.normpath(path)


def load(path: str) -> Any:
    try:
        mtime = os.path.getmtime(path)
    except OSError:
        raise DataError(f"{os.path.relpath(path, ROOT)}: no such file") from None
    hit = _cache.get(path)
    if hit and hit[0] == mtime:
        return hit[1]
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DataError(f"{os.path.relpath(path, ROOT)}: not readable JSON ({e})") from None
    _cache[path] = (mtime, doc)
    return doc


def lookup(doc: Any, path: str | None, what: str = "") -> Any:
    """doc at a dotted path ('' or '.': doc itself); list items by index."""
    node = doc
    if not path or path.strip() in ("", "."):
        return node
    walked = []
    for part in path.strip().split("."):
        walked.append(part)
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and re.fullmatch(r"-?\d+", part) and -len(node) <= int(part) < len(node):
            node = node[int(part)]
        else:
            raise DataError(f"{what}no {'.'.join(walked)!r} in the data")
    return node


def number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    return None


def _command_from_results_md(filename: str) -> str | None:
    """The command bench/RESULTS.md shows for bench/results/<filename>."""
    try:
        with open(RESULTS_MD, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    needle = "results/" + filename
    in_code = False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if needle not in line:
            continue
        if in_code:
            start = i
            while start > 0 and lines[start - 1].rstrip().endswith("\\"):
                start -= 1
            end = i
            while lines[end].rstrip().endswith("\\") and end + 1 < len(lines):
                end += 1
            return " ".join(l.strip().rstrip("\\").strip() for l in lines[start:end + 1])
        for span in re.findall(r"`([^`]+)`", line):
            if needle in span and re.match(r"(\S+=\S+ )*(\.venv/bin/)?(python|fabric-perf|bash)\b", span):
                return span
    return None


def _command_from_args(doc: Any, script: str) -> str | None:
    args = doc.get("args") if isinstance(doc, dict) else None
    if not isinstance(args, dict):
        return None
    words = ["python", script]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            words.append(flag)
        elif value not in (None, False):
            words += [flag, str(value)]
    return " ".join(words)


def command_of(doc: Any, filename: str, options: dict) -> str | None:
    if options.get("command"):
        return options["command"]
    if isinstance(doc, dict):
        cmd = doc.get("command")
        if isinstance(cmd, list) and cmd:
            return " ".join(str(c) for c in cmd)
        if isinstance(cmd, str) and cmd.strip():
            cmd = cmd.strip()
            return ("python " + cmd) if cmd.split()[0].endswith(".py") else cmd
        argv = doc.get("argv")
        if isinstance(argv, list) and argv:
            first = str(argv[0])
            return " ".join((["python"] if first.endswith(".py") else []) + [str(a) for a in argv])
    found = _command_from_results_md(filename)
    if found:
        return found
    if options.get("script"):
        return _command_from_args(doc, options["script"])
    return None


def machine_of(doc: Any) -> str | None:
    """One line on where the figures were measured, from the JSON."""
    if not isinstance(doc, dict):
        return None
    parts = []
    m = doc.get("machine")
    if isinstance(m, dict):
        if m.get("cpus") is not None:
            parts.append(f"{m['cpus']} CPUs")
        if m.get("platform"):
            parts.append(str(m["platform"]))
        if m.get("python"):
            parts.append(f"Python {m['python']}")
    elif isinstance(m, str):
        parts.append(m)
        if doc.get("cores") is not None:
            parts.append(f"{doc['cores']} cores")
    versions = doc.get("versions")
    if isinstance(versions, dict):
        for name in ("fabric", "grpcio", "pyzmq", "protobuf", "h2"):
            if isinstance(versions.get(name), str):
                parts.append(f"{name} {versions[name]}")
    for name in ("torch",):
        if isinstance(doc.get(name), str):
            parts.append(f"{name} {doc[name]}")
    if isinstance(doc.get("created"), str):
        parts.append(doc["created"][:10])
    return ", ".join(parts) or None


# ------------------------------------------------------------------ tables

def human_size(n: float) -> str:
    n = int(n)
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _split_list(text: str | None) -> list[str]:
    return [p.strip() for p in (text or "").split(",") if p.strip()]


def _pairs(text: str | None) -> list[tuple[str, str | None]]:
    out = []
    for item in _split_list(text):
        key, _, label = item.partition("=")
        out.append((key.strip(), label.strip() or None))
    return out


class Table:
    """rows x columns of cells (numbers, or dicts of numbers), in order."""

    def __init__(self) -> None:
        self.rows: list[str] = []
        self.row_units: dict[str, str] = {}
        self.columns: list[str] = []
        self.cells: dict[tuple[str, str], Any] = {}

    def add(self, row: str, column: str, cell: Any) -> None:
        if row not in self.rows:
            self.rows.append(row)
        if column not in self.columns:
            self.columns.append(column)
        self.cells[(row, column)] = cell


def _records_key(record: dict, fields: list[str]) -> str:
    vals = []
    for f in fields:
        if f not in record:
            raise DataError(f"a record has no {f!r}")
        vals.append(str(record[f]))
    return ":".join(vals)


def build_table(doc: Any, opts: dict) -> Table:
    table = Table()
    if opts.get("series"):
        series = lookup(doc, opts["series"], "series: ")
        if not isinstance(series, list):
            raise DataError(f"series {opts['series']!r} is not a list")
        label_key = opts.get("series-label") or "label"
        points_key = opts.get("points")
        if not points_key:
            raise DataError(":series: needs :points:")
        xs = _split_list(opts.get("x") or "size")
        for run in series:
            if not isinstance(run, dict) or label_key not in run:
                raise DataError(f"a series item has no {label_key!r}")
            for point in run.get(points_key) or []:
                if isinstance(point, dict):
                    table.add(_records_key(point, xs), str(run[label_key]), point)
        return table
    container = lookup(doc, opts.get("rows"), "rows: ")
    if isinstance(container, list):
        fields = _split_list(opts.get("row-key") or "size")
        items = [(_records_key(r, fields), r) for r in container if isinstance(r, dict)]
    elif isinstance(container, dict):
        items = list(container.items())
    else:
        raise DataError(f"rows {opts.get('rows')!r} is neither a mapping nor a list")
    sub = opts.get("row-columns")
    unit_key = opts.get("unit")
    wanted = [c for c, _ in _pairs(opts.get("columns"))]
    seen: list[str] = []
    for row_key, row in items:
        if sub:
            if not isinstance(row, dict):
                continue
            if unit_key and unit_key in row:
                table.row_units[str(row_key)] = str(row[unit_key])
            row = lookup(row, sub, f"row {row_key!r}: ")
        if not isinstance(row, dict):
            continue                     # a scalar beside the rows (a count, a flag)
        if unit_key and not sub and unit_key in row:
            table.row_units[str(row_key)] = str(row[unit_key])
        for col, cell in row.items():
            if "transpose" in opts:
                r, c = str(col), str(row_key)
            else:
                r, c = str(row_key), str(col)
            if c not in seen:
                seen.append(c)
            if wanted and c not in wanted:
                continue
            table.add(r, c, cell)
    missing = [c for c in wanted if c not in seen]
    if missing:
        raise DataError(f"no column {', '.join(map(repr, missing))} (columns: {', '.join(seen[:30])})")
    return table


def cell_value(cell: Any, value_key: str | None) -> float | None:
    if isinstance(cell, dict):
        if value_key:
            return number(cell.get(value_key))
        return None
    return number(cell)


def default_format(x: float) -> str:
    if x == 0:
        return "0"
    magnitude = abs(x)
    if magnitude >= 1000:
        return f"{x:,.0f}"
    if magnitude >= 100:
        return f"{x:.0f}"
    if magnitude >= 10:
        return f"{x:.1f}"
    if magnitude >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def format_cell(cell: Any, opts: dict) -> str:
    if cell is None:
        return "–"
    template = opts.get("cell")
    value = cell_value(cell, opts.get("value"))
    if template:
        fields = dict(cell) if isinstance(cell, dict) else {}
        fields.setdefault("value", value if value is not None else cell)
        try:
            return template.format(**fields)
        except (KeyError, ValueError, TypeError, IndexError) as e:
            raise DataError(f"cell template {template!r} does not fit {cell!r} ({e})") from None
    if value is None:
        if isinstance(cell, (str, int)) and not isinstance(cell, bool):
            return str(cell)
        if isinstance(cell, bool):
            return "yes" if cell else "no"
        raise DataError(f"cell {cell!r} has no number (give :value: or :cell:)")
    fmt = opts.get("format")
    if fmt:
        try:
            return format(value, fmt)
        except ValueError as e:
            raise DataError(f"format {fmt!r}: {e}") from None
    return default_format(value)


def row_label(key: str, opts: dict, units: dict[str, str]) -> str:
    label = key
    if opts.get("row-format") == "size":
        parts = key.split(":")
        if all(re.fullmatch(r"\d+", p) for p in parts):
            label = " : ".join(human_size(int(p)) for p in parts)
    if key in units:
        label += f" ({units[key]})"
    return label


def selected_rows(table: Table, opts: dict) -> list[str]:
    chosen = _split_list(opts.get("select"))
    if not chosen:
        return list(table.rows)
    missing = [r for r in chosen if r not in table.rows]
    if missing:
        raise DataError(f"no row {', '.join(map(repr, missing))} (rows: {', '.join(table.rows[:30])})")
    return chosen


def selected_columns(table: Table, opts: dict) -> list[tuple[str, str]]:
    pairs = _pairs(opts.get("columns"))
    if not pairs:
        return [(c, c) for c in table.columns]
    missing = [c for c, _ in pairs if c not in table.columns]
    if missing:
        raise DataError(f"no column {', '.join(map(repr, missing))} "
                        f"(columns: {', '.join(table.columns[:30])})")
    return [(c, label or c) for c, label in pairs]


def ratio_specs(opts: dict, table: Table) -> list[tuple[str, str, str]]:
    out = []
    for item in _split_list(opts.get("ratios")):
        spec, _, label = item.partition("=")
        if " vs " not in spec:
            raise DataError(f"ratio {item!r} is not 'A vs B[=LABEL]'")
        a, b = (s.strip() for s in spec.split(" vs ", 1))
        for c in (a, b):
            if c not in table.columns:
                raise DataError(f"ratio {item!r}: no column {c!r}")
        out.append((a, b, label.strip() or f"{a} / {b}"))
    return out


# ------------------------------------------------------------------ nodes

class perf_plot(nodes.General, nodes.Element):
    """A plot drawn when the page is written (HTML: a PNG in _images)."""


def _source_node(filename: str, doc: Any, opts: dict, warn) -> nodes.Node:
    para = nodes.container(classes=["perf-source"])
    text = nodes.paragraph()
    text += nodes.Text("From ")
    text += nodes.literal(text=f"bench/results/{filename}" if "/" not in filename else filename)
    machine = machine_of(doc)
    if machine:
        text += nodes.Text(f" ({machine})")
    text += nodes.Text(", measured by:")
    para += text
    cmd = command_of(doc, filename, opts)
    if cmd is None:
        warn(f"{filename}: no command recorded in the JSON or bench/RESULTS.md; give :command:")
        cmd = "(command not recorded)"
    block = nodes.literal_block(cmd, cmd)
    block["language"] = "sh"
    para += block
    return para


COMMON_OPTIONS = {
    "rows": directives.unchanged, "select": directives.unchanged, "columns": directives.unchanged,
    "transpose": directives.flag, "row-key": directives.unchanged, "row-columns": directives.unchanged,
    "value": directives.unchanged, "unit": directives.unchanged, "series": directives.unchanged,
    "series-label": directives.unchanged, "points": directives.unchanged, "x": directives.unchanged,
    "row-format": lambda a: directives.choice(a, ("size", "text")), "command": directives.unchanged,
    "script": directives.unchanged, "caption": directives.unchanged, "no-source": directives.flag,
}


class _PerfDirective(SphinxDirective):
    required_arguments = 1
    final_argument_whitespace = False
    has_content = False

    def _warn(self, message: str) -> None:
        logger.warning(f"perf figures: {message}", location=self.get_location(), type="perf", subtype="data")

    def _data(self):
        filename = self.arguments[0]
        path = resolve_file(filename)
        self.env.note_dependency(path)
        self.env.note_dependency(RESULTS_MD)
        return filename, load(path)

    def _unavailable(self, message: str) -> list[nodes.Node]:
        self._warn(message)
        note = nodes.admonition(classes=["warning"])
        note += nodes.title(text="Figure unavailable")
        note += nodes.paragraph(text=message)
        return [note]

    def run(self) -> list[nodes.Node]:
        try:
            filename, doc = self._data()
            out = self.make(filename, doc)
        except DataError as e:
            return self._unavailable(str(e))
        except Exception as e:        # data of a shape no option expected: a warning, never a crash
            return self._unavailable(f"{self.arguments[0]}: unexpected data ({type(e).__name__}: {e})")
        if "no-source" not in self.options:
            out.append(_source_node(filename, doc, self.options, self._warn))
        return out

    def make(self, filename: str, doc: Any) -> list[nodes.Node]:
        raise NotImplementedError


class PerfTable(_PerfDirective):
    option_spec = dict(COMMON_OPTIONS, cell=directives.unchanged, format=directives.unchanged,
                       ratios=directives.unchanged, header=directives.unchanged,
                       **{"ratio-format": directives.unchanged})

    def make(self, filename, doc):
        opts = self.options
        table = build_table(doc, opts)
        if not table.rows:
            raise DataError(f"{filename}: no rows at {opts.get('rows') or opts.get('series') or 'the top'}")
        rows = selected_rows(table, opts)
        columns = selected_columns(table, opts)
        ratios = ratio_specs(opts, table)
        header = [opts.get("header", "")] + [label for _, label in columns] + [label for *_, label in ratios]
        body = []
        ratio_fmt = opts.get("ratio-format") or ".2f"
        for r in rows:
            line = [row_label(r, opts, table.row_units)]
            line += [format_cell(table.cells.get((r, c)), opts) for c, _ in columns]
            for a, b, _ in ratios:
                va = cell_value(table.cells.get((r, a)), opts.get("value"))
                vb = cell_value(table.cells.get((r, b)), opts.get("value"))
                line.append(format(va / vb, ratio_fmt) + "x" if va is not None and vb else "–")
            body.append(line)
        return [self._table_node(header, body, opts.get("caption"))]

    def _table_node(self, header, body, caption):
        table = nodes.table(classes=["perf-table"])
        if caption:
            table += nodes.title(text=caption)
        group = nodes.tgroup(cols=len(header))
        table += group
        for _ in header:
            group += nodes.colspec(colwidth=1)
        thead = nodes.thead()
        group += thead
        thead += self._row(header, header=True)
        tbody = nodes.tbody()
        group += tbody
        for line in body:
            tbody += self._row(line)
        return table

    @staticmethod
    def _row(cells, header=False):
        row = nodes.row()
        for i, text in enumerate(cells):
            entry = nodes.entry(classes=[] if i == 0 else ["perf-num"])
            entry += nodes.paragraph(text=text)
            row += entry
        return row


class PerfPlot(_PerfDirective):
    option_spec = dict(COMMON_OPTIONS, kind=lambda a: directives.choice(a, ("line", "bar")),
                       logx=directives.flag, logy=directives.flag, xlabel=directives.unchanged,
                       ylabel=directives.unchanged, title=directives.unchanged, alt=directives.unchanged,
                       figsize=directives.unchanged)

    def make(self, filename, doc):
        opts = self.options
        table = build_table(doc, opts)
        rows = selected_rows(table, opts)
        columns = selected_columns(table, opts)
        kind = opts.get("kind", "line")
        series = []
        for c, label in columns:
            points = []
            for r in rows:
                y = cell_value(table.cells.get((r, c)), opts.get("value"))
                if y is None:
                    continue
                if kind == "line":
                    try:
                        x = float(r.split(":")[0])
                    except ValueError:
                        raise DataError(f"row {r!r} is not a number: a line plot needs numeric rows "
                                        "(use :kind: bar)") from None
                    points.append((x, y))
                else:
                    points.append((row_label(r, opts, {}), y))
            if not points:
                raise DataError(f"column {c!r} has no numbers to plot (give :value:?)")
            series.append((label, points))
        try:
            figsize = [float(v) for v in (opts.get("figsize") or "7,4").split(",")]
            assert len(figsize) == 2
        except (ValueError, AssertionError):
            raise DataError(f"figsize {opts.get('figsize')!r} is not W,H in inches") from None
        spec = {
            "kind": kind, "series": series, "logx": "logx" in opts, "logy": "logy" in opts,
            "xlabel": opts.get("xlabel", ""), "ylabel": opts.get("ylabel", ""),
            "title": opts.get("title", ""), "sizes": opts.get("row-format") == "size",
            "rows": [row_label(r, opts, {}) for r in rows], "figsize": figsize,
        }
        digest = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
        node = perf_plot()
        node["spec"] = spec
        node["fname"] = f"perf-{digest}.png"
        node["alt"] = opts.get("alt") or opts.get("title") or opts.get("caption") or f"plot of {filename}"
        out: list[nodes.Node] = [node]
        if opts.get("caption"):
            out.append(nodes.paragraph(text=opts["caption"], classes=["perf-caption"]))
        return out


class PerfValue(SphinxRole):
    """:perf-value:`FILE:PATH[:FORMAT]`: one value from a JSON file."""

    def run(self):
        parts = self.text.split(":")
        if len(parts) < 2:
            return self._fail(f"perf-value {self.text!r} is not FILE:PATH[:FORMAT]")
        filename, path, fmt = parts[0], parts[1], ":".join(parts[2:])
        try:
            full = resolve_file(filename)
            self.env.note_dependency(full)
            value = lookup(load(full), path, f"{filename}: ")
            if isinstance(value, (dict, list)):
                raise DataError(f"{filename}: {path} is not a single value")
            if fmt:
                text = format(value, fmt)
            elif isinstance(value, float):
                text = default_format(value)
            else:
                text = str(value)
        except (DataError, ValueError) as e:
            return self._fail(str(e))
        return [nodes.inline(text=text, classes=["perf-value"])], []

    def _fail(self, message):
        logger.warning(f"perf figures: {message}", location=self.get_location(), type="perf", subtype="data")
        return [nodes.problematic(self.rawtext, self.rawtext)], []


# ------------------------------------------------------------------ drawing

def _size_ticks(ax, axis: str, values: list[float]) -> None:
    import matplotlib.ticker as ticker
    lo, hi = min(values), max(values)
    ticks = []
    v = 1
    while v <= hi * 1.01:
        if v >= lo * 0.99:
            ticks.append(v)
        v *= 4 if hi / max(lo, 1) > 1 << 12 else 2
    fmt = ticker.FuncFormatter(lambda x, _pos: human_size(x).replace(" ", "") if x >= 1 else "")
    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_locator(ticker.FixedLocator(ticks))
    target.set_major_formatter(fmt)
    target.set_minor_locator(ticker.NullLocator())


def render(spec: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=tuple(spec["figsize"]), dpi=110)
    try:
        if spec["kind"] == "line":
            xs_all = []
            for label, points in spec["series"]:
                xs = [p[0] for p in points]
                ys = [p[1] for p in points]
                xs_all += xs
                ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.4, label=label)
            if spec["logx"]:
                ax.set_xscale("log", base=2 if spec["sizes"] else 10)
            if spec["sizes"] and xs_all:
                _size_ticks(ax, "x", xs_all)
        else:
            groups = spec["rows"]
            n = len(spec["series"])
            width = 0.8 / max(n, 1)
            index = {g: i for i, g in enumerate(groups)}
            for k, (label, points) in enumerate(spec["series"]):
                xs = [index[p[0]] + (k - (n - 1) / 2) * width for p in points]
                ax.bar(xs, [p[1] for p in points], width=width, label=label)
            ax.set_xticks(range(len(groups)))
            ax.set_xticklabels(groups, rotation=20 if max(map(len, groups), default=0) > 10 else 0,
                               ha="right" if max(map(len, groups), default=0) > 10 else "center")
        if spec["logy"]:
            ax.set_yscale("log")
        ax.set_xlabel(spec["xlabel"])
        ax.set_ylabel(spec["ylabel"])
        if spec["title"]:
            ax.set_title(spec["title"])
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize="small", frameon=False)
        fig.tight_layout()
        tmp = path + ".tmp"
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)


def visit_perf_plot_html(self, node):
    builder = self.builder
    outdir = os.path.join(builder.outdir, builder.imagedir)
    outfile = os.path.join(outdir, node["fname"])
    if not os.path.exists(outfile):
        os.makedirs(outdir, exist_ok=True)
        try:
            render(node["spec"], outfile)
        except Exception as e:      # a plot that cannot be drawn is a warning, never a crash
            logger.warning(f"perf figures: cannot draw {node['alt']!r}: {e}", location=node,
                           type="perf", subtype="plot")
            raise nodes.SkipNode from None
    src = posixpath.join(builder.imgpath, node["fname"])
    alt = self.attval(node["alt"])
    self.body.append(f'<figure class="perf-figure"><img class="perf-plot" src="{src}" alt="{alt}" />'
                     "</figure>\n")
    raise nodes.SkipNode


def visit_perf_plot_other(self, node):
    raise nodes.SkipNode


def setup(app):
    app.add_node(perf_plot, html=(visit_perf_plot_html, None), latex=(visit_perf_plot_other, None),
                 text=(visit_perf_plot_other, None), man=(visit_perf_plot_other, None),
                 texinfo=(visit_perf_plot_other, None))
    app.add_directive("perf-table", PerfTable)
    app.add_directive("perf-plot", PerfPlot)
    app.add_role("perf-value", PerfValue())
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
