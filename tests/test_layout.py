"""The layout rules of docs/architecture.md, checked on the source: import directions, class sizes,
no mixins, and a repository that points nowhere outside itself."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OTRAY = ROOT / "otray"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at top level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def under(package: str) -> list[Path]:
    return sorted((OTRAY / package).rglob("*.py")) if package else sorted(OTRAY.glob("*.py"))


def test_actors_never_import_the_cli_or_the_train_entry_point():
    bad = {str(p.relative_to(ROOT)): sorted(m for m in imported_modules(p)
                                            if m.split(".")[:2] in (["otray", "train"], ["otray", "cli"]))
           for p in under("actors")}
    assert not {k: v for k, v in bad.items() if v}


@pytest.mark.parametrize("module, forbidden", [
    ("config.py", ("otray.algos", "otray.actors", "otray.coordinator", "torch")),
    ("env.py", ("otray.config", "otray.actors", "otray.coordinator")),
    ("games.py", ("otray.",)),
    ("names.py", ("otray.algos", "otray.config", "torch")),
    ("policies.py", ("otray.config", "otray.actors")),
    ("structured.py", ("otray.config", "otray.env")),
    ("trust.py", ("otray.actors", "otray.coordinator", "otray.serve", "otray.algos")),
    ("ranges.py", ("otray.",)),
])
def test_low_modules_import_nothing_above_them(module, forbidden):
    found = [m for m in imported_modules(OTRAY / module) if m.startswith(forbidden) and m != "otray.types"
             and not m.startswith("otray.types.")]
    assert not found, f"otray/{module} imports {found}"


def test_coordinator_and_algos_do_not_import_actors_and_bundled_games_use_the_public_api():
    for p in [*under("coordinator"), *under("algos")]:
        assert not [m for m in imported_modules(p) if m.startswith("otray.actors")], p
    for p in sorted((ROOT / "envs").glob("*.py")):
        assert not [m for m in imported_modules(p) if m.startswith("otray.coordinator")], p


def test_actor_classes_are_small_and_no_class_is_a_mixin():
    for p in under("actors"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                assert lines <= 250, f"{p.name}:{node.name} has {lines} lines"
                assert "Mixin" not in node.name and not any("Mixin" in ast.unparse(b) for b in node.bases), node.name


def test_nothing_in_the_repository_points_outside_it():
    texts = [p for p in [*ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md"), *OTRAY.rglob("*.py"),
                         *(ROOT / "benchmarks").glob("*.md")]]
    assert (ROOT / "docs" / "architecture.md").exists()
    assert "docs/architecture.md" in (ROOT / "README.md").read_text()
    for p in texts:
        assert "../shared" not in p.read_text(), f"{p.relative_to(ROOT)} points at ../shared"
