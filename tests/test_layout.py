"""The layout rules the design depends on (docs/architecture.md §3): no module imports one that imports
it, core/'s wings import only downwards, torch stays where tensors are (a workflow module is loaded
into the sandbox of every workflow task), and the design is cited where a clone can follow it."""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

PRODUCT = ("core", "workflows", "activities", "agent", "training", "workers", "sim")


def module_name(path: Path) -> str:
    """The installed name of a product file: every top-level folder installs under `stayalive`."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(parts if parts[0] == "stayalive" else ("stayalive", *parts))


def product_imports() -> dict[str, set[str]]:
    """Product module → the product modules it imports, wherever the import sits (TYPE_CHECKING
    blocks and function bodies included: a circle through a type-only import is a circle to read)."""
    files = [ROOT / "stayalive" / "__init__.py"] + [p for f in PRODUCT for p in sorted((ROOT / f).rglob("*.py"))]
    modules = {module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("stayalive"):
                module = str(node.module)
                # `from package import module` imports the module; `from module import name`, the module
                named = {f"{module}.{alias.name}" for alias in node.names} & modules.keys()
                imported |= named or {module}
            elif isinstance(node, ast.Import):
                imported |= {a.name for a in node.names if a.name.startswith("stayalive")}
        graph[name] = (imported & modules.keys()) - {name}
    return graph


def test_no_import_circle_anywhere_in_the_product() -> None:
    graph = product_imports()
    assert "stayalive.core.book.runbook" in graph["stayalive.workflows.run"], "the graph follows the imports"
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError, naming the circle


# core/'s wings, lowest first: a wing imports only the wings below it (and itself), so each can be
# read without any above it (docs/architecture.md §3).
CORE_WINGS = ("fleet", "judgement", "protocol", "run", "messages", "decisions", "monitor", "book")


def test_core_is_wings_none_importing_one_above_it() -> None:
    core = ROOT / "core"
    loose = [p.name for p in core.glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"every core module belongs to a wing: {loose}"
    assert {p.name for p in core.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(CORE_WINGS)
    upward = [
        f"core.{wing} imports {module}"
        for module, imported in product_imports().items()
        if module.startswith("stayalive.core.") and (wing := module.split(".")[2]) in CORE_WINGS
        for other in imported
        if not other.startswith("stayalive.core.") or CORE_WINGS.index(other.split(".")[2]) > CORE_WINGS.index(wing)
    ]
    assert not upward, "a core wing imports one above it, or outside core: " + "; ".join(sorted(upward))


# Torch is where tensors are: the ranks (training/) and the node agent's parts that start them, open
# their rendezvous store and test a GPU. Everything else (workflows, loaded into the sandbox of every
# workflow task; the supervisor's activities; the simulator; the agent's hub) runs without it.
LOADS_TORCH = {
    "agent/node.py",
    "agent/selftest.py",
    "agent/memory_test.py",
    "workers/node_agent.py",
    "sim/emulated_rank.py",  # its store client is torch's, as a rank's is
    "sim/emulated_checkpoint.py",  # DCP writes what a rank commits
    "sim/hub_farm.py",
}


def torch_free_modules() -> list[str]:
    paths = [
        p
        for folder in ("core", "workflows", "activities", "sim", "workers", "agent")
        for p in (ROOT / folder).rglob("*.py")
    ]
    kept = [p for p in sorted(paths) if p.stem != "__init__" and str(p.relative_to(ROOT)) not in LOADS_TORCH]
    return [module_name(p) for p in kept]


# Run in a fresh interpreter: it imports every torch-free module and names the first import of torch
# with the chain of product modules that led to it.
TORCH_PROBE = """
import importlib, importlib.abc, sys, traceback
root, *modules = sys.argv[1:]
class Spy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":
            ours = [f for f in traceback.extract_stack()[::-1] if f.filename.startswith(root)]
            print(" <- ".join(f"{f.filename[len(root):]}:{f.lineno}" for f in ours))
            sys.exit(0)
sys.meta_path.insert(0, Spy())
for module in modules:
    importlib.import_module(module)
"""


def test_torch_stays_where_tensors_are() -> None:
    modules = torch_free_modules()
    assert "stayalive.agent.hub" in modules and "stayalive.sim.month" in modules
    probe = subprocess.run(
        [sys.executable, "-c", TORCH_PROBE, f"{ROOT}/", *modules], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert probe.stdout.strip() == "", f"torch is imported by: {probe.stdout.strip()}"


def test_benches_do_not_import_the_tests() -> None:
    importers = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "bench").glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tests")
        or (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "tests" for a in node.names))
    ]
    assert not importers, f"bench scripts import tests/: {importers}"


# The design is cited as docs/architecture.md §N or by the publication behind a fact. Documents kept
# outside the repository (an external design file, source blog posts and their revisions) must not be
# cited: a maintainer with a clone cannot follow them. The markers are spelt in pieces so that this
# file does not match itself.
CITED_FOLDERS = ("core", "workflows", "activities", "workers", "agent", "training", "sim", "bench", "harness", "tests")
OUTSIDE_CASED = ("DESIGN" + " §", "FIELD" + "-NOTES")
OUTSIDE = ("seed" + " 00", *(f"seed r{n}" for n in range(1, 7)), *(f"critique c{n}" for n in range(1, 7)))


def test_the_design_is_cited_from_the_repository() -> None:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    files += [p for folder in CITED_FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    assert ROOT / "docs" / "architecture.md" in files
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if any(m in line for m in OUTSIDE_CASED) or any(m in line.lower() for m in OUTSIDE)
    ]
    assert not found, "cite docs/architecture.md §N or a publication instead:\n" + "\n".join(found)


def signal_handlers(module: str) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every `@workflow.signal` method of a workflows module, by name, with its definition."""
    return [
        (node.name, node)
        for node in ast.walk(ast.parse((ROOT / "workflows" / f"{module}.py").read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and any("workflow.signal" in ast.unparse(d) for d in node.decorator_list)
    ]


def test_run_signal_handlers_only_post_to_the_inbox() -> None:
    """A signal to a run lands in its inbox and the main loop decides: no handler awaits (an activity
    call, a wait), and none touches the workflow's state but its inbox (the book, the timeline).
    (FleetWorkflow's one signal applies its request at once: the fleet has no loop to wait for.)"""
    handlers = signal_handlers("run")
    assert {"force_checkpoint", "partitioned", "monitor_report", "pause"} <= {name for name, _ in handlers}
    for name, handler in handlers:
        assert isinstance(handler, ast.FunctionDef), f"{name} is async: a handler that awaits acts"
        body = [node for statement in handler.body for node in ast.walk(statement)]
        touched = {
            ast.unparse(node).split(".")[1]
            for node in body
            if isinstance(node, ast.Attribute) and ast.unparse(node).startswith("self.")
        }
        assert touched <= {"inbox"}, f"{name} touches self.{sorted(touched - {'inbox'})}, not only the inbox"
        calls = [ast.unparse(node.func) for node in body if isinstance(node, ast.Call)]
        assert all(c.startswith(("self.inbox.", "Request")) for c in calls), f"{name} calls {calls}"


def test_only_apply_moves_the_run() -> None:
    """RunBook's changes of state (`_move` and every method that reaches it) are private but for
    `apply`, the one door; no workflows module reaches past it (a private method of the book, or the
    state written directly)."""
    tree = ast.parse((ROOT / "core" / "book" / "runbook.py").read_text())
    book = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RunBook")
    calls = {
        method.name: {
            node.func.attr
            for node in ast.walk(method)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and ast.unparse(node.func.value) == "self"
        }
        for method in book.body
        if isinstance(method, ast.FunctionDef)
    }
    moving, reached = {"_move"}, {"_move"}
    while reached:
        reached = {name for name, called in calls.items() if called & moving} - moving
        moving |= reached
    assert {"_record", "_observe", "apply"} <= moving, "the walk follows the calls"
    assert {name for name in moving if not name.startswith("_")} == {"apply"}
    past = [
        f"{path.name}:{node.lineno}: {ast.unparse(node)}"
        for path in sorted((ROOT / "workflows").glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and ast.unparse(node.value).endswith("book")
        )
        or (isinstance(node, ast.Assign) and any(ast.unparse(t).endswith(".state") for t in node.targets))
    ]
    assert not past, f"workflows reach past RunBook.apply: {past}"
