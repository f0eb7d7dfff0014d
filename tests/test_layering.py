"""The project's floors, checked from its own imports (every import statement, inside functions too).

From the bottom up: ``policies`` (tensor maths) and ``dashboards`` (frames, plots, pages); ``workers`` (a
pair on one machine: engines, benchmarks, certification, metrics, results; no Ray); ``cluster`` (Ray actors,
the pool and Serve: every Ray call); ``sweep`` (the sweep library: with the commands, the only floor with
Optuna and MLflow); ``jobs`` (the commands). Inside ``workers``: ``certify`` is pure
statistics, ``models`` knows no engine, only ``workers/vllm`` imports vLLM and only inside functions,
and no two of its packages import each other in a circle. No two modules of the project do either, and no
module outside ``policies`` recognises a rule by its name (it reads the rule's declared traits).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = ("policies", "dashboards", "workers", "cluster", "sweep", "jobs")


def modules(top: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module under one top-level package."""
    out = {}
    for path in sorted((ROOT / top).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(module: str, path: Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import in the file; relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(node) for node in tree.body}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.append((base, node.lineno, id(node) in top_level))
            out += [(f"{base}.{alias.name}", node.lineno, id(node) in top_level) for alias in node.names]
    return out


ALL = {name: path for top in FLOORS for name, path in modules(top).items()}
EDGES = {name: imports(name, path) for name, path in ALL.items()}


def offenders(where, forbidden):
    """Imports from modules matching ``where`` of modules matching ``forbidden``: 'file:line imports name'."""
    bad = []
    for name, edges in EDGES.items():
        if not where(name):
            continue
        for target, line, _ in edges:
            if forbidden(target):
                bad.append(f"{ALL[name].relative_to(ROOT)}:{line} imports {target}")
    return sorted(set(bad))


def under(*prefixes):
    return lambda name: any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_tree_is_read():
    # a rename that left the walk reading nothing would pass every rule below
    assert len(ALL) > 80 and {"workers.vllm.plugin", "workers.certify.decide", "jobs.sweep", "sweep.state"} <= set(ALL)
    assert sum(len(edges) for edges in EDGES.values()) > 500


@pytest.mark.parametrize("floor, forbidden", [
    ("policies", ("workers", "cluster", "sweep", "jobs", "dashboards", "ray", "optuna", "mlflow", "vllm", "transformers")),
    ("dashboards", ("policies", "workers", "cluster", "sweep", "jobs", "ray", "optuna", "mlflow", "vllm", "torch")),
    ("workers", ("cluster", "sweep", "jobs", "dashboards", "ray", "optuna", "mlflow")),
    ("cluster", ("sweep", "jobs", "dashboards", "optuna", "mlflow")),
    ("sweep", ("jobs",)),
])
def test_no_import_runs_back_up(floor, forbidden):
    assert offenders(under(floor), under(*forbidden)) == []


def test_optuna_and_mlflow_live_in_the_sweep_and_the_commands_alone():
    assert offenders(lambda n: not under("sweep", "jobs")(n), under("optuna", "mlflow")) == []
    assert offenders(lambda n: n != "sweep.tracking", under("mlflow")) == []  # one module owns MLflow


RAY_CALL = re.compile(r"\bray\.(get|wait|put|kill)\(|\.remote\(")


def test_ray_is_called_in_cluster_alone():
    # a pool of its own in a phase module once lost a chunk with its actor; every Ray call lives in cluster/
    bad = [f"{path.relative_to(ROOT)}:{n}" for name, path in ALL.items() if not under("cluster")(name)
           for n, line in enumerate(path.read_text().splitlines(), 1) if RAY_CALL.search(line.split("#")[0])]
    assert bad == []


def functions(*floors: str):
    """(path, function node, its parameter names) for every function defined under ``floors``."""
    for name, path in ALL.items():
        if under(*floors)(name):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield path, node, node.args.args + node.args.kwonlyargs


def test_no_parameter_is_typed_any_for_the_sweeps_state():
    # the state is a typed SweepState; a phase handed an untyped driver is how attributes got written from outside
    bad = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name}({arg.arg})" for path, node, args in functions("sweep", "jobs")
           for arg in args if arg.arg in ("sweep", "state")
           and (arg.annotation is None or ast.unparse(arg.annotation) == "Any")]
    assert bad == []


def test_no_sweep_function_sets_an_attribute_on_what_it_was_handed():
    # each phase takes the state and returns values: ``param.x = ...`` on a parameter is refused (self aside)
    bad = []
    for path, node, args in functions("sweep", "jobs"):
        params = {a.arg for a in args} - {"self", "cls", "namespace"}
        for sub in ast.walk(node):
            targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(
                sub, ast.AugAssign | ast.AnnAssign) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in params:
                    bad.append(f"{path.relative_to(ROOT)}:{sub.lineno} {node.name} sets {t.value.id}.{t.attr}")
    assert bad == []


def module_circle(prefix: str) -> list[str] | None:
    """A circle of imports between the modules of one package (any import, inside functions too), or None."""
    inside = {name for name in ALL if name == prefix or name.startswith(prefix + ".")}
    graph = {name: {t for target, _, _ in EDGES[name] for t in (target, target.rpartition(".")[0])
                    if t in inside and t != name and t != prefix} for name in inside}
    return import_circle(graph)


def _type_only(tree: ast.Module) -> set[int]:
    """The ids of the import statements under ``if TYPE_CHECKING:``: never run, so never part of a circle."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            out |= {id(sub) for stmt in node.body for sub in ast.walk(stmt)}
    return out


def run_time_imports(module: str, path: Path) -> set[str]:
    """The project modules ``module`` imports when it runs, at module level or inside a function: ``from pkg import
    sub`` reaches the module ``pkg.sub`` (not the package's ``__init__``, which holds no name it asks for), ``from
    pkg import name`` the package, ``import a.b`` the module ``a.b``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_only(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                out |= {".".join(parts[:k]) for k in range(len(parts), 0, -1)}  # only the longest in ALL is kept
                out -= {".".join(parts[:k]) for k in range(1, len(parts)) if ".".join(parts[:k + 1]) in ALL}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in ALL else base)
    return {t for t in out if t in ALL and t != module}


def import_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` (module -> the modules it imports), as the modules along it, or None."""
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [node, nxt] if nxt in stack else [node, nxt]
            if nxt not in state and (found := visit(nxt, stack + [node])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [])):
            return found
    return None


def test_no_import_circle_between_any_two_modules_of_the_project():
    """Across every package (policies, dashboards, workers, cluster, sweep, jobs), imports inside functions too: an
    import put inside a function to break a circle (jobs.export_rule <-> jobs.serve, workers.models.pair <->
    workers.models.tiny once) still is one. Imports under ``if TYPE_CHECKING:`` never run and do not count."""
    graph = {name: run_time_imports(name, path) for name, path in ALL.items()}
    assert sum(len(targets) for targets in graph.values()) > 300, "are the imports read?"
    circle = import_circle(graph)
    assert circle is None, " -> ".join(circle or [])


def test_the_circle_check_sees_a_circle():
    assert import_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert import_circle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


@pytest.mark.parametrize("package", ["policies", "workers.metrics", "workers.results", "sweep"])
def test_no_circle_between_the_modules_of_a_package(package):
    # policies counts as one room above, so policies.fused <-> policies.randomness once went unseen
    assert any(name.startswith(package + ".") for name in ALL), f"{package} has no modules: is it read?"
    assert module_circle(package) is None, " -> ".join(module_circle(package) or [])


def _is_engine(node: ast.AST) -> bool:
    """``engine``, ``args.engine``, ``self.engine_kind``, ``spec.get("engine")``...: a value that names an engine."""
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        return node.args[0].value == "engine"  # spec.get("engine")
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return node.slice.value == "engine"  # choice["engine"]
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name in ("engine", "engine_kind", "engine_name")


def _is_literal(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    return isinstance(node, ast.Tuple | ast.List | ast.Set) and bool(node.elts) and all(map(_is_literal, node.elts))


def engine_name_branches(tree: ast.AST) -> list[int]:
    """Lines comparing an engine's name with a literal: ``engine == "cpu"``, ``args.engine not in ("vllm", ...)``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for op, left, right in zip(node.ops, operands[:-1], operands[1:], strict=True):
                if isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn) and (
                        (_is_engine(left) and _is_literal(right)) or (_is_literal(left) and _is_engine(right))):
                    lines.append(node.lineno)
    return lines


def test_the_check_sees_an_engine_name_branch():
    seen = engine_name_branches(ast.parse('if args.engine == "cpu": pass\nx = engine not in ("vllm", "cpu")\n'
                                          'y = "openai" != self.engine_kind\nz = spec.get("engine") == "vllm"\n'
                                          'ok = engine == other and args.engine in ENGINES'))
    assert seen == [1, 2, 3, 4]


def test_engines_are_asked_for_their_traits_never_their_names():
    # what an engine can do is declared once (workers.engine_registry: EngineTraits) and read everywhere else:
    # a branch on the name is what a new engine would have to find and extend in a dozen files
    bad = [f"{path.relative_to(ROOT)}:{line}" for name, path in ALL.items() if name != "workers.engine_registry"
           for line in engine_name_branches(ast.parse(path.read_text()))]
    assert bad == []


def registered_rules() -> set[str]:
    """The names rules register under (``@register("name", ...)`` in policies/), read from the source."""
    names = set()
    for path in modules("policies").values():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "register"
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                names.add(node.args[0].value)
    return names


RULE_HOLDERS = {"policy", "rule", "member", "pol"}  # what code calls a rule object (``policy.name == ...``)


def _reads_name(node: ast.AST) -> ast.AST | None:
    """The object whose name ``node`` reads (``x.name``, ``getattr(x, "name", ...)``), or None."""
    if isinstance(node, ast.Attribute) and node.attr == "name":
        return node.value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "name"):
        return node.args[0]
    return None


def _strings(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return set().union(*(_strings(e) for e in node.elts)) if node.elts else set()
    return set()


def name_branches(files: list[Path], rules: set[str]) -> list[str]:
    """'file:line code' for every comparison of a rule's name in ``files``: ``x.name == "<rule>"`` (or in a
    tuple of names), and ``policy.name`` / ``rule.name`` compared with anything."""
    bad = []
    for path in files:
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Compare)
                    and all(isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn) for op in node.ops)):
                continue
            operands = [node.left, *node.comparators]
            for i, operand in enumerate(operands):
                holder = _reads_name(operand)
                if holder is None:
                    continue
                others = set().union(*(_strings(o) for j, o in enumerate(operands) if j != i))
                named = isinstance(holder, ast.Name) and holder.id in RULE_HOLDERS or (
                    isinstance(holder, ast.Attribute) and holder.attr in RULE_HOLDERS)
                if named or others & rules:
                    bad.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    return sorted(set(bad))


def test_no_rule_is_recognised_by_its_name_outside_policies():
    # a branch on ``rule.name == "dropmatch"`` outside policies/ is a trait nobody declared: a new rule with hidden
    # states, random draws at T = 0 or an inexact replay would slip past it. Read ``policies.traits(rule)`` instead
    rules = registered_rules()
    assert {"lossless", "dropmatch", "any_of", "fly"} <= rules, "are the rules' registrations read?"
    outside = [path for name, path in ALL.items() if not under("policies")(name)]
    assert name_branches(outside, rules) == []


def test_the_name_check_sees_a_name_branch(tmp_path):
    # the check above would pass on a tree it cannot read as well: show it some
    bad = tmp_path / "bad.py"
    bad.write_text('def f(policy, spec, path):\n    return (policy.name == "x", getattr(spec, "name", "") in ("dropmatch",),\n'
                   '            spec.name != "dropmatch", path.name == "x.py", spec.name == "lossless")\n')
    found = name_branches([bad], {"dropmatch"})
    assert found == ["bad.py:2 getattr(spec, 'name', '') in ('dropmatch',)", "bad.py:2 policy.name == 'x'",
                     "bad.py:3 spec.name != 'dropmatch'"]
