"""The layout rules of docs/architecture.md, checked on the source: the role folders and the directions
imports may take between them, no import circle, no private name imported across files, every actor
class in the folder of its role, class sizes, no mixins, and a repository that points nowhere outside
itself. Pure: reads files, starts nothing."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OTRAY = ROOT / "otray"

# Each role folder and the folders it may import (itself and ``base`` always). ``base`` is every module
# directly under otray/ that is not an entry point (config, env, types, models, ...): the vocabulary.
FOLDERS = {
    "entry": "otray/__init__.py otray/cli.py otray/client.py otray/train.py otray/local.py",
    "serve": "otray/serve/",
    "tinker.gateway": "otray/tinker/gateway/",  # the Tinker API's rooms, one per process (otray/tinker/__init__.py)
    "tinker.service": "otray/tinker/service/",
    "tinker.learner": "otray/tinker/learner/",
    "tinker.wire": "otray/tinker/wire/",
    "tinker": "otray/tinker/__init__.py otray/tinker/errors.py otray/tinker/config.py",
    "control": "otray/actors/control/",
    "job": "otray/actors/job/",
    "rollout": "otray/actors/rollout/",
    "learner": "otray/actors/learner/",
    "sampling": "otray/actors/sampling/",
    "algos": "otray/algos/",
}
MAY_IMPORT = {
    "entry": set(FOLDERS),
    "serve": {"control", "sampling"},
    "tinker.gateway": {"tinker.service", "tinker.wire", "tinker", "serve", "control"},  # it shares Serve's helpers
    "tinker.service": {"tinker.learner", "tinker.wire", "tinker", "control", "learner", "sampling", "algos"},
    "tinker.learner": {"tinker.wire", "tinker", "learner", "sampling", "algos"},
    "tinker.wire": {"tinker"},
    "tinker": {"sampling"},  # errors.py and config.py, every room's vocabulary (config asks whether vLLM imports)
    "control": {"job"},  # the JobDriver runs the job
    "job": {"rollout", "learner", "sampling", "algos"},
    "rollout": {"sampling"},  # the agent loop and a game's coordinator route generate calls over a RolloutFleet
    "learner": {"sampling", "algos"},  # a colocated learner samples with the sampling backends
    "sampling": set(),
    "algos": set(),
    "base": set(),
}
# Where each actor class lives: the folder of its role.
ACTOR_ROLES = {
    "ResourceManager": "control", "JobDriver": "control",
    "PolicyLearner": "learner", "LearnerGroup": "learner", "LearnerRank": "learner",
    "RolloutWorker": "sampling",
    "ProtocolCoordinator": "rollout",
    "TinkerService": "tinker.service", "SharedLearner": "tinker.learner", "LoraSampler": "tinker.learner",
    "TinkerGateway": "tinker.gateway", "TinkerOpenAI": "tinker.gateway",
    "Gateway": "serve",
}


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for p in sorted(OTRAY.rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = modules()


def folder_of(path: Path) -> str:
    rel = str(path.relative_to(ROOT))
    for name, spec in FOLDERS.items():
        if any(rel == s or (s.endswith("/") and rel.startswith(s)) for s in spec.split()):
            return name
    return "base"


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every ``import`` in a file, at top level or inside functions."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names]))
    return out


def otray_targets(path: Path) -> set[str]:
    """The otray modules a file imports (``from m import sub`` counts ``m.sub`` where that is a module)."""
    out = set()
    for module, names in imports(path):
        if module.split(".")[0] != "otray":
            continue
        subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
        out.update(subs or [module] if module in MODULES or subs else [])
        if module in MODULES and len(subs) < len(names):
            out.add(module)
    return out


def test_every_folder_is_known_and_every_import_goes_the_allowed_way():
    bad = []
    for name, path in MODULES.items():
        here = folder_of(path)
        for target in otray_targets(path):
            there = folder_of(MODULES[target])
            if there not in {here, "base"} | MAY_IMPORT[here]:
                bad.append(f"{path.relative_to(ROOT)} ({here}) imports {target} ({there})")
    assert not bad, "imports against the folder directions of docs/architecture.md:\n" + "\n".join(bad)
    known = {s.rstrip("/") for spec in FOLDERS.values() for s in spec.split() if s.endswith("/")}
    known |= {str(Path(s).parent) for spec in FOLDERS.values() for s in spec.split() if s.endswith(".py")} - {"otray"}
    for d in sorted({str(p.parent.relative_to(ROOT)) for p in MODULES.values() if p.name != "__init__.py"} - {"otray"}):
        assert any(d == k or d.startswith(k + "/") for k in known), f"{d}/ is in no role folder: add it to FOLDERS"


def test_base_is_the_bottom_and_the_directions_have_no_circle():
    assert not [m for m, p in MODULES.items() if folder_of(p) == "base"
                and any(folder_of(MODULES[t]) != "base" for t in otray_targets(p))]
    seen: dict[str, int] = {}

    def visit(f: str, stack: tuple[str, ...]) -> None:
        assert f not in stack, f"folder circle: {' -> '.join(stack + (f,))}"
        for g in MAY_IMPORT[f] - {f}:
            visit(g, stack + (f,))
        seen[f] = 1

    for f in MAY_IMPORT:
        visit(f, ())


def test_no_import_circle_between_modules():
    graph = {m: otray_targets(p) - {m} for m, p in MODULES.items()}
    # a package's face (__init__) counts as importing nothing: importing a submodule runs it first
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    state: dict[str, int] = {}
    circles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                circles.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_no_private_name_is_imported_from_another_file():
    files = [*MODULES.values(), *(ROOT / "envs").glob("*.py")]
    bad = [f"{p.relative_to(ROOT)}: from {m} import {n}" for p in files for m, names in imports(p)
           if m.split(".")[0] in ("otray", "envs") for n in names if n.startswith("_") and not n.startswith("__")]
    assert not bad, bad


def actor_classes() -> dict[str, Path]:
    """Classes made into Ray actors or Serve deployments (decorated, or passed to ``ray.remote``)."""
    defined = {node.name: p for p in MODULES.values() for node in ast.walk(ast.parse(p.read_text()))
               if isinstance(node, ast.ClassDef)}
    found = {}
    for p in MODULES.values():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                decos = [ast.unparse(d) for d in node.decorator_list]
                if any(d.startswith(("ray.remote", "serve.deployment")) for d in decos):
                    found[node.name] = p
            elif isinstance(node, ast.Call) and ast.unparse(node.func).startswith("ray.remote"):
                for arg in node.args:
                    if isinstance(arg, ast.Name) and arg.id in defined:
                        found[arg.id] = defined[arg.id]
    return found


def test_every_actor_class_lives_in_the_folder_of_its_role():
    found = actor_classes()
    assert {"ResourceManager", "PolicyLearner", "RolloutWorker", "ProtocolCoordinator"} <= set(found)
    for name, path in found.items():
        assert name in ACTOR_ROLES, f"actor class {name} ({path.relative_to(ROOT)}) has no role: add it to ACTOR_ROLES"
        assert folder_of(path) == ACTOR_ROLES[name], f"{name} is in {path.relative_to(ROOT)}, its role is {ACTOR_ROLES[name]}"


@pytest.mark.parametrize("module, forbidden", [
    ("config.py", ("otray.algos", "otray.actors", "otray.actors.rollout", "torch")),
    ("config_checks.py", ("otray.algos", "otray.actors", "otray.actors.rollout", "torch")),
    ("env.py", ("otray.config", "otray.actors", "otray.actors.rollout")),
    ("games.py", ("otray.",)),
    ("names.py", ("otray.algos", "otray.config", "torch")),
    ("policies.py", ("otray.config", "otray.actors")),
    ("structured.py", ("otray.config", "otray.env")),
    ("trust.py", ("otray.actors", "otray.actors.rollout", "otray.serve", "otray.algos")),
    ("ranges.py", ("otray.",)),
    ("records.py", ("otray.",)),
    ("metric_keys.py", ("otray.",)),
])
def test_low_modules_import_nothing_above_them(module, forbidden):
    found = [m for m, _ in imports(OTRAY / module) if m.startswith(forbidden) and m != "otray.types"
             and not m.startswith("otray.types.")]
    assert not found, f"otray/{module} imports {found}"


def test_bundled_games_use_the_public_api():
    for p in sorted((ROOT / "envs").glob("*.py")):
        assert not [m for m, _ in imports(p) if m.startswith(("otray.actors.rollout", "otray.actors"))], p


def code_lines(node: ast.ClassDef, source: list[str]) -> int:
    """A class's lines of code: without blank lines, comment lines and docstrings (its own and its
    methods'), so that documenting a class never pushes it over the cap."""
    docs = set()
    for inner in ast.walk(node):
        body = getattr(inner, "body", None)
        if isinstance(inner, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                isinstance(body[0].value.value, str):
            docs.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for n in range(node.lineno, node.end_lineno + 1)
               if n not in docs and source[n - 1].strip() and not source[n - 1].strip().startswith("#"))


def test_classes_are_small_files_are_short_and_no_class_is_a_mixin():
    for p in MODULES.values():
        source = p.read_text().splitlines()
        assert len(source) <= 410, f"{p.relative_to(ROOT)} is over ~400 lines: split it"
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = code_lines(node, source)
                assert lines <= 210, f"{p.name}:{node.name} has {lines} lines of code"
                assert "Mixin" not in node.name and not any("Mixin" in ast.unparse(b) for b in node.bases), node.name


def test_actor_methods_are_called_directly_not_by_string_name():
    """``getattr(handle, name).remote(...)`` hides which actor method a caller uses: call it by name."""
    bad = []
    for p in MODULES.values():
        for node in ast.walk(ast.parse(p.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr == "remote" and isinstance(node.value, ast.Call)
                    and ast.unparse(node.value.func) == "getattr"):
                bad.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not bad, bad


def test_tests_mirror_the_package():
    """tests/ mirrors the code: ``tests/<folder>/`` holds the tests of ``otray/<folder>/`` (or of the
    bundled ``envs/``), ``tests/test_<module>.py`` those of ``otray/<module>.py``; ``tests/cluster/``
    the tests that start clusters of their own, ``tests/fixtures/`` helpers and helper envs (no tests)."""
    tests = ROOT / "tests"
    bad = []
    for f in sorted(tests.rglob("test_*.py")):
        rel = f.relative_to(tests)
        if len(rel.parts) == 1:
            ok = (OTRAY / rel.name.removeprefix("test_")).exists() or rel.name in ("test_layout.py", "test_gpu.py")
        else:
            folder = Path(*rel.parts[:-1])
            ok = (OTRAY / folder).is_dir() or folder.parts[0] in ("envs", "cluster")
        if not ok:
            bad.append(str(rel))
    assert not bad, f"test files that mirror no module or folder of otray/: {bad}"
    assert not list((tests / "fixtures").glob("test_*.py"))


def test_nothing_in_the_repository_points_outside_it():
    texts = [p for p in [*ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md"), *OTRAY.rglob("*.py"),
                         *(ROOT / "benchmarks").glob("*.md")]]
    assert (ROOT / "docs" / "architecture.md").exists()
    assert "docs/architecture.md" in (ROOT / "README.md").read_text()
    for p in texts:
        assert "../shared" not in p.read_text(), f"{p.relative_to(ROOT)} points at ../shared"


DOTTED = re.compile(r"(?<![\w./-])otray(?:\.[A-Za-z_]\w*)+")


def defines(body: list[ast.stmt], rest: list[str]) -> bool:
    """Whether ``body`` (a module's or a class's) defines the dotted ``rest`` (a class, function, name or
    import; a class's attributes after it), looking inside ``if``/``try``/``with`` blocks too."""
    name = rest[0]
    for stmt in body:
        if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
            return len(rest) == 1 or (isinstance(stmt, ast.ClassDef) and defines(stmt.body, rest[1:]))
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return len(rest) == 1
        if isinstance(stmt, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name).split(".")[0] == name
                                                                  for a in stmt.names):
            return True
        if isinstance(stmt, (ast.If, ast.Try, ast.With)):
            inner = [*stmt.body, *getattr(stmt, "orelse", []), *getattr(stmt, "finalbody", []),
                     *[s for h in getattr(stmt, "handlers", []) for s in h.body]]
            if defines(inner, rest):
                return True
    return False


def resolves(dotted: str) -> bool:
    """Whether ``otray.a.b.C.d`` names a module of the package and, after it, something it defines (read
    from the source: nothing is imported)."""
    parts = dotted.removesuffix(".py").split(".")
    for k in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:k])
        src = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
        if src.exists():
            return k == len(parts) or defines(ast.parse(src.read_text()).body, parts[k:])
    return False


def test_dotted_names_in_docstrings_and_docs_resolve():
    """Every ``otray.x.y`` a docstring under ``otray/`` or a page under ``docs/`` names exists: prose that
    points at a moved or renamed module fails here instead of sending a reader nowhere."""
    assert resolves("otray.actors.job.step.rl_step") and resolves("otray.types.WeightUpdate.checksum")
    assert not resolves("otray.actors.step.rl_step") and not resolves("otray.types.NoSuchThing")
    bad = []
    for p in MODULES.values():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                bad += [f"{p.relative_to(ROOT)}: {m}" for m in DOTTED.findall(ast.get_docstring(node) or "")
                        if not resolves(m)]
    for p in sorted((ROOT / "docs").rglob("*.md")):
        bad += [f"{p.relative_to(ROOT)}: {m}" for m in DOTTED.findall(p.read_text()) if not resolves(m)]
    assert not bad, "names that do not resolve:\n" + "\n".join(bad)


def test_the_tinker_wing_is_in_rooms_by_process():
    """``otray/tinker/`` holds its rooms (gateway, service, learner, wire: one per process, and the wire
    formats they share) and only ``__init__.py``, ``errors.py`` and ``config.py`` beside them; every module
    of a room says in its docstring which process runs it."""
    loose = sorted(p.name for p in (OTRAY / "tinker").glob("*.py"))
    assert loose == ["__init__.py", "config.py", "errors.py"], loose
    rooms = sorted(p.name for p in (OTRAY / "tinker").iterdir() if p.is_dir() and p.name != "__pycache__")
    assert rooms == ["gateway", "learner", "service", "wire"], rooms
    silent = [str(p.relative_to(ROOT)) for p in sorted((OTRAY / "tinker").rglob("*.py"))
              if "Runs in" not in (ast.get_docstring(ast.parse(p.read_text())) or "")]
    assert not silent, f"modules whose docstring does not say where they run ('Runs in ...'): {silent}"
