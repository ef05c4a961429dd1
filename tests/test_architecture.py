"""The package's shape stays what docs/architecture.md says: no import circles, modules of a readable
size, a loop free of budget plumbing, and a repository that stands alone."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import REPO

APP = REPO / "app"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Every app module `path` imports, at module level or inside functions (a lazy import still ties
    the two modules together)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + [base]
                ).strip(".")
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            # the deepest known module the name refers to ("app.budget.files" or "app.budget")
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module_name(path):
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = sorted(APP.rglob("*.py"))
    known = {module_name(p) for p in files}
    return {module_name(p): imports_of(p, known) for p in files}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_sees_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    graph = import_graph()
    assert "app.train" in graph and graph["app.train"], "the import graph came out empty"
    # a package's __init__ importing its own modules is not a circle of concern, unless a module imports it back
    assert find_cycles(graph) == []


def test_modules_stay_readable():
    big = {module_name(p): n for p in APP.rglob("*.py") if (n := len(p.read_text().splitlines())) > 520}
    assert big == {}, "split these by concern (docs/architecture.md, 'where to change what')"


def test_training_loop_knows_no_budget_files():
    """The loop reaches the budget only through app.trainer.stopping.budget_link."""
    graph = import_graph()
    budget = {m for m in graph["app.train"] if m.startswith("app.budget")}
    assert budget <= {"app.budget"}, budget  # BudgetExhausted, the one exception type the loop catches
    source = (APP / "train.py").read_text()
    for name in ("ledger", "state.json", "atomic_write_json", "read_budget_state", "status.json"):
        assert name not in source


def test_budget_and_trainer_depend_one_way():
    """The trainer reaches the budget (app/trainer/stopping/budget_link.py); the budget never imports the trainer,
    so the watcher, a sidecar of its own, loads none of the training code. What both need lies below both
    (e.g. app/metrics_server.py)."""
    graph = import_graph()
    budget = [m for m in graph if m == "app.budget" or m.startswith("app.budget.")]
    assert budget, "the import graph has no budget package"
    upward = {m: sorted(t for t in graph[m] if t.startswith("app.trainer")) for m in budget}
    assert {m: t for m, t in upward.items() if t} == {}


def test_trainer_holds_a_run_not_every_collaborator():
    """Trainer's attributes are the run's state and its components, at most 15; the loop reaches the
    checkpoints through the package's facade only, never a module inside it."""
    tree = ast.parse((APP / "train.py").read_text())
    (trainer,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Trainer"]
    attributes = {
        target.attr
        for node in ast.walk(trainer)
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id == "self"
    }
    assert "checkpointer" in attributes and len(attributes) <= 15, sorted(attributes)
    checkpoint = {m for m in import_graph()["app.train"] if m.startswith("app.trainer.checkpoint")}
    assert checkpoint == {"app.trainer.checkpoint"}, checkpoint


DOCS = [
    "README.md",
    "helm/README.md",
    *sorted(str(p.relative_to(REPO)) for p in REPO.glob("docs/*.md")),
    *sorted(str(p.relative_to(REPO)) for p in REPO.glob("k8s/*.md")),
]


@pytest.mark.parametrize("doc", DOCS)
def test_docs_link_only_inside_the_repository(doc):
    """A clone (or a packaged chart) must not carry dead links: every link is a file of the repository."""
    text = (REPO / doc).read_text()
    for target in re.findall(r"\]\(<?([^)>#\s]+)", text):
        assert not re.match(r"[a-z][a-z0-9+.-]*:", target), f"{doc} links outside the repository: {target}"
        resolved = ((REPO / doc).parent / target).resolve()
        assert resolved.is_relative_to(REPO), f"{doc} links outside the repository: {target}"
        assert resolved.exists(), f"{doc} links to a missing file: {target}"


def test_architecture_doc_names_real_modules():
    text = (REPO / "docs" / "architecture.md").read_text()
    for path in sorted(set(re.findall(r"`(app/[\w/]+\.py)`", text))):
        assert (REPO / path).exists(), f"docs/architecture.md names {path}, which does not exist"


# the shared folder beside the repository and the design notes kept there, joined at run time so that
# neither this file nor its bytecode (pytest folds "a" + "b") holds them
OUTSIDE = ["".join(parts) for parts in [("..", "/shared"), ('parent / "', 'shared"'), ("DESIGN", ".md")]]


def test_repository_stands_alone():
    """A user's clone has nothing beside it: no test, script or doc reaches outside the repository."""
    for path in [
        *REPO.glob("tests/**/*.py"),
        *(p for p in REPO.glob("scripts/*") if p.is_file()),  # not a __pycache__
        *REPO.glob("benchmarks/*.py"),
        *REPO.glob("docs/*.md"),
        REPO / "README.md",
        REPO / "Makefile",
    ]:
        text = path.read_text()
        assert not any(f in text for f in OUTSIDE), path
    fixture = REPO / "tests" / "fixtures" / "k8s-schemas"
    recorded = re.search(r"`([0-9a-f]{64})`", (fixture / "README.md").read_text()).group(1)
    from app.files import sha256_file

    assert sha256_file(fixture / "kubeflow.org_pytorchjobs.v1.9.0.yaml") == recorded


def test_config_lives_in_one_package_below_the_components():
    """Every config dataclass is in app/config/ (the budget's and prepare's too), and the package imports
    only itself and the shared modules: the components (budget/, trainer/, data/, tools/) import config,
    never the other way, so no package is tied to config both ways."""
    graph = import_graph()
    package = {m for m in graph if m == "app.config" or m.startswith("app.config.")}
    assert {"app.config.budget", "app.config.prepare", "app.config.loader"} <= package
    for module in sorted(package):
        outside = graph[module] - package
        assert outside <= {"app.errors", "app.gpus"}, f"{module} imports {sorted(outside)}"
        # inside the package, a module imports its siblings, not the package's re-exports
        assert module == "app.config" or "app.config" not in graph[module], module
    elsewhere = []
    for path in APP.rglob("*.py"):
        if path.is_relative_to(APP / "config"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            decorators = [
                getattr(d, "id", getattr(d, "attr", "")) for d in getattr(node, "decorator_list", [])
            ]
            if isinstance(node, ast.ClassDef) and node.name.endswith("Config") and "dataclass" in decorators:
                elsewhere.append(f"{module_name(path)}.{node.name}")
    assert elsewhere == [], "config dataclasses belong in app/config/"
