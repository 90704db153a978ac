"""The layers of docs/ARCHITECTURE.md, checked on every import statement in src/ (module level and
inside functions alike): the core imports nothing above it, nothing imports the lab, and inside the core
each package imports only the rows below its own. Also: no module-level import circle, a flat top level
of at most 12 modules, no module over 400 lines, and every package says what it holds and may import."""

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "mixprec"
ABOVE_CORE = ("diagnostics", "distributed", "integrations")

# The core, bottom up. A unit (a package, or a module left flat) may import its own modules, the units of
# its own row and the units of the rows below; imports under ``if TYPE_CHECKING:`` (annotations) are
# exempt. Circles inside a row are caught by test_no_module_level_import_circle.
CORE_ROWS = [
    ("formats", "fusion", "model_io"),                   # number formats; compiled hot functions; model I/O
    ("recipe",),                                         # the frozen configuration and its grammar
    ("devices", "casting", "update", "guards"),          # what runs in which dtype; 16-bit updates; guards
    ("step", "loss_scale", "fp8"),                       # the step's pieces; loss scales; fp8 layers
    ("engine", "engine_args", "checkpoint"),             # the engine and the state it saves and loads
]
# Named exceptions to the rows, each with its reason.
CORE_EXCEPTIONS = {
    # The grammar spells op-list edits and saved-tensor policies: it reads their vocabulary (OpPolicy,
    # the known op names, Saved) from the two modules that define and apply them. Neither imports
    # anything of mixprec but the vocabulary (oplists.py reads autocast's policies through
    # oplist_probe.py, which imports nothing of mixprec: test_vocabulary_modules_import_nothing_of_mixprec),
    # so no circle can form.
    ("recipe", "casting.oplists"), ("recipe", "casting.saved16"),
}
VOCABULARY = ("casting/oplists.py", "casting/oplist_probe.py", "casting/saved16.py")


def _unit(parts: tuple[str, ...]) -> str:
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(parts: tuple[str, ...]) -> str:
    """``("mixprec", "diagnostics", "ranges")`` -> "diagnostics"; the core for the rest."""
    if len(parts) > 1 and parts[1] == "lab":
        return "lab"
    if len(parts) > 1 and parts[1] in ABOVE_CORE:
        return parts[1]
    return "front" if parts == ("mixprec",) else "core"


def _is_type_checking(node: ast.If) -> bool:
    return (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING") or (
        isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")


def _walk(tree: ast.AST, *, module_level_only: bool):
    """(import node, under TYPE_CHECKING) for every import in ``tree``; with ``module_level_only``, the
    imports a module runs when it is imported (not those in functions or under TYPE_CHECKING)."""
    def visit(node, typing_only, top):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                if not module_level_only or (top and not typing_only):
                    yield child, typing_only
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                if not module_level_only:
                    yield from visit(child, typing_only, False)
            elif isinstance(child, ast.If) and _is_type_checking(child):
                yield from visit(child, True, top)
            else:
                yield from visit(child, typing_only, top)
    yield from visit(tree, False, True)


def _targets(path: pathlib.Path, node: ast.AST) -> list[tuple[str, ...]]:
    """The mixprec modules an import statement needs executed (a submodule named in ``from P import m``
    counts as one)."""
    parts = ("mixprec", *path.relative_to(SRC).with_suffix("").parts)
    package = parts[:-1]
    if isinstance(node, ast.Import):
        return [tuple(a.name.split(".")) for a in node.names if a.name.split(".")[0] == "mixprec"]
    if node.level:
        base = package[: len(package) - node.level + 1]
        target = base + tuple(node.module.split(".") if node.module else ())
    elif node.module and node.module.split(".")[0] == "mixprec":
        target = tuple(node.module.split("."))
    else:
        return []
    subs = [target + (a.name,) for a in node.names
            if SRC.joinpath(*target[1:], a.name + ".py").exists() or SRC.joinpath(*target[1:], a.name).is_dir()]
    return ([target] if node.module or not subs else []) + subs


def _module(path: pathlib.Path) -> tuple[str, ...]:
    parts = ("mixprec", *path.relative_to(SRC).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imports(*, with_typing: bool = True) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """(file, importing module, imported module) for every mixprec-internal import in src/."""
    found = []
    for path in SRC.rglob("*.py"):
        for node, typing_only in _walk(ast.parse(path.read_text()), module_level_only=False):
            if typing_only and not with_typing:
                continue
            found += [(str(path.relative_to(SRC)), _module(path), t) for t in _targets(path, node)]
    return found


def test_the_scan_sees_the_imports_it_must_judge():
    # The rules below are only as good as this scan: it must find a known core import, a known
    # relative import inside a function, imports of the lab by the lab itself, an import that only
    # annotations need, and a submodule named in ``from package import module``.
    edges = {(m, t) for _, m, t in _imports()}
    assert (("mixprec", "engine"), ("mixprec", "casting", "tf32")) in edges
    assert any(m[:2] == ("mixprec", "lab") and t[:2] == ("mixprec", "lab") for m, t in edges)
    assert any(m == ("mixprec", "diagnostics", "memory_report") and t == ("mixprec", "engine")
               for m, t in edges)
    annotations_only = {(m, t) for _, m, t in _imports()} - {(m, t) for _, m, t in _imports(with_typing=False)}
    assert (("mixprec", "step", "optimizer"), ("mixprec", "engine")) in annotations_only
    assert (("mixprec", "lab", "cli"), ("mixprec", "lab", "checkpoint_cli")) in edges


@pytest.mark.parametrize("rule", ["core imports nothing above it", "nothing outside the lab imports it"])
def test_import_rule(rule):
    bad = []
    for file, module, target in _imports():
        src, dst = _layer(module), _layer(target)
        if rule.startswith("core") and src == "core" and dst not in ("core",):
            bad.append(f"{file}: {'.'.join(module)} imports {'.'.join(target)}")
        if rule.startswith("nothing") and dst == "lab" and src != "lab":
            bad.append(f"{file}: {'.'.join(module)} imports {'.'.join(target)}")
    assert not bad, f"{rule}, but:\n" + "\n".join(bad)


def test_the_core_rows_name_every_core_unit():
    # A new package or flat module must be placed in a row (or this test says so), never left unjudged.
    units = {p.stem if p.is_file() else p.name for p in SRC.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())}
    core = units - {"lab", *ABOVE_CORE}
    rowed = {u for row in CORE_ROWS for u in row}
    assert core == rowed, f"not in CORE_ROWS: {sorted(core - rowed)}; gone: {sorted(rowed - core)}"


def test_inside_the_core_each_unit_imports_only_its_row_and_below():
    row_of = {u: i for i, row in enumerate(CORE_ROWS) for u in row}
    bad = []
    for file, module, target in _imports(with_typing=False):
        if _layer(module) != "core" or _layer(target) != "core" or module == ("mixprec",):
            continue
        src, dst = _unit(module), _unit(target)
        if src == dst:
            continue
        if dst == "__init__":
            bad.append(f"{file}: {'.'.join(module)} imports the front door")
            continue
        if (src, ".".join(target[1:3])) in CORE_EXCEPTIONS:
            continue
        if row_of[dst] > row_of[src]:
            bad.append(f"{file}: {'.'.join(module)} (row {row_of[src]}) imports {'.'.join(target)} "
                       f"(row {row_of[dst]})")
    assert not bad, "a core unit imports a row above its own:\n" + "\n".join(bad)


def test_vocabulary_modules_import_nothing_of_mixprec():
    # Nothing but each other: what the recipe reads runs none of the rows above it.
    vocabulary = {("mixprec", *pathlib.Path(f).with_suffix("").parts) for f in VOCABULARY}
    for file in VOCABULARY:
        path = SRC / file
        found = [t for node, _ in _walk(ast.parse(path.read_text()), module_level_only=False)
                 for t in _targets(path, node) if t not in vocabulary]
        assert not found, f"{file} is read by the recipe, so it may import nothing of mixprec: {found}"


def test_no_module_level_import_circle():
    # What a module runs when imported: its module-level imports (not those inside functions or under
    # TYPE_CHECKING). A circle there means one module of it sees another half-executed.
    graph: dict[tuple, set] = {}
    for path in SRC.rglob("*.py"):
        graph.setdefault(_module(path), set()).update(
            t for node, _ in _walk(ast.parse(path.read_text()), module_level_only=True)
            for t in _targets(path, node))
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def strongconnect(v):                      # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v), on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(".".join(w))
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                circles.append(sorted(component))

    for v in list(graph):
        if v not in index:
            strongconnect(v)
    assert not circles, "module-level import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_top_level_stays_small_and_every_package_says_what_it_holds():
    flat = sorted(p.name for p in SRC.glob("*.py"))
    assert len(flat) <= 12, f"{len(flat)} modules flat in src/mixprec (at most 12): {flat}"
    for init in SRC.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init.relative_to(SRC)} has no opening docstring saying what the package holds"
    for pkg in [*{u for row in CORE_ROWS for u in row}, *ABOVE_CORE, "lab"]:
        init = SRC / pkg / "__init__.py"
        if init.exists():
            assert "may import" in ast.get_docstring(ast.parse(init.read_text())).lower(), \
                f"{pkg}/__init__.py does not say what the package may import"


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"modules over 400 lines (split them by concept): {long}"


def test_the_core_runs_without_the_lab_extra():
    # rich, matplotlib and scikit-learn are the lab's (mixprec[lab]); nothing below the lab imports them.
    lab_only = {"rich", "matplotlib", "sklearn"}
    bad = []
    for path in SRC.rglob("*.py"):
        if path.relative_to(SRC).parts[0] == "lab":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                     else [])
            bad += [f"{path.relative_to(SRC)}: {n}" for n in names if n.split(".")[0] in lab_only]
    assert not bad, "lab-only dependencies imported below the lab:\n" + "\n".join(bad)


SCRIPTS = sorted((SRC.parents[1] / "benchmarks").rglob("*.py")) + sorted((SRC.parents[1] / "examples").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(SRC.parents[1])))
def test_benchmark_and_example_scripts_import_names_that_exist(script):
    # Scripts are run by hand (and on the GPU machine), not by the suite: a name moved in src/ would
    # otherwise break them unnoticed (benchmarks/memory/memory_recipes.py did, after the layout change).
    import importlib.util
    import warnings

    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mixprec":
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", DeprecationWarning)   # an old path: say where it moved
                    module = importlib.import_module(node.module)
            except ImportError as e:
                if "pip install 'mixprec[" not in str(e):      # an integration's own extra is missing
                    raise
                pytest.skip(f"{script.name}: {e}")
            missing = [a.name for a in node.names if not hasattr(module, a.name)
                       and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
            assert not missing, f"{script.name}: {node.module} has no {missing}"


BENCHMARKS = SRC.parents[1] / "benchmarks"


@pytest.mark.parametrize("script", sorted(BENCHMARKS.rglob("*.py")), ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_a_benchmark_finds_the_benchmarks_it_imports(script):
    # Run as ``python benchmarks/<folder>/<script>.py``, a script sees its own folder; a module of another
    # folder needs that folder put on sys.path by name (plan/plan_e2e.py imports step/bench_e2e.py).
    homes = {p.stem: p.parent for p in BENCHMARKS.rglob("*.py")}
    text = script.read_text()
    for node in ast.walk(ast.parse(text)):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
        for name in names:
            home = homes.get(name.split(".")[0])
            if home is not None and home != script.parent:
                assert f'"{home.name}"' in text and "sys.path.insert" in text, (
                    f"{script.relative_to(BENCHMARKS)} imports {name} from {home.name}/ without putting it on sys.path")
