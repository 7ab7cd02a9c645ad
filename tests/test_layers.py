"""The package's layers (ARCHITECTURE.md, section 2): every import inside `elasjax` goes to the
same layer or one below, and no modules import each other in a circle. Read from the sources'
import statements (nothing is imported here), so a new module must be placed in a layer."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "elasjax"

# bottom first; a module is matched by its longest listed prefix. Every layer is one package
# (or, at the top, the public names, the pieces and the command line): a module outside them is an
# error, so a new module must be placed in a package of the right layer.
LAYERS = [
    ("core", ["core"]),
    ("config", ["config"]),
    ("models", ["models"]),
    ("plan", ["plan"]),
    ("observe", ["observe"]),
    ("transfer", ["transfer"]),
    ("layout", ["layout"]),
    ("runtime", ["runtime"]),
    ("compile", ["compilation"]),
    ("loop", ["loop"]),
    ("launch", ["launch"]),
    ("top", ["", "elastic", "cli", "bench", "sim"]),
]


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The `elasjax` modules `name` imports (relative to the package, "" for elasjax itself)."""
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    pkg = [p for p in pkg if p]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)] + ([node.module] if node.module else [])
                target = ".".join(base)
            elif (node.module or "").split(".")[0] == "elasjax":
                target = node.module[len("elasjax."):] if node.module != "elasjax" else ""
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                out.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "elasjax":
                    out.add(alias.name[len("elasjax."):] if alias.name != "elasjax" else "")
    out.discard(name)
    return {m for m in out if m in modules}


def _layer(name: str) -> int:
    best, found = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for pre in prefixes:
            hit = name == pre or (pre and name.startswith(pre + "."))
            if hit and len(pre) > best:
                best, found = len(pre), i
    assert found is not None, f"elasjax.{name} is in no layer of tests/test_layers.py"
    return found


def test_every_import_goes_to_the_same_layer_or_below():
    modules = _modules()
    up = []
    for name, path in modules.items():
        for dep in _imports(name, path, modules):
            if _layer(dep) > _layer(name):
                up.append(f"elasjax.{name} ({LAYERS[_layer(name)][0]}) imports elasjax.{dep} "
                          f"({LAYERS[_layer(dep)][0]})")
    assert not up, "\n".join(sorted(up))


def test_no_modules_import_each_other_in_a_circle():
    modules = _modules()
    graph = {n: _imports(n, p, modules) for n, p in modules.items()}
    state: dict[str, int] = {}
    circles = []

    def visit(n, path):
        state[n] = 1
        for d in sorted(graph[n]):
            if state.get(d) == 1:
                circles.append(" -> ".join(path[path.index(d):] + [d]))
            elif d not in state:
                visit(d, path + [d])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert not circles, circles


def test_the_layer_table_names_only_modules_that_exist():
    modules = _modules()
    for _, prefixes in LAYERS:
        for pre in prefixes:
            assert any(m == pre or m.startswith(pre + ".") for m in modules), pre
