"""The code's shape, before and after a restructuring, in the same run (issue 22's figures).

For each git revision given (default: the merge base with main's first parent, and the
working tree), in a temporary worktree of its own:

- lines: all of supervisor/, and the two halves of the child lifecycle (children.py for the
  children, router/upstream.py for router mode's model instances);
- complexity: McCabe's number per function (1 + each decision in its own body: if, for,
  while, except, conditional expression, comprehension, match case, and each extra operand of
  `and`/`or`), its mean, its maximum, and the functions over 10;
- one writer: state written inside the coroutines a model instance (router/upstream.py)
  spawns, which should be none (its tasks wait; what they learn is written elsewhere); the
  lifecycle's own state (state, reason, crash loop, next try, generation, commands) written
  inside coroutines, in either half; and the modules that take transitions (that call
  `check_transition`): one state machine is one such module;
- the lifecycle's lines: both halves, the pure step (policy/lifecycle.py) and the engine, all
  lines and code lines (not blank, comment or docstring);
- coupling: import edges from modules outside proxy/ into proxy/ (the pool importing the
  proxy's types was one), and the Protocol classes that describe an upstream;
- vocabulary: how many modules define the role names ("gpu", "cpu") as a tuple of their own;
- the daemon as the hub: its lines, its `if`s that ask for router mode, and the complexity of
  the reload's and the operator's functions (WATCHED; "-" where a revision has none);
- the house (issue 28): the modules at the top of supervisor/, the folders, the import arrows
  between units (a folder, or a module at the top) and the import statements behind them, the
  cycles (among units, and among modules), the functions over complexity 10, and the role
  names said as strings ("gpu", "cpu": the literals outside docstrings, and the modules that
  say them). Imports under `if TYPE_CHECKING:` are left out of arrows and cycles (they do not
  run).

    .venv/bin/python -m bench.structure [REV ...]   (WORKTREE names the working tree)

Prints a table; writes bench/results/structure.{json,md}.
"""

from __future__ import annotations

import ast
import io
import json
import subprocess
import sys
import tempfile
import tokenize
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
UPSTREAM_PROTOCOL_HINTS = ("upstream", "child", "member", "supervised")


def _mccabe(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """1 + each decision in the function's own body (nested functions are their own)."""
    n = 1
    todo: list[ast.AST] = list(fn.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.ExceptHandler,
                             ast.IfExp, ast.match_case, ast.comprehension)):
            n += 1
        elif isinstance(node, ast.BoolOp):
            n += len(node.values) - 1
        todo.extend(ast.iter_child_nodes(node))
    return n


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """The supervisor modules this one imports (relative imports resolved)."""
    found: set[str] = set()
    base = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[:len(base) - node.level + 1]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("supervisor"):
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("supervisor"))
    return found


def _runtime_imports(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """The supervisor modules this one imports when it runs (not under TYPE_CHECKING), each
    resolved to a module of the package where it names one (`from . import x`)."""
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(n) for n in ast.walk(node))
    pruned = ast.Module(body=[n for n in tree.body if id(n) not in typing_only],
                        type_ignores=[])
    return _imports(pruned, module, is_package)


def _unit(module: str) -> str:
    """A folder (supervisor.proxy) or a module at the top (supervisor.daemon)."""
    return ".".join(module.split(".")[:2])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


ROLE_NAMES = frozenset({"gpu", "cpu"})


def _role_literals(tree: ast.Module) -> int:
    """String constants that are a role's name, outside docstrings."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}
    return sum(isinstance(n, ast.Constant) and n.value in ROLE_NAMES and id(n) not in docs
               for n in ast.walk(tree))


def _house(package: Path, runtime: dict[str, set[str]],
           role_literals: dict[str, int]) -> dict[str, Any]:
    modules = set(runtime)
    units: dict[str, set[str]] = {}
    statements = 0
    for module, targets in runtime.items():
        for t in targets:
            target = t if t in modules else t.rsplit(".", 1)[0]
            if target not in modules or _unit(target) == _unit(module):
                continue
            units.setdefault(_unit(module), set()).add(_unit(target))
            statements += 1
    # A module's own packages are not counted: `from . import sibling` names the sibling, and
    # Python runs a package's __init__ before any module of it anyway.
    module_graph = {m: {t if t in modules else t.rsplit(".", 1)[0] for t in ts} - {m}
                    - {m.rsplit(".", k)[0] for k in range(1, m.count(".") + 1)}
                    for m, ts in runtime.items()}
    top = sorted(p.stem for p in package.glob("*.py")
                 if p.stem not in ("__init__", "__main__"))
    return {
        "top_level_modules": len(top),
        "top_level_names": top,
        "folders": sorted(p.name for p in package.iterdir()
                          if p.is_dir() and (p / "__init__.py").exists()),
        "unit_arrows": sum(len(v) for v in units.values()),
        "cross_unit_imports": statements,
        "unit_cycles": _cycles(units),
        "module_cycles": _cycles(module_graph),
        "role_literals": sum(role_literals.values()),
        "modules_saying_roles": sorted(m for m, n in role_literals.items() if n),
    }


def _is_upstream_protocol(cls: ast.ClassDef) -> bool:
    protocol = any((isinstance(b, ast.Name) and b.id == "Protocol") or
                   (isinstance(b, ast.Attribute) and b.attr == "Protocol") for b in cls.bases)
    return protocol and any(h in cls.name.lower() for h in UPSTREAM_PROTOCOL_HINTS)


def _role_tuples(tree: ast.Module) -> int:
    """Module-level tuples of the roles, ("gpu", "cpu"), by value or by module constants."""
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) for t in n.targets
                 if isinstance(t, ast.Name)}
    count = 0
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Tuple):
            values = [e.value if isinstance(e, ast.Constant) else
                      constants.get(e.id) if isinstance(e, ast.Name) else None
                      for e in node.value.elts]
            if values == ["gpu", "cpu"]:
                count += 1
    return count


WATCHED = ("daemon.Daemon.apply_config", "daemon.Daemon._apply_to_children",
           "own_routes.OwnRoutes.gpu_control", "children.Child._own",
           "children.Child._after_exit", "children.Child._run_process",
           "router.upstream.ModelUpstream._after_death", "router.upstream.ModelUpstream._ended",
           "router.upstream.ModelUpstream._judge_end", "engine.Engine._do")
# Where the lifecycle is: the two halves, the pure step, the engine.
LIFECYCLE_FILES = ("children.py", "router/upstream.py", "policy/lifecycle.py", "engine.py")
# The lifecycle's own state, as either half kept it (before issue 22's engine) or reads it.
LIFECYCLE_ATTRS = frozenset({"state", "_state", "reason", "crash_loop", "next_try_at",
                             "generation", "_want_running", "_command", "_command_reason",
                             "_instance_open", "loading_since", "_planned_end"})


def _mode_branches(tree: ast.Module) -> int:
    """`if`s (and conditional expressions) whose test asks for router mode: `.router` or
    `.models`."""
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp)):
            names = {n.attr for n in ast.walk(node.test) if isinstance(n, ast.Attribute)}
            count += bool(names & {"router", "models"})
    return count


def _foreign_writes(tree: ast.Module) -> int:
    """Assignments to another object's attribute (`self.part.attr = ...`, or through a local
    name: `child.cfg = ...`): state written from outside its owner."""
    count = 0
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [t for tgt in node.targets for t in
                       (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Attribute) and not (isinstance(t.value, ast.Name) and
                                                     t.value.id == "self"):
                count += 1
    return count


def _coroutine_writes(tree: ast.Module, attrs: frozenset[str] | None = None) -> int:
    """State written inside coroutines (the tasks an object spawns): assignments to `self.x`
    (to the `attrs` alone, when given) and calls of `self._set`/`self._to` (and, with no
    `attrs`, `self._load`), in `async def` bodies."""
    calls = ("_set", "_to") if attrs is not None else ("_set", "_to", "_load")
    count = 0
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                count += sum(isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                             and t.value.id == "self" and (attrs is None or t.attr in attrs)
                             for t in targets)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id == "self" and \
                    node.func.attr in calls:
                count += 1
    return count


def _takes_transitions(tree: ast.Module) -> bool:
    """Whether the module calls check_transition (takes transitions of its own)."""
    return any(isinstance(n, ast.Call) and (
        (isinstance(n.func, ast.Name) and n.func.id == "check_transition") or
        (isinstance(n.func, ast.Attribute) and n.func.attr == "check_transition"))
        for n in ast.walk(tree))


def _methods(tree: ast.Module, module: str) -> dict[str, int]:
    found = {}
    for cls in tree.body:
        if isinstance(cls, ast.ClassDef):
            for fn in cls.body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[f"{module}.{cls.name}.{fn.name}"] = _mccabe(fn)
    return found


def _code_lines(text: str) -> int:
    """Lines that hold code: not blank, not only a comment, not in a docstring."""
    tree = ast.parse(text)
    docs: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                    isinstance(first.value.value, str):
                docs.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER)
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in skip:
            code.update(range(tok.start[0], tok.end[0] + 1))
    return len(code - docs)


def _module_figures(tree: ast.Module, module: str, found: dict[str, Any]) -> None:
    """What one module adds to the figures that concern a few modules."""
    short = module.removeprefix("supervisor.")
    if module == "supervisor.router.upstream":
        found["instance_task_writes"] = _coroutine_writes(tree)
    if module == "supervisor.daemon":
        found["mode_branches"] = _mode_branches(tree)
        found["foreign_writes"] = _foreign_writes(tree)
    if short in ("children", "router.upstream"):
        found["lifecycle_task_writes"] += _coroutine_writes(tree, LIFECYCLE_ATTRS)
    if _takes_transitions(tree):
        found["transition_takers"].append(short)


def measure(root: Path) -> dict[str, Any]:
    package = root / "supervisor"
    lines = 0
    complexities: list[tuple[int, str]] = []
    edges_into_proxy: list[str] = []
    protocols: list[str] = []
    role_definitions: list[str] = []
    modules: dict[str, set[str]] = {}
    runtime: dict[str, set[str]] = {}
    role_literals: dict[str, int] = {}
    methods: dict[str, int] = {}
    found: dict[str, Any] = {"mode_branches": 0, "foreign_writes": 0, "instance_task_writes": 0,
                             "lifecycle_task_writes": 0, "transition_takers": []}
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines += text.count("\n")
        tree = ast.parse(text)
        module = _module_name(path, root)
        modules[module] = _imports(tree, module, path.name == "__init__.py")
        runtime[module] = _runtime_imports(tree, module, path.name == "__init__.py")
        role_literals[module.removeprefix("supervisor.")] = _role_literals(tree)
        methods.update(_methods(tree, module.removeprefix("supervisor.")))
        _module_figures(tree, module, found)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                complexities.append((_mccabe(node), f"{module}.{node.name}"))
            elif isinstance(node, ast.ClassDef) and _is_upstream_protocol(node):
                protocols.append(f"{module}.{node.name}")
        if _role_tuples(tree):
            role_definitions.append(module)
    for module, targets in modules.items():
        if module.startswith("supervisor.proxy"):
            continue
        if any(t.startswith("supervisor.proxy") for t in targets):
            edges_into_proxy.append(module)
    values = [c for c, _ in complexities]

    def size(rel: str) -> int:
        p = package / rel
        return p.read_text(encoding="utf-8").count("\n") if p.exists() else 0

    def code(rel: str) -> int:
        p = package / rel
        return _code_lines(p.read_text(encoding="utf-8")) if p.exists() else 0

    return {
        "lines": lines,
        "children_py_lines": size("children.py"),
        "daemon_py_lines": size("daemon.py"),
        "daemon_mode_branches": found["mode_branches"],
        "daemon_writes_to_other_objects": found["foreign_writes"],
        **{f"complexity {name}": methods.get(name, "-") for name in WATCHED},
        "router_upstream_py_lines": size("router/upstream.py"),
        "lifecycle_py_lines": size("policy/lifecycle.py"),
        "engine_py_lines": size("engine.py"),
        "lifecycle_lines_all": sum(size(r) for r in LIFECYCLE_FILES),
        "lifecycle_code_lines_all": sum(code(r) for r in LIFECYCLE_FILES),
        "model_instance_state_writes_in_tasks": found["instance_task_writes"],
        "lifecycle_state_writes_in_tasks": found["lifecycle_task_writes"],
        "modules_taking_transitions": sorted(found["transition_takers"]),
        "functions": len(values),
        "mean_complexity": round(sum(values) / max(len(values), 1), 2),
        "max_complexity": max(values, default=0),
        "over_10": sorted(name for c, name in complexities if c > 10),
        "modules_importing_proxy_from_outside": sorted(edges_into_proxy),
        "upstream_protocols": sorted(protocols),
        "modules_defining_roles": sorted(role_definitions),
        **_house(package, runtime, role_literals),
    }


def _worktree(rev: str, folder: Path) -> Path:
    target = folder / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(target), rev],
                   check=True, capture_output=True)
    return target


def main() -> None:
    revs = sys.argv[1:] or [subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD~1"], check=True,
        capture_output=True, text=True).stdout.strip(), "WORKTREE"]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        made: list[Path] = []
        try:
            for rev in revs:
                root = REPO if rev == "WORKTREE" else _worktree(rev, Path(tmp))
                if root != REPO:
                    made.append(root)
                results[rev] = measure(root)
        finally:
            for root in made:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                                str(root)], capture_output=True)
    keys = ["lines", "children_py_lines", "router_upstream_py_lines", "lifecycle_py_lines",
            "engine_py_lines", "lifecycle_lines_all", "lifecycle_code_lines_all",
            "model_instance_state_writes_in_tasks",
            "lifecycle_state_writes_in_tasks", "daemon_py_lines",
            "daemon_mode_branches", "daemon_writes_to_other_objects",
            *(f"complexity {name}" for name in WATCHED), "functions",
            "mean_complexity", "max_complexity"]
    head = "| figure | " + " | ".join(revs) + " |"
    rows = [head, "|" + "---|" * (len(revs) + 1)]
    for k in keys:
        rows.append(f"| {k} | " + " | ".join(str(results[r][k]) for r in revs) + " |")
    for k in ("modules_taking_transitions", "over_10", "modules_importing_proxy_from_outside",
              "upstream_protocols", "modules_defining_roles"):
        cells = []
        for r in revs:
            names = ", ".join(x.removeprefix("supervisor.") for x in results[r][k])
            cells.append(f"{len(results[r][k])}: {names}")
        rows.append(f"| {k} | " + " | ".join(cells) + " |")
    rows += ["", "The house (issue 28):", "", head, "|" + "---|" * (len(revs) + 1)]
    for k in ("top_level_modules", "unit_arrows", "cross_unit_imports", "role_literals"):
        rows.append(f"| {k} | " + " | ".join(str(results[r][k]) for r in revs) + " |")
    for k in ("folders", "unit_cycles", "module_cycles", "modules_saying_roles"):
        cells = [f"{len(results[r][k])}: " + "; ".join(
            x if isinstance(x, str) else " <-> ".join(y.removeprefix("supervisor.") for y in x)
            for x in results[r][k]).replace("supervisor.", "") for r in revs]
        rows.append(f"| {k} | " + " | ".join(cells) + " |")
    rows.append("| over_10 | " + " | ".join(str(len(results[r]["over_10"])) for r in revs)
                + " |")
    text = "\n".join(rows)
    print(text)
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "structure.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "structure.md").write_text("# The code's shape\n\n" + text + "\n")


if __name__ == "__main__":
    main()
