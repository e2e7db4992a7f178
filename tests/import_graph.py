"""The import graph of the `epdserve` tree between its sub-packages, read from the source (no module is imported).

Every import counts, those inside functions included (a function-level import is a dependency all the same,
only a later one); those under `if TYPE_CHECKING:` do not (they never run). Each module is counted in its
sub-package: the first three parts of its name (`epdserve.services.host`, `epdserve.shared.models`), or the
module itself where it sits directly in a top folder (`epdserve.shared.config`, `epdserve.transport.transports`).

    .venv/bin/python tests/import_graph.py            # the edges between sub-packages, then any cycle
    .venv/bin/python tests/import_graph.py --root DIR  # another checkout's tree

tests/unit/test_import_graph.py holds the tree to no cycle.
"""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("shared", "kernels", "transport", "services")
API_FOLDER = "shared/api"  # the top-level package `epdserve` itself (setup.py)


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the tree by its import name."""
    names = {}
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root)
            if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                continue
            if rel.as_posix().startswith(API_FOLDER + "/"):
                parts = ["epdserve", *rel.relative_to(API_FOLDER).with_suffix("").parts]
            else:
                parts = ["epdserve", *rel.with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names[".".join(parts)] = path
    return names


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the tree that module `name` imports, anywhere in it."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = _type_checking_lines(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from a import b` imports a.b where b is a module, else a's name b.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def unit(name: str) -> str:
    """The sub-package a module is counted in."""
    return ".".join(name.split(".")[:3])


def subpackage_graph(root: Path = ROOT) -> dict[str, dict[str, set[str]]]:
    """{importer unit: {imported unit: the module imports behind the edge, as "a -> b"}}."""
    modules = module_names(root)
    graph: dict[str, dict[str, set[str]]] = {}
    for name, path in modules.items():
        graph.setdefault(unit(name), {})
        for target in imports_of(name, path, modules):
            if unit(target) != unit(name):
                graph[unit(name)].setdefault(unit(target), set()).add(f"{name} -> {target}")
    return graph


def cycles(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one unit (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, {}):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to read (default: this one)")
    args = parser.parse_args()
    graph = subpackage_graph(args.root)
    for source in sorted(graph):
        if graph[source]:
            print(f"{source} -> {', '.join(sorted(graph[source]))}")
    found = cycles(graph)
    print(f"\n{len(graph)} sub-packages, {sum(len(v) for v in graph.values())} edges, {len(found)} cycles")
    for component in found:
        print("cycle:", " <-> ".join(component))
        for a in component:
            for b in component:
                for edge in sorted(graph[a].get(b, ())):
                    print("   ", edge)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
