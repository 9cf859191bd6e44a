"""Images in observations (otray.vision) and check_env on image observations: pure, no model."""

from __future__ import annotations

import io

import pytest
from PIL import Image as PILImage

from envs.shapes import CountShapes, count_task, draw, scene
from otray.env import Env, StepResult, check_env
from otray.types import EnvCheckError, EnvStateError, Task
from otray.vision import Image, ImageError, images_of, openai_content, parts, template_content, text_of


def png(size=(8, 8), colour=(255, 0, 0), fmt="PNG") -> bytes:
    buf = io.BytesIO()
    PILImage.new("RGB", size, colour).save(buf, format=fmt)
    return buf.getvalue()


def test_image_checks_what_it_wraps():
    im = Image.from_bytes(png())
    assert (im.format, im.width, im.height) == ("png", 8, 8)
    assert Image.from_data_url(im.data_url()) == im
    assert Image.from_bytes(png(fmt="JPEG")).format == "jpeg"
    with pytest.raises(ImageError, match="unreadable image"):
        Image.from_bytes(png()[:30])  # a truncated file
    with pytest.raises(ImageError, match="unreadable image"):
        Image.from_bytes(b"not an image at all")
    with pytest.raises(ImageError, match=r"image of \d+ bytes is over the limit of 10: send a smaller"):
        Image.from_bytes(png(), max_bytes=10)
    with pytest.raises(ImageError, match="8x8 pixels is over the limit of 63 pixels"):
        Image.from_bytes(png(), max_pixels=63)
    with pytest.raises(ImageError, match="format 'gif' is not taken"):
        Image.from_bytes(png(fmt="GIF"))
    with pytest.raises(ImageError, match="not a data URL"):
        Image.from_data_url("https://example.com/cat.png")
    with pytest.raises(ImageError, match="base64 does not decode"):
        Image.from_data_url("data:image/png;base64,@@@")


def test_observation_parts_in_both_shapes():
    im = Image.from_bytes(png())
    obs = [im, "How many?"]
    assert parts("plain") == ["plain"] and images_of("plain") == []
    assert parts(obs) == obs and images_of(obs) == [im]
    assert text_of(obs) == "<image>How many?"
    assert template_content(obs) == [{"type": "image"}, {"type": "text", "text": "How many?"}]
    as_openai = openai_content(obs)
    assert as_openai[0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert parts(as_openai) == obs  # the OpenAI content shape reads back to the same parts
    with pytest.raises(ImageError, match="part 1 is int"):
        parts(["text", 3])
    with pytest.raises(ImageError, match="not a data URL"):
        parts([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])


def test_count_shapes_env_passes_check_env_and_shows_its_count():
    import random

    task = Task("t", "count_shapes", count_task(random.Random(3)))
    env = CountShapes()
    check_env(env, task)
    first, _ = env.reset(task)
    picture = images_of(first)[0]
    assert (picture.width, picture.height) == (56, 56)
    count, shapes = scene(task.data["seed"])
    assert count == task.data["answer"] == len(shapes)
    pixels = picture.to_pil()
    # each drawn shape's cell holds coloured pixels at its centre; the blank control shows none
    for cell, *_ in shapes:
        assert pixels.getpixel(((cell % 2) * 28 + 14, (cell // 2) * 28 + 14)) != (255, 255, 255)
    assert draw(shapes, blank=True).to_pil().getcolors() == [(56 * 56, (255, 255, 255))]
    assert env.step(f"There are {count}.").reward == 1.0
    env.reset(task)
    assert env.step("no idea").info["parse_error"]


@pytest.mark.parametrize("question", ["colour", "kind", "where", "size"])
def test_shape_quiz_envs_pass_check_env_and_their_answer_is_in_the_picture(question):
    import random

    from envs.shape_quiz import COLOURS, KINDS, SIZES, ShapeQuiz, quiz_scene, quiz_task

    rng = random.Random(5)
    tasks = [Task(f"t{i}", "shape_quiz", quiz_task(rng, question)) for i in range(60)]
    env = ShapeQuiz(question)
    check_env(env, tasks[0])
    choices = {"colour": 3, "kind": 3, "where": 4, "size": 3}[question]
    assert {t.data["answer"] for t in tasks} == set(range(1, choices + 1))  # every choice occurs
    for task in tasks[:10]:
        cell, kind, colour, size = quiz_scene(task.data["seed"])
        band = (size > 15) + (size > 18)  # 0 small, 1 medium, 2 large
        first, _ = env.reset(task)
        centre = images_of(first)[0].to_pil().getpixel(((cell % 2) * 28 + 14, (cell // 2) * 28 + 14))
        assert centre == COLOURS[colour]  # the shape is where and what the answer says
        assert task.data["answer"] == {"colour": list(COLOURS).index(colour) + 1, "kind": KINDS.index(kind) + 1,
                                       "where": cell + 1, "size": band + 1}[question]
        lo, hi = list(SIZES.values())[band]
        assert lo <= size <= hi and sum(b - a + 1 for a, b in SIZES.values()) == 11  # 12-22, no gap
        assert env.step(f"It is {task.data['answer']}").reward == 1.0
        env.reset(task)
        assert env.step(str(task.data["answer"] % choices + 1)).reward == 0.0
    blank = ShapeQuiz(question, blank=True)
    assert images_of(blank.reset(tasks[0])[0])[0].to_pil().getcolors() == [(56 * 56, (255, 255, 255))]
    with pytest.raises(ValueError, match="colour, kind, where, size.*'shade'"):
        ShapeQuiz("shade")


def test_a_task_generator_takes_the_dataset_kwargs():
    from otray.actors.job.episodes import load_splits
    from otray.config import DatasetSection, SplitSection

    dataset = DatasetSection(generator="envs.shape_quiz:quiz_task", kwargs={"question": "where"})
    tasks = load_splits("q", dataset, {"train": SplitSection(num_samples=40)}, 0, "envs.q")["train"].tasks
    assert {t.data["answer"] for t in tasks} == {1, 2, 3, 4}  # 'where' has four choices; colour has three


class _BadImageEnv(Env):
    def __init__(self, first):
        self.first = first
        self.live = False

    def reset(self, task, seed=None):
        self.live = True
        return self.first, {}

    def step(self, action):
        if not self.live:
            raise EnvStateError("reset first")
        self.live = False
        return StepResult("", 0.0, True)


def test_check_env_names_a_bad_image_observation():
    with pytest.raises(EnvCheckError, match="reset observation must be a str or a list of parts.*unreadable image"):
        check_env(_BadImageEnv([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]),
                  Task("t", "x"))
    with pytest.raises(EnvCheckError, match="part 0 is bytes"):
        check_env(_BadImageEnv([png()]), Task("t", "x"))  # raw bytes, not wrapped in an Image


def test_shapes_times_needs_the_picture_and_the_calculator():
    import random

    from envs.shapes import ShapesTimes, times_task

    task = Task("t", "shapes_times", times_task(random.Random(5)))
    env = ShapesTimes()
    check_env(env, task, actions=(task.data["call"], "0"))
    first, _ = env.reset(task)
    assert isinstance(first[0], Image) and f"by {task.data['multiplier']}" in first[1]
    reply = env.step(task.data["call"])  # the demonstration's tool call computes count x multiplier
    assert not reply.done and f"<tool_response>{task.data['answer']}</tool_response>" in text_of(reply.observation)
    assert env.step(f"The answer is {task.data['answer']}.").reward == 1.0
    env.reset(task)
    assert env.step(str(task.data["answer"] + 1)).reward == 0.0


def test_episode_log_keeps_an_episodes_images_for_the_viewer(tmp_path):
    """The trajectory viewer's rows carry the episode's pictures as data URLs, in the order of the
    ``<image>`` markers in its messages, up to a byte budget (the rest counted, not logged)."""
    from otray.actors.job.episodes import EpisodeLog, logged_images
    from otray.types import Trajectory

    pictures = [draw(scene(seed)[1]) for seed in range(3)]
    traj = Trajectory(task=Task(id="t0", env="count_shapes", data={}),
                      messages=[{"role": "user", "content": "<image>How many?"}, {"role": "assistant", "content": "2"}],
                      images=pictures)
    log = EpisodeLog(tmp_path)
    log.add(4, [traj, Trajectory(task=Task(id="t1", env="arithmetic", data={}))], {})
    row, text_row = log.take()
    assert row["images"] == [p.data_url() for p in pictures] and row["images_omitted"] == 0
    assert Image.from_data_url(row["images"][1]).data == pictures[1].data
    assert "images" not in text_row  # a text episode's row is unchanged
    budget = len(pictures[0].data) + len(pictures[1].data)
    assert logged_images(traj, budget) == {"images": [p.data_url() for p in pictures[:2]], "images_omitted": 1}
    assert logged_images(traj, 0) == {"images": [], "images_omitted": 3}
