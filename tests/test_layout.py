"""The import rules the design depends on (DESIGN §8): workflow modules import each other one way
only, and never load torch (a workflow module is loaded into the sandbox of every workflow task)."""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT


def workflow_imports() -> dict[str, set[str]]:
    """workflows module → the workflows modules it imports (TYPE_CHECKING imports included)."""
    graph: dict[str, set[str]] = {}
    for path in sorted((ROOT / "workflows").glob("*.py")):
        module = f"stayalive.workflows.{path.stem}"
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "stayalive.workflows":
                imported |= {f"stayalive.workflows.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("stayalive.workflows."):
                imported.add(str(node.module))
            elif isinstance(node, ast.Import):
                imported |= {a.name for a in node.names if a.name.startswith("stayalive.workflows.")}
        graph[module] = imported - {module}
    return graph


def test_no_workflow_module_imports_a_module_that_imports_it() -> None:
    graph = workflow_imports()
    assert graph["stayalive.workflows.run"], "the shell imports its helpers"
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError, naming the cycle


def test_workflow_modules_do_not_load_torch() -> None:
    modules = ", ".join(f"stayalive.workflows.{p.stem}" for p in sorted(Path(ROOT / "workflows").glob("*.py")))
    probe = f"import sys, {modules}; print('torch' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "False", loaded.stderr
