"""The import rule of docs/ARCHITECTURE.md, checked on every import statement in src/ (module level
and inside functions alike): the core imports nothing above it, and nothing imports the lab."""

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "mixprec"
ABOVE_CORE = ("diagnostics", "distributed", "integrations")


def _layer(parts: tuple[str, ...]) -> str:
    """``("mixprec", "diagnostics", "ranges")`` -> "diagnostics"; the core for the rest."""
    if len(parts) > 1 and parts[1] == "lab":
        return "lab"
    if len(parts) > 1 and parts[1] in ABOVE_CORE:
        return parts[1]
    return "front" if parts == ("mixprec",) else "core"


def _imports() -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """(file, importing module, imported module) for every mixprec-internal import in src/."""
    found = []
    for path in SRC.rglob("*.py"):
        parts = ("mixprec", *path.relative_to(SRC).with_suffix("").parts)
        package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
        module = parts if parts[-1] != "__init__" else parts[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - node.level + 1]
                target = base + tuple(node.module.split(".") if node.module else ())
                found.append((str(path.relative_to(SRC)), module, target))
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mixprec":
                found.append((str(path.relative_to(SRC)), module, tuple(node.module.split("."))))
            elif isinstance(node, ast.Import):
                found += [(str(path.relative_to(SRC)), module, tuple(a.name.split(".")))
                          for a in node.names if a.name.split(".")[0] == "mixprec"]
    return found


def test_the_scan_sees_the_imports_it_must_judge():
    # The rule below is only as good as this scan: it must find a known core import, a known
    # relative import inside a function, and imports of the lab by the lab itself.
    edges = {(m, t) for _, m, t in _imports()}
    assert (("mixprec", "engine"), ("mixprec", "casting")) in edges
    assert any(m[:2] == ("mixprec", "lab") and t[:2] == ("mixprec", "lab") for m, t in edges)
    assert any(m == ("mixprec", "diagnostics", "memory_report") and t == ("mixprec", "engine")
               for m, t in edges)


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


SCRIPTS = sorted((SRC.parents[1] / "benchmarks").glob("*.py")) + sorted((SRC.parents[1] / "examples").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_and_example_scripts_import_names_that_exist(script):
    # Scripts are run by hand (and on the GPU machine), not by the suite: a name moved in src/ would
    # otherwise break them unnoticed (benchmarks/memory_recipes.py did, after the layout change).
    import importlib.util

    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mixprec":
            try:
                module = importlib.import_module(node.module)
            except ImportError as e:
                if "pip install 'mixprec[" not in str(e):      # an integration's own extra is missing
                    raise
                pytest.skip(f"{script.name}: {e}")
            missing = [a.name for a in node.names if not hasattr(module, a.name)
                       and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
            assert not missing, f"{script.name}: {node.module} has no {missing}"
