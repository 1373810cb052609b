"""The house's shape, read from its own imports: the contract is the only door between the engine
plugin and the trainer side, the trainer side runs without SGLang, and no import circle exists.

Every import counts, also the ones inside functions (a function-level import is a dependency that
is only hidden)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from _source_trees import parse_file

REPO = Path(__file__).resolve().parents[2]
HOUSE = ("lora_contract", "sglang_ext", "relax_glue", "lora_versions_dev", "lora_versions_demo")
# What each shipped package may import of the house (SGLang itself: only the plugin and dev tools).
ALLOWED = {
    "lora_contract": set(),
    "sglang_ext": {"lora_contract"},
    "relax_glue": {"lora_contract"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> Iterator[str]:
    """Every module ``path`` imports, absolute, wherever in the file the import stands."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for node in ast.walk(parse_file(path)):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            yield target
            # ``from pkg import module`` imports the module too
            yield from (f"{target}.{a.name}" for a in node.names)


def house_graph() -> dict[str, set[str]]:
    files = [p for pkg in HOUSE for p in (REPO / pkg).rglob("*.py")]
    modules = {module_name(p) for p in files}
    graph: dict[str, set[str]] = {}
    for p in files:
        graph[module_name(p)] = {m for m in imports_of(p) if m in modules} - {module_name(p)}
    return graph


def top(module: str) -> str:
    return module.split(".")[0]


def test_each_shipped_package_imports_only_what_it_may_of_the_house() -> None:
    offenders = [
        f"{src} imports {dst}"
        for src, dsts in house_graph().items()
        if top(src) in ALLOWED
        for dst in dsts
        if top(dst) != top(src) and top(dst) not in ALLOWED[top(src)]
    ]
    assert offenders == []


def test_the_contract_and_the_trainer_side_never_name_sglang() -> None:
    offenders = [
        f"{p.relative_to(REPO)} imports {m}"
        for pkg in ("lora_contract", "relax_glue")
        for p in (REPO / pkg).rglob("*.py")
        for m in imports_of(p)
        if top(m) in ("sglang", "sgl_kernel")
    ]
    assert offenders == []


def test_the_trainer_side_imports_where_sglang_cannot_be_imported() -> None:
    """Every module of the trainer side and the contract, imported in a process where ``sglang``
    and the plugin raise ImportError (as on a trainer host installed without the engine extra)."""
    code = f"""
import importlib, importlib.abc, pkgutil, sys

class NoEngine(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("sglang", "sgl_kernel", "sglang_ext"):
            raise ImportError(f"{{name}} is not installed on a trainer host")
        return None

sys.meta_path.insert(0, NoEngine())
sys.path.insert(0, {str(REPO)!r})
names = []
for pkg in ("lora_contract", "relax_glue"):
    mod = importlib.import_module(pkg)
    names.append(pkg)
    for info in pkgutil.walk_packages(mod.__path__, pkg + "."):
        importlib.import_module(info.name)
        names.append(info.name)
assert not [m for m in sys.modules if m.split(".")[0] in ("sglang", "sglang_ext")]
print(len(names))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    # every file of both packages was imported (a package that stopped being walked cannot pass)
    files = [p for pkg in ("lora_contract", "relax_glue") for p in (REPO / pkg).rglob("*.py")]
    assert int(out.stdout.strip()) == len(files)


def test_no_test_folder_can_shadow_an_importable_module() -> None:
    """``tests/`` is on sys.path while the suite runs (its conftest.py has no package), so a test
    folder named like a package (``tests/sglang_ext``) would be found before it, or instead of it."""
    folders = sorted(p.name for p in (REPO / "tests").iterdir() if p.is_dir() and any(p.rglob("*.py")))
    code = "import importlib.util, sys; print([n for n in sys.argv[1:] if importlib.util.find_spec(n)])"
    out = subprocess.run([sys.executable, "-c", code, *folders], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert not set(folders) & set(HOUSE)


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_the_circle_finder_sees_a_circle() -> None:
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_anywhere_in_the_house() -> None:
    """Function-level and TYPE_CHECKING imports included: a circle broken only by deferring an
    import is still a circle."""
    assert import_circles(house_graph()) == []
