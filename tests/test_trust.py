"""What a non-admin's config may name (otray/trust.py), numeric ranges and YAML errors at load.

The seven import-path kinds an attacker used to run code as root (issue "A real security
boundary"): each is refused for a user and passes unchanged for an admin.
"""

import pkgutil
from pathlib import Path

import pytest

from otray import config
from otray.trust import BUNDLED_MODULES, Caller, ForbiddenConfigError, confine
from otray.types import ConfigError

from tests.conftest import ROOT  # noqa: E402 (the repository root)
ALICE, ADMIN = Caller("alice", False), Caller("root", True)


def _env_cfg(**env):
    base = {"entry": "envs.arithmetic:Arithmetic",
            "dataset": {"builder": "envs.arithmetic:make_dataset", "dir": ".cache/data/arithmetic"},
            "splits": {"train": {}, "eval": {"shuffle": False}}}
    return {"model": {"path": "tiny"}, "envs": {"arithmetic": {**base, **env}}}


def _game_cfg(**game):
    base = {"entry": "envs.rps:parallel_env", "text": "envs.rps:TEXT",
            "policies": {"player_0": "trained", "player_1": "random"}}
    return {"model": {"path": "tiny"}, "game": {**base, **game}}


ATTACKS = {  # the seven kinds, as the report used them
    "dataset.builder": _env_cfg(dataset={"builder": "builtins:exec", "dir": "import os"}),
    "sft.dataset.builder": {**_env_cfg(), "job": {"kind": "sft"},
                            "sft": {"steps": 1, "dataset": {"builder": "builtins:exec"}, "splits": {"train": {}}}},
    "envs.entry": _env_cfg(entry="os:system", kwargs={"command": "id"}),
    "gymnasium env": _env_cfg(entry="gymnasium", kwargs={"env": "os:system"}),
    "game.entry": _game_cfg(entry="os:system"),
    "game.text": _game_cfg(text="planted_by_a_job:TEXT"),
    "scripted policy": _game_cfg(policies={"player_0": "trained", "player_1": "scripted:planted_by_a_job:move"}),
    "game.move_reward": _game_cfg(move_reward="planted_by_a_job:shape(bonus=1)"),  # an eighth, added later
}


@pytest.mark.parametrize("kind", ATTACKS)
def test_import_paths_refused_for_users_allowed_for_admins(kind, tmp_path):
    with pytest.raises(ForbiddenConfigError, match="not code this cluster lets users run"):
        confine(config.load(ATTACKS[kind]), ALICE, BUNDLED_MODULES, tmp_path)
    cfg = config.load(ATTACKS[kind])
    assert config.to_dict(confine(cfg, ADMIN, BUNDLED_MODULES, tmp_path)) == config.to_dict(config.load(ATTACKS[kind]))


def test_allowed_modules_still_check_the_attribute(tmp_path):
    for entry, why in (("envs.arithmetic:random", "the module random"),  # a module it imported
                       ("envs.arithmetic:Path", "not defined in envs.arithmetic"),  # a class it imported
                       ("envs.arithmetic:register", "it is otray.env:register"),  # a function it imported
                       ("envs.arithmetic:_problems_cache", "private attribute"),
                       ("otray.env:import_object", "otray's own machinery"),  # imported from otray.structured
                       ("otray.env:make", "otray's own machinery"),  # builds any env from a string
                       ("envs.calculator:ExactAnswer", "it is envs.answers:ExactAnswer")):  # a sibling module's
        with pytest.raises(ForbiddenConfigError, match=why):
            confine(config.load(_env_cfg(entry=entry)), ALICE, BUNDLED_MODULES, tmp_path)
    with pytest.raises(ForbiddenConfigError, match="'planted'"):  # an OpenReward server module to import
        confine(config.load(_env_cfg(entry="openreward", kwargs={"base_url": "local:planted"})), ALICE,
                BUNDLED_MODULES, tmp_path)
    # what an admin allowed (otray modules allow) is usable by users
    allowed = BUNDLED_MODULES | {"planted_by_a_job"}
    confine(config.load(ATTACKS["game.text"]), ALICE, allowed, tmp_path)


def test_paths_are_confined_to_the_users_area(tmp_path):
    cfg = confine(config.load(_env_cfg()), ALICE, BUNDLED_MODULES, tmp_path / "users" / "alice")
    assert cfg.envs["arithmetic"].dataset.dir == str(tmp_path / "users" / "alice" / "data" / ".cache/data/arithmetic")
    bad = {
        "checkpoint.resume_from": {"checkpoint": {"resume_from": "/root/.otray/checkpoints/x/step-000001"}},
        "model.path": {"model": {"path": str(tmp_path)}},
        "job.output_dir": {"job": {"output_dir": "/work/main/envs"}},
        "model.cache_dir": {"model": {"path": "tiny", "cache_dir": "/tmp/x"}},
        "dataset.dir": {"envs": {"arithmetic": {"dataset": {"dir": "../../root"}}}},
        "splits.train.path": {"envs": {"arithmetic": {"splits": {"train": {"path": "/root/.ray/auth_token"}}}}},
    }
    for key, override in bad.items():
        data = _env_cfg()
        for section, value in override.items():
            if section == "envs":
                env = data["envs"]["arithmetic"]
                for k, v in value["arithmetic"].items():
                    env[k] = {**env.get(k, {}), **v}
            else:
                data[section] = {**data.get(section, {}), **value}
        with pytest.raises(ForbiddenConfigError, match=key.split(".")[-1]):
            confine(config.load(data), ALICE, BUNDLED_MODULES, tmp_path)
        confine(config.load(data), ADMIN, BUNDLED_MODULES, tmp_path)  # an admin may
    ok = confine(config.load({**_env_cfg(), "model": {"path": "Qwen/Qwen3-8B"},
                              "checkpoint": {"resume_from": "20261123-101010-abcdef:3"}}), ALICE, BUNDLED_MODULES, tmp_path)
    assert ok.model.path == "hub:Qwen/Qwen3-8B"  # a hub id the loader never reads from a local dir


def test_a_users_model_is_tiny_or_a_hub_id_never_read_from_a_local_path(tmp_path, monkeypatch):
    from otray.models import resolve_model_path
    from otray.types import ModelLoadError

    for spec in ("tiny:/etc", "tiny:../x", "tinyx", "tiny-nope", "tiny-100m:1e9", "runs/../etc", "/etc/x", "./x",
                 "hub:/etc/x"):
        with pytest.raises(ForbiddenConfigError, match="model.path"):
            confine(config.load({**_env_cfg(), "model": {"path": spec}}), ALICE, BUNDLED_MODULES, tmp_path)
    for spec in ("tiny", "tiny:3", "tiny-100m:7"):
        assert confine(config.load({**_env_cfg(), "model": {"path": spec}}), ALICE, BUNDLED_MODULES,
                       tmp_path).model.path == spec
    # 'runs/x' reads as a hub id; a directory of that name where the job runs is never loaded for a user
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "x").mkdir(parents=True)
    cfg = confine(config.load({**_env_cfg(), "model": {"path": "runs/x"}}), ALICE, BUNDLED_MODULES, tmp_path)
    with pytest.raises(ModelLoadError, match="a local path of that name exists here"):
        resolve_model_path(cfg.model.path)
    assert resolve_model_path("hub:org/model") == "org/model"
    assert confine(config.load({**_env_cfg(), "model": {"path": "tinyllama/TinyLlama-1.1B"}}), ALICE, BUNDLED_MODULES,
                   tmp_path).model.path == "hub:tinyllama/TinyLlama-1.1B"
    admin = confine(config.load({**_env_cfg(), "model": {"path": "runs/x"}}), ADMIN, BUNDLED_MODULES, tmp_path)
    assert resolve_model_path(admin.model.path) == "runs/x"  # an admin's path loads as given


@pytest.mark.parametrize("path", sorted(p.name for p in (ROOT / "conf").glob("*.yaml")))
def test_every_bundled_config_is_one_a_user_may_submit(path, tmp_path):
    confine(config.load(ROOT / "conf" / path), ALICE, BUNDLED_MODULES, tmp_path)


def test_bundled_modules_are_the_shipped_envs():
    import envs

    shipped = {m.name for m in pkgutil.walk_packages(envs.__path__, "envs.") if not m.name.endswith("__main__")}
    assert shipped == {m for m in BUNDLED_MODULES if m.startswith("envs.")}, \
        "a new bundled env module: decide whether users may name it and update otray/trust.py"


@pytest.mark.parametrize("override,message", [
    ("sft.batch_size=-1", "sft.batch_size must be >= 1 and <= 65536, got -1"),
    ("algo.micro_batch_tokens=-1", "algo.micro_batch_tokens must be >= 0 and <= 16777216"),  # 0: derived
    ("algo.steps=100000000", "algo.steps must be >= 0 and <= 1000000, got 100000000"),  # upper bounds too
    ("envs.arithmetic.num_rollouts=100000", "envs.arithmetic.num_rollouts must be >= 1 and <= 4096"),
    ("rollout.max_model_len=100000000", "rollout.max_model_len must be >= 8 and <= 1048576"),
    ("eval.num_samples=-3", "eval.num_samples must be >= 1"),
    ("envs.arithmetic.temperature=-0.5", "envs.arithmetic.temperature must be >= 0"),
    ("envs.arithmetic.max_tokens_per_turn=0", "envs.arithmetic.max_tokens_per_turn must be >= 1"),
    ("resources.learner_cpus=-1", "resources.learner_cpus must be >= 0"),
    ("envs.arithmetic.top_p=0", "envs.arithmetic.top_p must be > 0 and <= 1"),
    ("envs.arithmetic.min_p=1.5", "envs.arithmetic.min_p must be >= 0 and <= 1, got 1.5"),
    ("algo.learning_rate=nan", "algo.learning_rate must be >= 0, got nan"),
])
def test_numeric_ranges_checked_at_load(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        config.load(ROOT / "conf" / "arithmetic_grpo.yaml", [override])


def test_malformed_and_non_mapping_yaml_name_file_and_line(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("job:\n  name: x\nalgo: {steps: [1,\n")
    with pytest.raises(ConfigError, match=r"broken.yaml:\d+: not valid YAML"):
        config.load(broken)
    listed = tmp_path / "list.yaml"
    listed.write_text("- job\n- algo\n")
    with pytest.raises(ConfigError, match=r"list.yaml:1: a config is a mapping .* not a list"):
        config.load(listed)
    with pytest.raises(ConfigError, match="not a list"):
        config.load(["job"])  # type: ignore[arg-type]


def test_a_users_env_reaches_only_addresses_an_admin_allowed(tmp_path):
    """An OpenReward env's base_url (env or dataset kwargs) and any other URL in kwargs: refused for a
    user unless allowed (so the cluster's OpenReward key goes nowhere else); local:MODULE and the
    default service stay open; an admin passes."""
    def cfg(url, where="env"):
        kwargs = {"environment": "ToolAddition", "variant": "ToolAddition", "base_url": url}
        env = {"entry": "envs.openreward:OpenRewardEnv", "kwargs": kwargs if where == "env" else {"environment": "x"},
               "dataset": {"builder": "envs.openreward:make_dataset",
                           "kwargs": kwargs if where == "dataset" else {"environment": "x"}},
               "splits": {"train": {}}}
        return config.load({"envs": {"orw": env}})

    for url, where, key in (("http://127.0.0.1:6379", "env", "envs.orw.kwargs.base_url"),
                            ("http://127.0.0.1:6379/", "dataset", "envs.orw.dataset.kwargs.base_url"),
                            ("https://evil.example/x", "env", "envs.orw.kwargs.base_url")):
        with pytest.raises(ForbiddenConfigError, match=f"{key}: .* not an address an admin allowed"):
            confine(cfg(url, where), ALICE, BUNDLED_MODULES, tmp_path)
        confine(cfg(url, where), ADMIN, BUNDLED_MODULES, tmp_path)
    allowed = frozenset({"http://10.0.0.5:8090"})
    confine(cfg("http://10.0.0.5:8090/", "env"), ALICE, BUNDLED_MODULES, tmp_path, allowed)  # trailing slash: same
    confine(cfg("local:envs.openreward_examples", "dataset"), ALICE, BUNDLED_MODULES, tmp_path)
    with pytest.raises(ForbiddenConfigError, match="'planted'"):  # a dataset's local: server is code too
        confine(cfg("local:planted", "dataset"), ALICE, BUNDLED_MODULES, tmp_path)
