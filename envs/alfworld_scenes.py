"""Small ALFWorld games made here, in ALFWorld's own data layout, for tests and runs without its download.

ALFWorld's games are built from ALFRED scenes: each trial folder holds ``traj_data.json`` (the task:
``task_type`` and ``pddl_params``) and ``initial_state.pddl`` (the room as a PDDL problem in ALFWorld's
``alfred`` domain, goal included); the package's own ``alfworld-generate`` turns them into
``game.tw-pddl`` files (domain, grammar with the task sentence, problem, ``solvable``, ``walkthrough``),
which is what ``alfworld-download`` fetches ready-made. :func:`make_scenes` writes random rooms in that
layout (``json_2.1.1/train/<task>-<Object>-None-<Receptacle>-<n>/trial_<seed>/``, and ``valid_unseen``
for the held-out split) and runs ``alfworld-generate`` on them with its planner expert, so the games,
their walkthroughs and their solvability check are ALFWorld's; ``envs.alfworld_env:alfworld_games``
then lists them exactly as it lists the downloaded data (through ALFWorld's own ``AlfredTWEnv``).

A room has 2-4 receptacles (counter top, dining table, fridge, cabinet, microwave, sink basin, shelf,
drawer, garbage can; the fridge, cabinet, microwave and drawer are closed and must be opened) and
1-3 objects in them; the task names one object type and a receptacle type it does not start in.
Task types: ALFWorld's ``pick_and_place_simple``, ``pick_clean_then_place_in_recep``,
``pick_heat_then_place_in_recep``, ``pick_cool_then_place_in_recep`` (the appliance the task needs,
sink basin, microwave or fridge, is always in the room). Rooms are distinct across both splits.

Config::

    dataset: {builder: envs.alfworld_scenes:make_scenes, dir: .cache/data/alfworld_scenes,
              kwargs: {num_train: 200, num_eval: 50, task_types: [pick_and_place_simple]}}
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from otray.types import ConfigError, DatasetError

# receptacle type -> (must be opened, object types it can hold)
FOOD = ("Apple", "Egg", "Bread", "Tomato", "Potato")
DISHES = ("Mug", "Cup", "Plate", "Bowl")
RECEPTACLES: dict[str, tuple[bool, tuple[str, ...]]] = {
    "CounterTop": (False, FOOD + DISHES + ("Knife", "Spoon")),
    "DiningTable": (False, FOOD + DISHES + ("Knife", "Spoon")),
    "Fridge": (True, FOOD + DISHES),
    "Cabinet": (True, DISHES),
    "Microwave": (True, FOOD + ("Mug", "Cup", "Plate", "Bowl")),
    "SinkBasin": (False, DISHES + ("Apple", "Tomato", "Potato", "Knife", "Spoon")),
    "Shelf": (False, DISHES),
    "Drawer": (True, ("Knife", "Spoon")),
    "GarbageCan": (False, ("Apple", "Egg", "Bread", "Tomato", "Potato")),
}
# ALFRED's object properties (which appliance changes them)
CLEANABLE = set(DISHES) | {"Apple", "Tomato", "Potato", "Knife", "Spoon", "Egg"}
HEATABLE = set(FOOD) | {"Mug", "Cup", "Plate"}
COOLABLE = set(FOOD) | set(DISHES)
TASKS = {  # task type -> (object property it needs, the appliance receptacle)
    "pick_and_place_simple": (None, None),
    "pick_clean_then_place_in_recep": ("cleanable", "SinkBasin"),
    "pick_heat_then_place_in_recep": ("heatable", "Microwave"),
    "pick_cool_then_place_in_recep": ("coolable", "Fridge"),
}
SPLITS = {"train": "train", "eval": "valid_unseen"}
SEED_STRIDE = 1_000_003
MAX_TRIES = 50


def _coords(rng: random.Random, n: int = 3) -> str:
    """ALFRED's mangled coordinates, e.g. ``_bar__plus_01_dot_25_bar__minus_00_dot_40``."""
    out = ""
    for _ in range(n):
        v = rng.uniform(-3, 3)
        out += f"_bar_{'_plus_' if v >= 0 else '_minus_'}{abs(v):05.2f}".replace(".", "_dot_")
    return out


def _properties(otype: str) -> list[str]:
    props = ["pickupable"]
    props += [p for p, kinds in (("cleanable", CLEANABLE), ("heatable", HEATABLE), ("coolable", COOLABLE))
              if otype in kinds]
    return props + (["isReceptacleObject"] if otype in DISHES else [])


def draw_scene(rng: random.Random, task_type: str) -> dict[str, Any]:
    """A room: receptacle types (one of each), objects (type, index of the receptacle it is in) and the
    task; ``{}`` when the draw admits no task (the caller draws again)."""
    prop, appliance = TASKS[task_type]
    kinds = rng.sample(sorted(RECEPTACLES), rng.randint(2, 4))
    if appliance and appliance not in kinds:
        kinds[rng.randrange(len(kinds))] = appliance
    objects = []
    for _ in range(rng.randint(1, 3)):
        where = rng.randrange(len(kinds))
        objects.append((rng.choice(RECEPTACLES[kinds[where]][1]), where))
    able = {"cleanable": CLEANABLE, "heatable": HEATABLE, "coolable": COOLABLE}
    candidates = [(o, w) for o, w in objects if prop is None or o in able[prop]]
    if not candidates:
        return {}
    target, start = rng.choice(candidates)
    # a destination that holds no object of the target's type yet (else the goal holds before the first step)
    taken = {kinds[w] for o, w in objects if o == target}
    dest = [k for k in kinds if k not in taken and k != appliance and target in RECEPTACLES[k][1]]
    if not dest:
        return {}
    return {"task_type": task_type, "receptacles": kinds, "objects": objects, "object": target,
            "receptacle": rng.choice(dest)}


def scene_problem(scene: dict[str, Any], rng: random.Random, name: str) -> str:
    """The scene as a PDDL problem in ALFWorld's ``alfred`` domain, its goal from ALFWorld's goal library."""
    from alfworld.gen import goal_library

    # ALFRED names a basin after its fixture (Sink...|SinkBasin): ALFWorld's demangler reads "sinkbasin 1"
    recs = [f"{k[:-5]}{_coords(rng)}_bar_{k}" if k.endswith("Basin") else f"{k}{_coords(rng)}"
            for k in scene["receptacles"]]
    locs = [f"loc_bar_{i}_bar__minus_{rng.randint(1, 9)}_bar_{rng.randint(0, 3)}_bar_45" for i in range(len(recs))]
    start = f"loc_bar_{len(recs)}_bar_0_bar_0_bar_30"
    objs = [(f"{o}{_coords(rng)}", o, w) for o, w in scene["objects"]]
    otypes = sorted({o for _, o, _ in objs} | {scene["object"]})
    rtypes = sorted(set(scene["receptacles"]) | {scene["receptacle"]})
    decl = ["agent1 - agent"] + [f"{t}Type - otype" for t in otypes] + [f"{t}Type - rtype" for t in rtypes]
    decl += [f"{o} - object" for o, _, _ in objs] + [f"{r} - receptacle" for r in recs]
    decl += [f"{loc} - location" for loc in locs + [start]]
    init = [f"(atLocation agent1 {start})"]
    for r, kind, loc in zip(recs, scene["receptacles"], locs):
        init += [f"(receptacleType {r} {kind}Type)", f"(receptacleAtLocation {r} {loc})"]
        init += [f"(openable {r})"] if RECEPTACLES[kind][0] else []
    init += [f"(canContain {r}Type {o}Type)" for r in rtypes for o in otypes if o in RECEPTACLES[r][1]]
    for o, kind, where in objs:
        init += [f"(objectType {o} {kind}Type)", f"(inReceptacle {o} {recs[where]})",
                 f"(objectAtLocation {o} {locs[where]})"] + [f"({p} {o})" for p in _properties(kind)]
    goal = goal_library.gdict[scene["task_type"]]["pddl"].replace("#", "-").format(
        obj=scene["object"], recep=scene["receptacle"], toggle="", mrecep="")
    lines = "\n        ".join
    return (f"(define (problem {name})\n    (:domain alfred)\n    (:objects\n        {lines(decl)}\n    )\n"
            f"    (:init\n        {lines(init)}\n    )\n{goal}\n")


def _digest(scene: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(scene, sort_keys=True).encode()).hexdigest()


def write_trials(root: Path, *, num_train: int, num_eval: int, seed: int, task_types: list[str]) -> None:
    """ALFRED-style trial folders (``traj_data.json`` + ``initial_state.pddl``) under ``root/json_2.1.1``."""
    seen: set[str] = set()
    for index, (split, count) in enumerate((("train", num_train), ("eval", num_eval))):
        made = 0
        for i in range(count * MAX_TRIES):
            if made == count:
                break
            game_seed = seed * SEED_STRIDE + index * (SEED_STRIDE // 2) + i
            rng = random.Random(game_seed)
            scene = draw_scene(rng, task_types[made % len(task_types)])
            if not scene or _digest(scene) in seen:
                continue
            seen.add(_digest(scene))
            folder = (root / "json_2.1.1" / SPLITS[split] /
                      f"{scene['task_type']}-{scene['object']}-None-{scene['receptacle']}-{game_seed}" /
                      f"trial_{game_seed}")
            folder.mkdir(parents=True)
            (folder / "initial_state.pddl").write_text(scene_problem(scene, rng, f"plan_{game_seed}"))
            params = {"object_target": scene["object"], "parent_target": scene["receptacle"], "toggle_target": "",
                      "mrecep_target": "", "object_sliced": False}
            (folder / "traj_data.json").write_text(json.dumps({"task_type": scene["task_type"], "pddl_params": params,
                                                               "scene": scene}))
            made += 1
        if made < count:
            raise ConfigError(f"only {made} distinct {split} rooms of the {count} asked: ask for fewer")


def run_alfworld_generate(source: Path, out: Path, timeout_s: float = 600.0) -> None:
    """ALFWorld's own ``alfworld-generate`` (planner expert): ``game.tw-pddl`` per trial, with its walkthrough
    and solvability, in a subprocess (the planner is a C++ library; a crash there ends that process only)."""
    import alfworld

    script = Path(sys.executable).parent / "alfworld-generate"
    if not script.is_file():
        found = shutil.which("alfworld-generate")
        if found is None:
            raise DatasetError("alfworld-generate (from the alfworld package) is not on this machine: "
                               "make alfworld (pip install alfworld==0.4.2 after fast-downward-textworld)")
        script = Path(found)
    data = Path(alfworld.__file__).parent / "data"
    cmd = [sys.executable, str(script), "--data_path", str(source), "--save_path", str(out), "--expert_type",
           "planner", "--domain", str(data / "alfred.pddl"), "--grammar", str(data / "alfred.twl2"),
           "--end", "1000000000"]  # (its default end index, -1, drops the last trial)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise DatasetError(f"alfworld-generate failed (exit {done.returncode}): {done.stderr[-2000:]}")


def make_scenes(out_dir: str | Path, *, num_train: int = 50, num_eval: int = 20, seed: int = 0,
                task_types: list[str] | tuple[str, ...] = ("pick_and_place_simple",)) -> dict[str, Path]:
    """Generate ``num_train`` + ``num_eval`` distinct rooms in ALFWorld's data layout (under a folder of
    ``out_dir`` named by the arguments), make their games with ``alfworld-generate``, and return the
    rows of :func:`envs.alfworld_env.alfworld_games` for them (``train``: ALFWorld's ``train`` split,
    ``eval``: its ``valid_unseen``)."""
    from envs.alfworld_env import alfworld_games

    bad = [t for t in task_types if t not in TASKS]
    if bad or not task_types:
        raise ConfigError(f"task_types {bad or task_types!r}: the rooms made here support {sorted(TASKS)}")
    key = json.dumps([num_train, num_eval, seed, list(task_types)])
    home = Path(out_dir) / f"scenes-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    if not (home / "json_2.1.1").is_dir():
        tmp = home.with_name(home.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        write_trials(tmp / "source", num_train=num_train, num_eval=num_eval, seed=seed, task_types=list(task_types))
        run_alfworld_generate(tmp / "source" / "json_2.1.1", tmp / "json_2.1.1")
        shutil.rmtree(tmp / "source")
        shutil.rmtree(home, ignore_errors=True)
        tmp.rename(home)  # whole or not at all
    return alfworld_games(out_dir, data=str(home.relative_to(out_dir)), eval_split="valid_unseen",
                          task_types=list(task_types))
