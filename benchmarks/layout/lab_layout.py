"""The lab's layout in numbers: files and lines per (sub)package, and the longest functions.

    python benchmarks/layout/lab_layout.py [src/mixprec/lab]

Printed: one line per folder (files, lines), then the ten longest functions (lines from ``def`` to the
last line of the body, decorators excluded) and how many run past 40 lines. Pair it with
``duplicates --repo src/mixprec/lab`` for repeated code.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path


def main(root: Path) -> None:
    files: dict[str, list[int]] = defaultdict(list)
    functions = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        folder = str(path.parent.relative_to(root.parent))
        files[folder].append(len(text.splitlines()))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(root)}:{node.name}"))
    for folder, lines in files.items():
        print(f"{folder:24} {len(lines):3} files {sum(lines):6} lines (largest {max(lines)})")
    functions.sort(reverse=True)
    print(f"\n{len(functions)} functions, {sum(1 for n, _ in functions if n > 40)} over 40 lines; longest:")
    for n, name in functions[:10]:
        print(f"  {n:4}  {name}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "src/mixprec/lab"))
