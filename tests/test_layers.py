"""The import contract of ``jdist/`` (DESIGN.md's layout): imports only go down the
floors, no import circles (``TYPE_CHECKING`` imports included), no package imports
another package's private module, and floor 0 never reaches JAX.

The graph is read from the source (every ``import`` statement, also those inside
functions, which are import edges all the same once they run, and those under ``if
TYPE_CHECKING:``, which are a circle for a reader and a type checker), so a circle that
only closes at run time is caught too. An import of a package's submodule counts as an
edge to that submodule only; the implicit import of the parent package does not count.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "jdist"
FLOOR0 = ("jdist.errors", "jdist.store", "jdist.launch")
# DESIGN.md's layout: each package's floor. The top-level ``jdist`` re-exports the
# collectives (torch.distributed's names), so it stands on floor 1
FLOORS = {
    "jdist._typing": 0, "jdist._donation": 0, "jdist._cores": 0, "jdist._hmac": 0,
    "jdist._mailbox": 0, "jdist._xla_threads": 0, "jdist._aligned": 0, "jdist._runs": 0,
    "jdist._placed": 0,
    "jdist.errors": 0, "jdist.store": 0, "jdist.launch": 0,
    "jdist": 1, "jdist.collectives": 1,
    "jdist.sampler": 2, "jdist.dp": 2, "jdist.ddp": 2, "jdist.optim": 2, "jdist.rpc": 2,
    "jdist.algorithms": 2, "jdist.pipelining": 2,
    "jdist.checkpoint": 3, "jdist.ft": 3, "jdist.testing": 3,
}
# at most three exceptions to the contract, each with its reason: (importer package,
# imported module) -> reason. None today.
ALLOWED: dict[tuple[str, str], str] = {}
HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax", "torch", "grain")


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _imports(name: str) -> set[str]:
    """What module ``name`` imports: jdist modules by full name, others by top package."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if _is_package(name) else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else base)
        elif (isinstance(node, ast.Call) and node.args
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and isinstance(node.args[0], ast.Constant)):
            found.add(node.args[0].value)
    return {m if m.startswith("jdist") else m.split(".")[0] for m in found}


@functools.cache
def _graph() -> dict[str, set[str]]:
    return {m: {d for d in _imports(m) if d in MODULES or not d.startswith("jdist")}
            for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), plus self-loops."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def _reach(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module reachable from ``start``, each with the module that imports it."""
    seen = {start: ""}
    todo = [start]
    while todo:
        v = todo.pop()
        for w in graph.get(v, ()):
            if w not in seen:
                seen[w] = v
                todo.append(w)
    return seen


def _path(seen: dict[str, str], end: str) -> str:
    chain = [end]
    while seen[chain[-1]]:
        chain.append(seen[chain[-1]])
    return " -> ".join(reversed(chain))


def test_graph_sees_the_package():
    graph = _graph()
    assert {"jdist", "jdist.collectives", "jdist.store", "jdist.launch", "jdist.rpc"} <= set(graph)
    assert "jax" in graph["jdist.collectives._traced"]  # the reader finds real imports


def test_no_import_circle():
    cycles = _cycles(_graph())
    assert not cycles, "import circles in jdist/:\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def _package(module: str) -> str:
    """``jdist.ddp`` for ``jdist.ddp.hooks._base``; ``jdist`` for top-level modules."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and _is_package(".".join(parts[:2])) \
        else "jdist"


def _is_private(module: str) -> bool:
    return any(p.startswith("_") for p in module.split(".")[1:])


def test_no_package_imports_another_packages_private_module():
    """Each package publishes what the others need (``jdist.collectives.runtime``,
    ``jdist.launch.cluster``, ``jdist.ddp.padding``, ...): an import of another
    package's private module would tie it to code free to change."""
    bad = sorted((m, d) for m, deps in _graph().items() for d in deps
                 if d.startswith("jdist.") and _is_private(d)
                 and _package(d) not in (_package(m), "jdist")
                 and (_package(m), d) not in ALLOWED)
    assert bad == [], bad


def _unit(module: str) -> str:
    """The unit a floor is given to: a package, or a top-level module (``jdist.errors``)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else "jdist"


def test_every_package_has_a_floor():
    tops = {_unit(m) for m in MODULES}
    assert tops <= set(FLOORS), f"packages without a floor in FLOORS: {tops - set(FLOORS)}"


def test_imports_only_go_down_the_floors():
    """A module imports packages on its own floor or below; same-floor packages form no
    circle between them (ddp -> algorithms is fine, algorithms -> ddp too, not both)."""
    up, same = [], {}
    for m, deps in _graph().items():
        for d in deps:
            if not d.startswith("jdist"):
                continue
            pm, pd = _unit(m), _unit(d)
            if pm == pd or (pm, d) in ALLOWED:
                continue
            if FLOORS[pd] > FLOORS[pm]:
                up.append(f"{m} (floor {FLOORS[pm]}) -> {d} (floor {FLOORS[pd]})")
            elif FLOORS[pd] == FLOORS[pm]:
                same.setdefault(pm, set()).add(pd)
    assert up == [], "imports going up a floor:\n" + "\n".join(sorted(up))
    assert _cycles({k: same.get(k, set()) for k in FLOORS}) == [], same


def test_allowlist_is_small_and_explained():
    assert len(ALLOWED) <= 3 and all(len(r) > 20 for r in ALLOWED.values()), ALLOWED


def test_floor0_never_reaches_jax():
    graph = _graph()
    bad = []
    for start in [m for m in MODULES if m.startswith(FLOOR0)]:
        seen = _reach(graph, start)
        bad += [_path(seen, h) for h in HEAVY if h in seen]
    assert not bad, "floor-0 modules reach a heavy import:\n" + "\n".join(sorted(set(bad)))


_NO_JAX = """
import sys
for name in {heavy!r}:
    sys.modules[name] = None          # any import of them now raises ImportError
import jdist, jdist.errors, jdist.store, jdist.launch, jdist.launch.__main__
store = jdist.HashStore()
store.set("k", b"v")
assert store.get("k") == b"v"
assert jdist.TCPStore is jdist.store.TCPStore
print("ok")
"""


def test_launcher_and_store_run_without_jax():
    code = _NO_JAX.format(heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_import_jdist_does_not_import_jax():
    code = ("import sys, jdist; jdist.__version__; jdist.errors.JdistError\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout
