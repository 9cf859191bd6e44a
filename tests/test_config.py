from pathlib import Path

import pytest

from otray import config
from otray.types import ConfigError

from tests.conftest import ROOT  # noqa: E402 (the repository root)
MINIMAL = {"envs": {"arithmetic": {"entry": "envs.arithmetic:Arithmetic", "splits": {"train": {}}}}}


def test_every_bundled_config_loads():
    files = sorted((ROOT / "conf").glob("*.yaml"))
    assert files
    for f in files:
        assert isinstance(config.load(f), config.Config)


def test_overrides_apply_with_types():
    cfg = config.load(ROOT / "conf" / "arithmetic_grpo.yaml", ["algo.learning_rate=2e-5", "envs.arithmetic.num_rollouts=4"])
    assert cfg.algo.learning_rate == 2e-5
    assert cfg.envs["arithmetic"].num_rollouts == 4


@pytest.mark.parametrize("data, match", [
    ({**MINIMAL, "algo": {"learnig_rate": 1e-3}}, r"algo\.learnig_rate.*did you mean 'algo\.learning_rate'"),
    ({**MINIMAL, "modle": {}}, r"unknown config key 'modle'.*did you mean 'model'"),
    ({"envs": {"a": {"entry": "x:y", "num_rollout": 3}}}, r"envs\.a\.num_rollout.*envs\.a\.num_rollouts"),
    ({"envs": {"a": {"entry": "x:y", "splits": {"train": {"shufle": True}}}}}, r"splits\.train\.shufle.*shuffle"),
    ({**MINIMAL, "algo": {"steps": "many"}}, r"algo\.steps"),
    ({**MINIMAL, "algo": {"loss_fn": "pp0"}}, r"unknown loss_fn 'pp0'"),
    ({**MINIMAL, "algo": {"advantage": "gae"}}, r"algo\.advantage='gae'"),
    ({"envs": {}}, r"defines no environment"),
    ({"envs": {"a": {"reward_reduction": "sum"}}}, r"envs\.a\.entry is missing"),
    ({"envs": {"a": {"entry": "x:y", "splits": {"eval": {}}}}}, r"envs\.a\.splits has no 'train' split.*has: eval"),
    ({**MINIMAL, "resources": {"strategy": "SPREAD_OUT"}}, r"resources\.strategy='SPREAD_OUT'.*STRICT_SPREAD"),
    ({**MINIMAL, "resources": {"learner_workers": 2, "learner_gpus": 0.5}},
     r"NCCL refuses two ranks on one GPU.*learner_gpus: 1"),
    ({**MINIMAL, "rollout": {"gpu_memory_utilization": 1.5}}, r"rollout\.gpu_memory_utilization must be > 0 and <= 1"),
    ({**MINIMAL, "algo": {"max_steps_off_policy": 2}}, r"algo\.max_steps_off_policy must be >= 0 and <= 1, got 2"),
    ({**MINIMAL, "algo": {"max_steps_off_policy": 1, "loss_fn": "cross_entropy"}}, r"corrects for the sampler"),
    ({**MINIMAL, "rollout": {"colocate": True, "backend": "vllm"}}, r"rollout\.colocate=true .* set rollout\.backend to hf"),
    ({**MINIMAL, "rollout": {"colocate": True}, "algo": {"max_steps_off_policy": 1}},
     r"colocate=true .* algo\.max_steps_off_policy must be 0"),
    ({**MINIMAL, "job": {"kind": "infer"}}, r"envs\.arithmetic has no 'eval' split .*has: train.*--split"),
    ({**MINIMAL, "job": {"kind": "infer"}, "infer": {"split": "train", "limit": 0}}, r"infer\.limit must be >= 1"),
    ({**MINIMAL, "infer": {"splt": "train"}}, r"infer\.splt.*did you mean 'infer\.split'"),
    ({**MINIMAL, "algo": {"lr_schedule": "step"}}, r"algo\.lr_schedule='step'.*cosine"),
    ({**MINIMAL, "algo": {"kl_coeff": -0.1}}, r"algo\.kl_coeff must be >= 0"),
    ({**MINIMAL, "algo": {"kl_coeff": 0.1}, "resources": {"learner_workers": 2}},
     r"algo\.kl_coeff=0\.1 .*sharded learner.*learner_workers to 1"),
    ({**MINIMAL, "model": {"vision_lr_scale": -1}}, r"model\.vision_lr_scale must be >= 0"),
])
def test_bad_configs_name_the_key(data, match):
    with pytest.raises(ConfigError, match=match):
        config.load(data)


def test_bad_override_and_missing_file():
    with pytest.raises(ConfigError, match="did you mean 'algo.batch_size'"):
        config.load(MINIMAL, ["algo.batchsize=3"])
    with pytest.raises(ConfigError, match="key=value"):
        config.load(MINIMAL, ["algo.batch_size"])
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(ROOT / "conf" / "nope.yaml")


GAME = {"entry": "envs.gomoku:env", "text": "envs.gomoku:text", "policies": {"black": "trained", "white": "random"}}


@pytest.mark.parametrize("game, extra, match", [
    ({"policies": {"black": "random", "white": "random"}}, {}, "at least one trained agent"),
    ({"policies": {"black": "trained", "white": "frozen"}}, {}, r"trained\[:NAME\] \| frozen:REF"),
    ({"eval_opponents": ["trained:x"]}, {}, "eval_opponents takes"),
    ({"context": "chat"}, {}, "game.context"),
    ({}, {"sft": {"steps": 10}}, "needs chat demonstrations"),
    ({"policies": {"black": "trained:a", "white": "trained:b"}},
     {"sft": {"steps": 10, "splits": {"train": {"path": "x.jsonl"}}}}, "first policy only"),
    ({}, {"sft": {"stop_at_accuracy": 0.5}}, "stop_at_accuracy needs an env"),
    ({"max_turns": 0}, {}, "game.max_turns=0"),
    ({"elo_k": -1}, {}, "game.elo_k=-1"),
    ({"seatings": [{"black": "trained", "white": "random"}], "rotate_seats": True}, {}, "set game.rotate_seats=false"),
    ({"seatings": [{"black": "trained"}]}, {}, r"seatings\[0\] must name the agents"),
    ({"seatings": [{"black": "random", "white": "trained:other"}]}, {}, r"seatings\[0\] must seat at least one trained"),
    ({"seatings": [{"black": "random", "white": "random"}]}, {}, "at least one trained policy"),
])
def test_game_config_errors_name_the_problem(game, extra, match):
    with pytest.raises(ConfigError, match=match):
        config.load({"game": {**GAME, **game}, **extra})


def test_seatings_list_the_training_seatings_and_their_frozen_policies_get_workers():
    from otray.actors.control.resource_manager import bundles_for
    from otray.policies import PolicySpec, training_seatings
    from otray.trust import import_refs

    seats = [{"black": "trained", "white": "random"}, {"black": "frozen:/ckpt", "white": "trained"},
             {"black": "scripted:mine:weak(p=0.9)", "white": "trained"}]
    cfg = config.load({"game": {**GAME, "seatings": seats}})
    assert [s["black"] for s in training_seatings(cfg)] == [PolicySpec("trained", "main"), PolicySpec("frozen", "/ckpt"),
                                                            PolicySpec("scripted", "mine:weak(p=0.9)")]
    assert config.frozen_policies(cfg) == [PolicySpec("frozen", "/ckpt")] and len(bundles_for(cfg)) == 3
    assert ("game.seatings[2].black", "mine:weak") in import_refs(cfg)  # checked like every import a user names


def test_policy_sets_and_bundles():
    from otray.actors.control.resource_manager import bundles_for
    from otray.policies import PolicySpec

    cfg = config.load({"game": {**GAME, "policies": {"black": "trained:b", "white": "trained:w"},
                                "eval_opponents": ["random", "frozen:/ckpt"]}, "rollout": {"num_workers": 2}})
    assert config.trained_policies(cfg) == ["b", "w"] and config.frozen_policies(cfg) == [PolicySpec("frozen", "/ckpt")]
    assert len(bundles_for(cfg)) == 2 * (1 + 2) + 1  # per trained policy: learner + 2 workers; the frozen worker
    selfplay = config.load({"game": {**GAME, "policies": {"black": "trained", "white": "trained:main"}}})
    assert config.trained_policies(selfplay) == ["main"] and len(bundles_for(selfplay)) == 2


@pytest.mark.parametrize("text, spec, label", [
    ("trained", ("trained", "main"), "main"), ("trained:w", ("trained", "w"), "w"), ("random", ("random", ""), "random"),
    ("scripted:envs.tictactoe_text:heuristic", ("scripted", "envs.tictactoe_text:heuristic"), "heuristic"),
    ("scripted:envs.gomoku:heuristic(random_prob=0.3)", ("scripted", "envs.gomoku:heuristic(random_prob=0.3)"),
     "heuristic-random_prob-0.3"),
    ("frozen:20260101-000000-abcdef:7", ("frozen", "20260101-000000-abcdef:7"), "frozen-20260101-000000-abcdef-7"),
    ("frozen:/runs/a/checkpoints/step-000010/", ("frozen", "/runs/a/checkpoints/step-000010/"), "frozen-step-000010")])
def test_policy_specs_parse_once_and_print_back(text, spec, label):
    from otray.policies import PolicySpec

    parsed = PolicySpec.parse(text)
    assert (parsed.kind, parsed.arg) == spec and parsed.label == label
    assert PolicySpec.parse(str(parsed)) == parsed  # the canonical text parses to the same spec


@pytest.mark.parametrize("text, match", [
    ("scripted:envs.gomoku:heuristic(0.3)", "name=literal"), ("scripted:envs.gomoku:heuristic(p=open('x'))", "name=literal"),
    ("scripted:envs.gomoku:heuristic(p=0.3", "module:fn or module:fn"), ("scripted:heuristic", "module:fn or module:fn")])
def test_scripted_arguments_are_literals(text, match):
    from otray.policies import PolicySpec, scripted_function

    with pytest.raises(ConfigError, match=match):
        PolicySpec.parse(text, "game.eval_opponents")
    fn = scripted_function(PolicySpec.parse("scripted:envs.gomoku:heuristic(random_prob=0.5)"))
    assert fn.keywords == {"random_prob": 0.5}
    with pytest.raises(ConfigError, match="does not take these arguments"):
        scripted_function(PolicySpec.parse("scripted:envs.gomoku:heuristic(randomness=0.5)"))


@pytest.mark.parametrize("text", ["", "frozen", "scripted", "random:x", "model:a", "trainedx"])
def test_bad_policy_specs_are_config_errors(text):
    from otray.policies import PolicySpec

    with pytest.raises(ConfigError, match="is not a policy"):
        PolicySpec.parse(text, "game.policies.black")


def test_inference_jobs_lease_workers_and_pin_their_checkpoint():
    from otray.checkpoints import pin_refs, registered_refs
    from otray.actors.control.resource_manager import bundles_for

    cfg = config.load({**MINIMAL, "job": {"kind": "infer"}, "rollout": {"num_workers": 2, "colocate": True},
                       "infer": {"split": "train", "checkpoint": "20260101-000000-abcdef"}})
    assert config.num_rollout_workers(cfg) == 2  # no learner to generate with, colocate or not
    assert len(bundles_for(cfg)) == 1 + 2  # the driver's bundle + the workers
    assert registered_refs(cfg) == ["20260101-000000-abcdef"]
    pin_refs(cfg, {"20260101-000000-abcdef": "20260101-000000-abcdef:7"})
    assert cfg.infer.checkpoint == "20260101-000000-abcdef:7"
    assert registered_refs(config.load({**MINIMAL, "infer": {"checkpoint": "20260101-000000-abcdef"}})) == []
