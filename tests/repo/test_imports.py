"""The import order of h2jax: no circle between its packages, no reach into another package's
private ``_module``.

Every ``import`` of every module is read with ``ast`` (function-local imports too: a circle
closed inside a function is still a circle), nothing is executed. A *unit* is a subpackage
(``h2jax.plan``) or a top-level module (``h2jax.cli``, ``h2jax._strict``); the top-level
private modules (``h2jax._strict``, ``h2jax._jaxpr``, ...) are the shared low-level layer
every package may import, while ``h2jax.<package>._<module>`` is that package's own business:
other packages use the names its ``__init__`` exports.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "h2jax"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


@functools.cache
def is_package(name: str) -> bool:
    return (ROOT / Path(*name.split(".")) / "__init__.py").is_file()


def imports_of(source: str, name: str, *, package: bool = False) -> set[str]:
    """The h2jax modules that module ``name`` imports (``from A import b``: ``A.b`` when that is
    a module, else ``A``)."""
    here = name if package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            for a in node.names:
                sub = f"{base}.{a.name}"
                exists = (ROOT / Path(*sub.split("."))).with_suffix(".py").is_file() or is_package(sub)
                found.add(sub if exists else base)
    return {m for m in found if m == "h2jax" or m.startswith("h2jax.")}


def unit_of(module: str) -> str:
    """``h2jax.plan._cost`` -> ``h2jax.plan``; ``h2jax._strict`` -> ``h2jax._strict``."""
    return ".".join(module.split(".")[:2])


def private_reaches(importer: str, imported: str) -> bool:
    """Whether ``importer`` reaches into a private module of another package."""
    parts = imported.split(".")
    private = len(parts) >= 3 and any(p.startswith("_") for p in parts[2:]) and is_package(".".join(parts[:2]))
    return private and unit_of(importer) != unit_of(imported)


@functools.cache
def all_imports() -> dict[str, set[str]]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        out[name] = imports_of(path.read_text(), name, package=path.name == "__init__.py")
    return out


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def unit_graph(imports: dict[str, set[str]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for importer, imported in imports.items():
        a = unit_of(importer)
        graph.setdefault(a, set()).update(unit_of(m) for m in imported if unit_of(m) not in (a, "h2jax"))
    return graph


def module_graph(imports: dict[str, set[str]]) -> dict[str, set[str]]:
    """Module -> modules, without a module's import of its own package's ``__init__`` (which
    imports it back by construction)."""
    return {
        importer: {m for m in imported if m != "h2jax" and not (is_package(m) and importer.startswith(m + "."))}
        for importer, imported in imports.items()
    }


def test_no_circle_between_packages():
    assert circles(unit_graph(all_imports())) == []


def test_no_circle_between_modules():
    assert circles(module_graph(all_imports())) == []


def test_no_import_of_another_packages_private_module():
    bad = sorted(
        (importer, m) for importer, imported in all_imports().items() for m in imported if private_reaches(importer, m)
    )
    assert bad == [], "use the names the package's __init__ exports: " + ", ".join(f"{a} -> {b}" for a, b in bad)


def test_the_checks_catch_what_they_forbid():
    """The checker itself: a circle closed inside a function and a private reach are found."""
    local = "def f():\n    from h2jax.runtime._stage import StageProgram\n"
    assert imports_of(local, "h2jax.align._tool") == {"h2jax.runtime._stage"}
    assert private_reaches("h2jax.align._tool", "h2jax.runtime._stage")
    assert not private_reaches("h2jax.runtime._runner", "h2jax.runtime._stage")
    assert not private_reaches("h2jax.runtime._stage", "h2jax._jaxpr")
    assert imports_of("from h2jax.comm import _ffi\n", "h2jax.comm._peer") == {"h2jax.comm._ffi"}
    graph = unit_graph({"h2jax.align._tool": {"h2jax.runtime._stage"}, "h2jax.runtime._stage": {"h2jax.align"}})
    assert circles(graph) == [["h2jax.align", "h2jax.runtime"]]


def jax_internal_imports(source: str) -> list[str]:
    """The ``jax._src`` modules a source imports (``import`` and ``from ... import`` alike)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        out += [n for n in names if n == "jax._src" or n.startswith("jax._src.")]
    return out


def test_only_the_compatibility_module_reaches_into_jax_internals():
    """h2jax runs on jax 0.10.2-0.12: what has no public name in that range is reached for in
    xla_plugins/jaxcompat.py alone, each shim naming the releases it was checked against."""
    allowed = ROOT / "xla_plugins" / "jaxcompat.py"
    bad = {
        str(p.relative_to(ROOT)): found
        for p in sorted([*PACKAGE.rglob("*.py"), *(ROOT / "xla_plugins").rglob("*.py")])
        if p != allowed and (found := jax_internal_imports(p.read_text()))
    }
    assert bad == {}, "add a shim to xla_plugins/jaxcompat.py instead"
    assert jax_internal_imports(allowed.read_text())  # the check reads what it forbids
    assert jax_internal_imports("def f():\n    from jax._src.lib import xla_client\n") == [
        "jax._src.lib",
        "jax._src.lib.xla_client",
    ]
