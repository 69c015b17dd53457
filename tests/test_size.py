"""The system a reader studies stays about two thousand lines: train.py, generate.py and proxy.py plus every project
module they import, at any depth (imports inside functions too), counted in non-blank lines. Every other module of
minigrpo/ is a side room (the replica server, the dashboard, the demo model's maker).

    python -m pytest -q tests/test_size.py
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("train.py", "generate.py", "proxy.py")
# Ceilings in non-blank lines: the core (its budget; the goal is 2,000), the side rooms together, any one file.
CORE, SIDE, FILE = 2100, 700, 400


def nonblank(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def project_file(module: str) -> str | None:
    """The project's file for a dotted module name (a package's __init__.py), None for anything installed."""
    base = os.path.join(ROOT, *module.split("."))
    return next((p for p in (base + ".py", os.path.join(base, "__init__.py")) if os.path.exists(p)), None)


def imported(path: str) -> set[str]:
    """The project files one file imports, every package on the way included: `from minigrpo import x` names
    minigrpo/__init__.py and minigrpo/x.py, `import minigrpo.x.y` each of minigrpo, minigrpo.x, minigrpo.x.y."""
    package = os.path.relpath(os.path.dirname(path), ROOT).replace(os.sep, ".").split(".")
    names = []
    with open(path, encoding="utf-8") as f:
        for node in ast.walk(ast.parse(f.read())):
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                up = package[:len(package) - node.level + 1] if node.level else []
                base = ".".join([p for p in up if p not in ("", ".")] + ([node.module] if node.module else []))
                names += [base] + [f"{base}.{a.name}".lstrip(".") for a in node.names]
    parts = [n.split(".") for n in names if n]
    return {f for p in parts for i in range(1, len(p) + 1) if (f := project_file(".".join(p[:i])))}


def tiers() -> tuple[set[str], set[str]]:
    core, todo = set(), [os.path.join(ROOT, s) for s in SCRIPTS]
    while todo:
        path = todo.pop()
        if path not in core:
            core.add(path)
            todo += imported(path) - core
    package = {os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ROOT, "minigrpo")) for f in fs if f.endswith(".py")}
    return core, package - core


def test_the_core_side_rooms_and_every_file_stay_within_their_budgets():
    core, side = tiers()
    sizes = {os.path.relpath(p, ROOT): nonblank(p) for p in core | side}
    shown = lambda paths: ", ".join(f"{os.path.relpath(p, ROOT)} {sizes[os.path.relpath(p, ROOT)]}" for p in sorted(paths))
    assert sum(nonblank(p) for p in core) <= CORE, f"core over {CORE} non-blank lines: {shown(core)}"
    assert sum(nonblank(p) for p in side) <= SIDE, f"side rooms over {SIDE} non-blank lines: {shown(side)}"
    assert not [f for f, n in sizes.items() if n > FILE], f"a file over {FILE} non-blank lines: {sizes}"


def test_the_core_reaches_the_package_through_imports_and_never_the_replica_server():
    core, side = tiers()
    names = {os.path.relpath(p, ROOT) for p in core}
    assert {"train.py", "generate.py", "proxy.py", "minigrpo/engine.py", "minigrpo/lora.py"} <= names
    assert {"minigrpo/replica/serve.py", "minigrpo/replica/sampling.py", "minigrpo/replica/scheduler.py"} <= {
        os.path.relpath(p, ROOT) for p in side}
