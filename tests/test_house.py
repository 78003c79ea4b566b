"""The house's rules that import-linter's contracts (pyproject.toml, run by `make test`) do not state: no
import cycle between engine/'s modules, even inside one subpackage; few modules directly in engine/; small
files."""

from __future__ import annotations

from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 300
FACE = {"__init__.py", "llm.py"}


def module_graph() -> grimp.ImportGraph:
    # TYPE_CHECKING imports count: a cycle through them is still a cycle to whoever reads the code.
    return grimp.build_graph("engine", exclude_type_checking_imports=False, cache_dir=None)


def test_no_import_cycle_between_engine_modules() -> None:
    graph = module_graph()
    modules = sorted(m for m in graph.modules if not graph.is_module_squashed(m))
    cycles = []
    for m in modules:
        for imported in graph.find_modules_directly_imported_by(m):
            # m -> imported, and imported reaches m back: a cycle through that edge
            if imported != m and graph.chain_exists(importer=imported, imported=m, as_packages=False):
                cycles.append(f"{m} -> {imported}")
    assert not cycles, f"import cycles: {cycles}"


def test_few_modules_directly_in_engine() -> None:
    loose = [p.name for p in (ROOT / "engine").glob("*.py") if p.name not in FACE]
    assert len(loose) <= 6, f"modules directly in engine/ besides the face: {loose}"


def test_every_engine_subpackage_says_what_it_owns_and_may_import() -> None:
    for init in sorted((ROOT / "engine").glob("*/__init__.py")):
        doc = init.read_text()
        assert doc.startswith('"""') and "import" in doc.split('"""')[1], f"{init.relative_to(ROOT)}: no docstring"


def test_no_source_file_over_the_line_limit() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for folder in ("engine", "server")
        for p in (ROOT / folder).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines (split by concern): {long}"
