"""The package's shape: layers import only downward, no cycles, small files, no hidden imports."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "moe_overlap"
ROOT = SRC.parents[1]
# imported where used: matplotlib only when plotting, PyYAML only for --config, the serving
# stack (FastAPI, uvicorn) only in the commands that serve
LAZY_OK = {
    "matplotlib",
    "matplotlib.pyplot",
    "yaml",
    "moe_overlap.server.observability",
    "moe_overlap.server.run",
    "moe_overlap.distributed.gpu_spin",  # Triton: a quarter of a second, on CUDA only
    "moe_overlap.model.fp8_grouped_kernel",  # Triton too, for FP8 on a GPU only
    "moe_overlap.dispatch.fp8_wire_kernels",
    "moe_overlap.engine.grammar",  # xgrammar: seconds, only for structured outputs
    "torch.nn.attention.bias",  # imports dynamo (a second), for attention after a prefix on CUDA
    # the command line starts the rank fork server before either imports torch (seconds)
    "moe_overlap.tools.commands",
    "moe_overlap.runtime.worker",
}


def test_import_contracts_hold() -> None:
    # the contracts live in pyproject.toml: layers, and acyclic sibling packages and modules
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 kept, 0 broken" in out.stdout


def test_no_source_file_over_300_lines() -> None:
    long = {
        str(p.relative_to(SRC)): n
        for p in SRC.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 300
    }
    assert not long, f"files over 300 lines: {long}"


def test_no_function_over_60_lines() -> None:
    long = [
        f"{path.relative_to(SRC)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in SRC.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > 60
    ]
    assert not long, f"functions over 60 lines: {long}"


def test_no_import_inside_a_function() -> None:
    hidden = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Import | ast.ImportFrom):
                        names = (
                            [inner.module]
                            if isinstance(inner, ast.ImportFrom)
                            else [a.name for a in inner.names]
                        )
                        if not set(names) <= LAZY_OK:
                            hidden.append(f"{path.relative_to(SRC)}:{inner.lineno} {names}")
    assert not hidden, f"imports inside functions: {hidden}"


def test_the_cli_runs_without_the_serving_stack() -> None:
    """A GPU machine may have torch and no FastAPI: bench and plan still start."""
    code = (
        "import sys\n"
        "for name in ('fastapi', 'uvicorn', 'starlette', 'prometheus_client'):\n"
        "    sys.modules[name] = None  # importing it now raises ImportError\n"
        "from moe_overlap.tools.cli import main\n"
        "try:\n"
        "    main(['bench', '--help'])\n"
        "except SystemExit as e:\n"
        "    sys.exit(e.code)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "--workload" in done.stdout


def test_one_calibration_fit() -> None:
    # auto's start-up calibration and `plan --cluster this` fit costs with core/cost_fit.py only
    fitting = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if "lstsq" in p.read_text())
    assert fitting == ["core/cost_fit.py"], fitting


ARCHITECTURE = ROOT / "docs" / "architecture.md"


def test_the_architecture_page_matches_the_tree() -> None:
    """Every folder of the package is named in docs/architecture.md's layer block, and every
    ``folder/file.py`` the page names exists (a moved or renamed module fails here)."""
    text = ARCHITECTURE.read_text()
    block = text.split("```")[1]
    folders = sorted(p.name for p in SRC.iterdir() if p.is_dir() and p.name != "__pycache__")
    missing = [f for f in folders if f"{f}/" not in block]
    assert not missing, f"folders not in the layer block of docs/architecture.md: {missing}"
    # a module as the page names it (``core/tracks.py``), not a test's path (``tests/core/...``)
    named = set(re.findall(rf"(?<![\w/])((?:{'|'.join(folders)})/\w+\.py)\b", text))
    gone = sorted(n for n in named if not (SRC / n).exists())
    assert not gone, f"docs/architecture.md names modules that do not exist: {gone}"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    unlinked = [p for p in pages if f"(docs/{p})" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"
    assert len(readme.splitlines()) <= 300
