"""probekit's modules import each other without a circle.

The graph is built from the source (the AST of every ``probekit/**.py``), so an import inside a
function counts as much as one at the top of a module: a function-level import only postpones a
circle until the function runs, it does not remove it.

What is an edge ``A -> B``:

* every ``import`` / ``from ... import`` statement anywhere in module A (top level, inside a
  function or class, under ``if TYPE_CHECKING``), resolved against A's package;
* ``from P import n`` is an edge to the module ``P.n`` when that is a probekit module, otherwise
  to ``P`` itself: ``from .. import FreeBench`` is an edge to ``probekit`` (its ``__init__``),
  which is how a lazy export through a package ``__init__`` turns into a circle;
* ``import a.b.c`` is an edge to ``a.b.c`` (the deepest probekit module it names).

What is not an edge, and why:

* the parent packages Python initialises before a submodule (``import probekit.grads.store``
  runs ``probekit/__init__`` and ``probekit/grads/__init__`` first). A package ``__init__`` that
  imports its submodules would otherwise sit in a circle with every one of them; the order in
  which packages are initialised is Python's, not a dependency a module chose.
* names looked up at run time from data: ``probekit.lazy.lazy_exports`` tables (``{"GradProbe":
  "probekit.grads"}``) and the ``PrecisionDebugger`` feature registry (``"module:factory"``).
  They are strings resolved by ``importlib`` on first access, after both modules have finished
  initialising; a package exporting its submodules' names lazily is not a circle (an import
  statement of such a name, as above, is an edge to the package).
* imports of modules outside probekit.

Besides having no circle, ``probekit.freebench`` and ``probekit.grads`` are laid out by stage
(``STAGES``): a module of one stage imports only the stages after it, and ``probekit/`` outside
``probekit/notebook/`` imports neither IPython nor ipywidgets (the headless core).
"""
import ast
import os

import probekit

ROOT = os.path.dirname(os.path.abspath(probekit.__file__))


def modules() -> dict:
    """{module name: file path} of every probekit module."""
    out = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def _targets(module: str, path: str, node, known) -> list:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        if node.level:
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = f"{base}.{node.module}" if node.module else base
        else:
            target = node.module
        names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target
                 for a in node.names]
    out = []
    for name in names:
        while name not in known and "." in name:
            name = name.rpartition(".")[0]
        if name in known and name != module:
            out.append(name)
    return out


def import_graph() -> dict:
    """{module: {imported module: first line of an import statement making that edge}}."""
    known = modules()
    graph = {}
    for module, path in known.items():
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        edges = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(module, path, node, known):
                    edges[target] = min(edges.get(target, node.lineno), node.lineno)
        graph[module] = edges
    return graph


def cycles(graph: dict) -> list:
    """One circle (a list of modules, first == last) per strongly connected component of more
    than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_circle(graph, component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _circle(graph: dict, component: set) -> list:
    """A shortest circle through the first module of ``component`` (breadth first)."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v]):
            if w == start:
                return paths[v] + [start]
            if w in component and w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    raise AssertionError(f"no circle through {start} in {sorted(component)}")


def _describe(graph: dict, circle: list) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(circle, circle[1:])) + \
        f" -> {circle[-1]}"


def test_the_graph_sees_imports_inside_functions():
    """The builder itself: edges made only by function-level imports are in the graph."""
    graph = import_graph()
    # compare_grads imports the engine and the readers inside the function
    assert "probekit.grads.compare.engine" in graph["probekit.grads.compare.compare"]
    assert "probekit.grads.store.sources" in graph["probekit.grads.compare.compare"]
    # `from .grads.compare import cli as _grads_cli` inside build_parser: the submodule, not the package
    assert "probekit.grads.compare.cli" in graph["probekit.cli"]
    # the package __init__ imports its submodules; the submodule gets no edge back by itself
    assert "probekit.grads.record.recorder" in graph["probekit.grads"]
    assert "probekit.grads" not in graph["probekit.grads.numerics.stats"]
    assert cycles({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}}) == [
        ["a", "b", "c", "a"]]


def test_no_import_cycle():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles in probekit:\n" + "\n".join(
        _describe(graph, c) for c in found)


#: The stages of a package, in the order data flows through them: a module of a stage imports
#: modules of its own stage and of the stages in later layers, never one of an earlier layer or
#: of another stage in its own layer. A stage is the first name after the package (a sub-package
#: or a single module); every module of the package but its ``__init__`` (the public facade,
#: which exports from every stage) belongs to one. docs/architecture.md draws this graph.
STAGES = {
    "probekit.freebench": [("session",), ("report",), ("repro",), ("engine",), ("judge",),
                           ("perturb",), ("names",)],
    "probekit.grads": [("record", "compare"), ("store",), ("numerics",)],
}


def stage_violations(graph: dict, package: str, layers: list) -> list:
    """``(importer, imported, line, why)`` of every edge inside ``package`` that breaks
    ``layers``' order (see ``STAGES``), plus modules belonging to no stage."""
    rank = {stage: i for i, layer in enumerate(layers) for stage in layer}

    def stage_of(module):
        return module[len(package) + 1:].split(".")[0]

    found = []
    for module in sorted(graph):
        if not module.startswith(package + "."):
            continue
        src = stage_of(module)
        if src not in rank:
            found.append((module, None, None, f"{src!r} is in no stage"))
            continue
        for target, line in sorted(graph[module].items()):
            if target == package:
                found.append((module, target, line, "imports the package facade"))
            elif target.startswith(package + "."):
                dst = stage_of(target)
                if dst == src or dst not in rank:
                    continue
                if rank[dst] < rank[src]:
                    found.append((module, target, line, f"{src} imports earlier stage {dst}"))
                elif rank[dst] == rank[src]:
                    found.append((module, target, line, f"{src} imports its peer {dst}"))
    return found


def test_the_stage_check_catches_back_edges():
    """The checker itself, on a made-up package: a back edge, a peer edge, an edge to the
    facade and a module outside every stage are each reported; forward edges are not."""
    graph = {
        "p": {"p.top.a": 1},
        "p.top.a": {"p.mid.b": 3, "p.low": 4, "other": 5},   # forward: allowed
        "p.mid.b": {"p.top.a": 7, "p.low": 8},                 # back edge at line 7
        "p.side.c": {"p.mid.b": 2},                            # its peer, at line 2
        "p.low": {"p": 9},                                     # the facade, at line 9
        "p.stray": {},                                         # no stage
    }
    layers = [("top",), ("mid", "side"), ("low",)]
    assert stage_violations(graph, "p", layers) == [
        ("p.low", "p", 9, "imports the package facade"),
        ("p.mid.b", "p.top.a", 7, "mid imports earlier stage top"),
        ("p.side.c", "p.mid.b", 2, "side imports its peer mid"),
        ("p.stray", None, None, "'stray' is in no stage"),
    ]
    assert stage_violations({"p.top.a": {"p.low": 1}, "p.low": {}}, "p", layers) == []


def test_sub_packages_import_only_later_stages():
    graph = import_graph()
    for package, layers in STAGES.items():
        # every stage named exists (a renamed sub-package would make the check vacuous)
        stages = {m[len(package) + 1:].split(".")[0] for m in graph if m.startswith(package + ".")}
        assert stages == {s for layer in layers for s in layer}, package
        assert stage_violations(graph, package, layers) == [], package


HEADLESS_BANNED = ("IPython", "ipywidgets")


def gui_imports(path: str) -> list:
    """``(line, imported module)`` of every import of IPython or ipywidgets in a file, at any
    depth (inside functions and methods too)."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module]
        else:
            continue
        out += [(node.lineno, n) for n in names if n.split(".")[0] in HEADLESS_BANNED]
    return out


def test_headless_core_imports_no_ipython(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\ndef f():\n    from IPython.display import display\n"
                   "    import ipywidgets as w, json\n")
    assert gui_imports(str(bad)) == [(3, "IPython.display"), (4, "ipywidgets")]
    notebook = os.path.join(ROOT, "notebook") + os.sep
    core = {m: p for m, p in modules().items() if not p.startswith(notebook)}
    assert "probekit.plot" in core and "probekit.notebook.display" not in core
    assert {m: gui_imports(p) for m, p in core.items() if gui_imports(p)} == {}
    # the notebook layer is where they are
    assert gui_imports(os.path.join(ROOT, "notebook", "display.py")) != []
