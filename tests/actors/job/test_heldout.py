"""The held-out guard of RL jobs (otray/actors/job/heldout.py) and how the job's table shows it."""

import pytest

from otray import config
from otray import metric_keys as K
from otray.actors.job.heldout import HeldoutWatch
from otray.actors.job.run import table_row


def _eval(step, acc, phase=K.PHASE_GRPO):
    return {K.STEP: step, K.PHASE: phase, K.EVAL_ACCURACY: acc, K.EVAL_STDERR: 0.03}


def test_change_from_start_on_every_eval_and_a_warning_at_the_second_eval_in_a_row_below():
    watch = HeldoutWatch.of(_eval(0, 0.70, K.PHASE_SFT))
    assert watch.see({K.STEP: 1, K.PHASE: K.PHASE_GRPO}) == {}  # no eval in the row: nothing
    first = watch.see(_eval(10, 0.66))  # 4 points below, more than the 3-point standard error
    assert abs(first[K.EVAL_CHANGE] + 0.04) < 1e-12
    assert K.EVAL_WARNING not in first
    second = watch.see(_eval(20, 0.60))
    assert "0.600 at step 20" in second[K.EVAL_WARNING] and "0.700" in second[K.EVAL_WARNING]
    assert "algo.kl_coeff > 0" in second[K.EVAL_WARNING]  # a job without a pull is told to add one
    assert K.EVAL_WARNING not in watch.see(_eval(30, 0.60))  # told once per run of such evals


def test_a_job_that_already_pulls_is_told_to_pull_harder_not_to_add_a_pull():
    watch = HeldoutWatch.of(_eval(0, 0.70, K.PHASE_SFT), kl_coeff=1.0)
    watch.see(_eval(10, 0.63))
    warning = watch.see(_eval(20, 0.63))[K.EVAL_WARNING]
    assert "a larger algo.kl_coeff (the pull towards the starting policy is 1)" in warning
    assert "kl_coeff > 0" not in warning and "sft.stop_at_accuracy" in warning
    replayed = HeldoutWatch.replay([_eval(0, 0.70, K.PHASE_SFT), _eval(10, 0.63)], kl_coeff=0.5)
    assert "is 0.5)" in replayed.see(_eval(20, 0.63))[K.EVAL_WARNING]
    assert K.EVAL_WARNING not in watch.see(_eval(30, 0.63))  # told once per run of such evals


def test_a_fall_far_past_the_standard_error_warns_at_its_first_eval_once():
    # calculator seed 1 (session 58): 35% -> 32% -> 0% in one step, at the job's last eval
    watch = HeldoutWatch.of({**_eval(0, 0.35, K.PHASE_SFT), K.EVAL_STDERR: 0.048})
    assert K.EVAL_WARNING not in watch.see(_eval(25, 0.32))
    warning = watch.see(_eval(50, 0.0))[K.EVAL_WARNING]
    assert "0.000 at step 50" in warning and "7 times over" in warning
    assert K.EVAL_WARNING not in watch.see(_eval(75, 0.0))  # the same run of evals: told once
    assert K.EVAL_WARNING not in watch.see(_eval(100, 0.30))  # 5 points below, one eval: not yet
    watch.see(_eval(125, 0.40))  # recovered
    assert K.EVAL_WARNING in watch.see(_eval(150, 0.0))  # a new fall is told again
    # 2.9 standard errors (0.087) below: within the patience rule's reach, not at once
    assert K.EVAL_WARNING not in HeldoutWatch.of(_eval(0, 0.70, K.PHASE_SFT)).see(_eval(10, 0.613))
    # a start with no spread (100%) still needs a real fall, not a rounding
    sure = HeldoutWatch.of({**_eval(0, 1.0, K.PHASE_SFT), K.EVAL_STDERR: 0.0})
    assert K.EVAL_WARNING not in sure.see(_eval(10, 0.97))
    fresh = HeldoutWatch.of({**_eval(0, 1.0, K.PHASE_SFT), K.EVAL_STDERR: 0.0})
    assert "at once" in fresh.see(_eval(10, 0.5))[K.EVAL_WARNING]


def test_within_the_standard_error_or_a_recovery_in_between_gives_no_warning():
    watch = HeldoutWatch.of(_eval(0, 0.70, K.PHASE_SFT))
    for step, acc in ((10, 0.68), (20, 0.68), (30, 0.62), (40, 0.72), (50, 0.62)):
        assert K.EVAL_WARNING not in watch.see(_eval(step, acc)), step
    assert HeldoutWatch.of({K.STEP: 0, K.PHASE: K.PHASE_INIT}) is None  # nothing to hold (no accuracy)


def test_a_resumed_job_replays_its_rows_and_warns_where_the_unbroken_run_would():
    rows = [_eval(0, 0.1, K.PHASE_BASE), _eval(0, 0.70, K.PHASE_SFT), {K.STEP: 5, K.PHASE: K.PHASE_GRPO},
            _eval(10, 0.63)]
    watch = HeldoutWatch.replay(rows)
    assert watch.start == 0.70 and watch.below == 1
    assert K.EVAL_WARNING in watch.see(_eval(20, 0.61))
    assert HeldoutWatch.replay([_eval(0, 0.1, K.PHASE_BASE)]) is None


def test_the_table_prints_the_warning_under_its_row():
    row = {**_eval(20, 0.6), K.EVAL_WARNING: "held-out accuracy fell"}
    line, warning = table_row(row).split("\n")
    assert line.split()[:2] == ["20", "grpo"] and warning == "WARNING: held-out accuracy fell"
    assert "\n" not in table_row(_eval(20, 0.6))


def test_kl_coeff_unset_pulls_a_vision_language_model_towards_its_warm_up_and_nothing_else(tiny_path, vl_path):
    from otray.actors.job.train_job import resolve_kl_coeff

    def cfg(**algo):
        return config.load({"model": {"path": "tiny"}, "algo": algo,
                                 "envs": {"a": {"entry": "envs.arithmetic:Arithmetic", "splits": {"train": {}}}}})

    assert cfg().algo.kl_coeff is None
    assert resolve_kl_coeff(cfg(), vl_path) == 1.0  # unset, a VLM: the pull
    assert resolve_kl_coeff(cfg(), tiny_path) == 0.0  # unset, a text model: none
    assert resolve_kl_coeff(cfg(kl_coeff=0.0), vl_path) == 0.0  # set: as set
    assert resolve_kl_coeff(cfg(kl_coeff=0.3), tiny_path) == 0.3
    sharded = cfg()
    sharded.resources.learner_workers = 2  # keeps no starting policy: never an unset pull
    assert resolve_kl_coeff(sharded, vl_path) == 0.0


def test_vision_lr_scale_unset_slows_the_warm_ups_tower_rate_and_is_refused_where_it_cannot_apply(tiny_path, vl_path):
    """algo.vision_lr_scale: unset, 0.3x the warm-up's model.vision_lr_scale where that gives the tower a group of
    its own, else the warm-up's; set, as set; refused by name on a text
    model, and where the warm-up gave the tower no optimizer group of its own."""
    from otray.actors.job.train_job import resolve_vision_lr_scale

    def cfg(model_scale: float = 0.1, **algo):
        return config.load({"model": {"path": "tiny", "vision_lr_scale": model_scale}, "algo": algo,
                            "envs": {"a": {"entry": "envs.arithmetic:Arithmetic", "splits": {"train": {}}}}})

    assert cfg().algo.vision_lr_scale is None
    assert resolve_vision_lr_scale(cfg(), vl_path) == pytest.approx(0.03)  # unset, a VLM: 0.3x the warm-up's
    assert resolve_vision_lr_scale(cfg(0.5), vl_path) == pytest.approx(0.15)
    assert resolve_vision_lr_scale(cfg(vision_lr_scale=0.0), vl_path) == 0.0  # held in RL
    assert resolve_vision_lr_scale(cfg(), tiny_path) is None  # a text model: nothing to scale
    assert resolve_vision_lr_scale(cfg(vision_lr_scale=0.05), vl_path) == 0.05  # set: as set
    assert resolve_vision_lr_scale(cfg(1.0), vl_path) == 1.0  # a tower trained as the language model
    assert resolve_vision_lr_scale(cfg(0.0), vl_path) == 0.0  # ... or frozen
    assert resolve_vision_lr_scale(cfg(1.0, vision_lr_scale=1.0), vl_path) == 1.0
    with pytest.raises(ValueError, match=r"algo\.vision_lr_scale=0\.5 is set, but 'tiny' has no vision tower"):
        resolve_vision_lr_scale(cfg(vision_lr_scale=0.5), tiny_path)
    with pytest.raises(ValueError, match=r"model\.vision_lr_scale=1 gives it none .* set model\.vision_lr_scale "
                                         r"between 0 and 1"):
        resolve_vision_lr_scale(cfg(1.0, vision_lr_scale=0.0), vl_path)

