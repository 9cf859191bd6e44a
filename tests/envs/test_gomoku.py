"""Gomoku as a PettingZoo AECEnv: PettingZoo's api_test, rules, reproducibility, text side."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pettingzoo.test import api_test

from envs import gomoku


@pytest.mark.parametrize("kwargs", [{}, {"size": 5, "win_length": 4}])
def test_pettingzoo_api_test(kwargs):
    api_test(gomoku.env(**kwargs), num_cycles=300)


def _play(seed, size=9):
    """A seeded game of random legal moves; returns the moves and final rewards."""
    e = gomoku.env(size=size)
    e.reset(seed=seed)
    rng = np.random.default_rng(seed)
    moves = []
    for agent in e.agent_iter():
        obs, reward, term, trunc, _ = e.last()
        if term or trunc:
            e.step(None)
            continue
        action = int(rng.choice(np.flatnonzero(obs["action_mask"])))
        moves.append(action)
        e.step(action)
    return moves, dict(e.rewards)


def test_seeded_games_are_reproducible_and_zero_sum():
    a, b = _play(3), _play(3)
    assert a == b and _play(4)[0] != a[0]
    for seed in range(5):
        _, rewards = _play(seed, size=5)
        assert sum(rewards.values()) == 0


@pytest.mark.parametrize("line", [
    [(4, c) for c in range(5)],            # row
    [(r, 2) for r in range(5)],            # column
    [(i, i) for i in range(5)],            # diagonal
    [(i, 8 - i) for i in range(4, 9)],     # anti-diagonal
])
def test_five_in_a_row_wins_in_every_direction(line):
    e = gomoku.raw_env()
    e.reset()
    filler = [r * 9 + c for r, c in [(0, 8), (1, 8), (2, 8), (3, 7)]]  # on no line above
    for k, (r, c) in enumerate(line):
        e.step(r * 9 + c)  # black
        if k < 4:
            e.step(filler[k])  # white, far away
    assert e.rewards == {"black": 1, "white": -1} and all(e.terminations.values())


def test_observation_is_from_the_observers_side():
    e = gomoku.raw_env(size=5, win_length=4)
    e.reset()
    e.step(0)  # black at A1
    white = e.observe("white")["observation"]
    black = e.observe("black")["observation"]
    assert black[0, 0, 0] == 1 and white[0, 0, 1] == 1 and white[0, 0, 0] == 0
    assert e.observe("white")["action_mask"][0] == 0
    text = gomoku.render_text(e.observe("white"), "white")
    assert text.splitlines()[1].startswith(" 1 O") and "<move>E5</move>" in text


@settings(max_examples=200, deadline=None)
@given(st.integers(3, 19).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n * n - 1))))
def test_move_names_round_trip(size_action):
    size, action = size_action
    assert gomoku.parse_move(f"I play <move>{gomoku.move_name(action, size)}</move>.", size) == action


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_move_parser_never_raises(text):
    got = gomoku.parse_move(text, 9)
    assert got is None or 0 <= got < 81


# --------------------------------------------------------------------------- the simultaneous-move game


def bundled_factories(name: str) -> list[str]:
    """``module:name`` for every module under envs/ that defines a top-level function ``name`` (read from
    the source, so a new game module is checked without being listed here)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "envs"
    return [f"envs.{p.stem}:{name}" for p in sorted(root.glob("*.py"))
            if any(isinstance(n, ast.FunctionDef) and n.name == name for n in ast.parse(p.read_text()).body)]


def test_the_bundled_game_modules_are_found():
    assert {"envs.gomoku:env", "envs.rps:env", "envs.textarena_game:env"} <= set(bundled_factories("env"))
    assert "envs.rps:parallel_env" in bundled_factories("parallel_env")


@pytest.mark.parametrize("factory", [*bundled_factories("env"), "pettingzoo.classic.tictactoe_v3:env",
                                     "pettingzoo.classic.connect_four_v3:env"])
def test_pettingzoo_api_test_on_the_aec_form_of_every_bundled_game(factory):
    from otray.structured import import_object

    api_test(import_object(factory)(), num_cycles=50)


@pytest.mark.parametrize("factory", bundled_factories("parallel_env"))
def test_pettingzoo_parallel_api_test_on_every_bundled_parallel_game(factory):
    from pettingzoo.test import parallel_api_test

    from otray.structured import import_object

    parallel_api_test(import_object(factory)(), num_cycles=50)


def test_rps_parallel_api_and_rules():
    from pettingzoo.test import parallel_api_test

    from envs import rps

    parallel_api_test(rps.parallel_env(), num_cycles=100)
    e = rps.parallel_env(rounds=2)
    obs, _ = e.reset(seed=0)
    assert obs == {"player_0": rps.NONE, "player_1": rps.NONE}
    obs, rewards, term, _, _ = e.step({"player_0": 1, "player_1": 0})  # paper beats rock
    assert rewards == {"player_0": 1.0, "player_1": -1.0} and obs == {"player_0": 0, "player_1": 1}
    _, rewards, term, _, _ = e.step({"player_0": 2, "player_1": 0})  # rock beats scissors
    assert rewards == {"player_0": -1.0, "player_1": 1.0} and all(term.values()) and e.agents == []
    assert rps.parse_move("I say <move>Scissors</move>") == 2 and rps.parse_move("scissors") is None
    assert "last move: paper" in rps.render_text(1, "player_0")


def test_chat_dataset_holds_legal_moves_in_the_reply_format(tmp_path):
    import json

    from envs.gomoku import make_chat_dataset, parse_move

    paths = make_chat_dataset(str(tmp_path), size=4, win_length=3, num_train=30, num_eval=5)
    assert make_chat_dataset(str(tmp_path), size=4, win_length=3, num_train=30, num_eval=5) == paths  # built once
    assert "4x4-3" in paths["train"].name and "-30." in paths["train"].name  # another board or size: another file
    rows = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    assert len(rows) == 30 and len({r["id"] for r in rows}) == 30
    for row in rows:
        board, reply = row["messages"][0]["content"], row["messages"][1]["content"]
        action = parse_move(reply, 4)
        assert action is not None
        cells = [line.split()[1:] for line in board.splitlines()[1:5]]  # rows "1 . X O ." under the header
        assert cells[action // 4][action % 4] == "."  # a random legal move: an empty cell


def test_heuristic_teacher_labels_the_same_positions_with_the_heuristics_move(tmp_path):
    import json

    from envs.gomoku import heuristic, make_chat_dataset, parse_move

    taught = make_chat_dataset(str(tmp_path), size=4, win_length=3, num_train=40, num_eval=5, teacher="heuristic")
    plain = make_chat_dataset(str(tmp_path), size=4, win_length=3, num_train=40, num_eval=5)
    assert taught["train"] != plain["train"] and "-heuristic" in taught["train"].name
    rows = [[json.loads(line)["messages"] for line in p["train"].read_text().splitlines()] for p in (taught, plain)]
    assert [r[0] for r in rows[0]] == [r[0] for r in rows[1]]  # the same boards (one random game stream)
    differ = 0
    for (board, reply), (_, random_reply) in zip(rows[0], rows[1]):
        lines = [line.split()[1:] for line in board["content"].splitlines()[1:5]]
        planes = np.array([[[v == "X", v == "O"] for v in line] for line in lines], dtype=np.int8)
        mask = np.array([v == "." for line in lines for v in line], dtype=np.int8)
        assert parse_move(reply["content"], 4) == heuristic({"observation": planes, "action_mask": mask}, "black")
        differ += reply["content"] != random_reply["content"]
    assert differ > 10
    with pytest.raises(ValueError, match="teacher"):
        make_chat_dataset(str(tmp_path), size=4, win_length=3, teacher="expert")


def test_tactics_teacher_keeps_positions_with_one_winning_or_blocking_cell(tmp_path):
    import json

    from envs.gomoku import make_chat_dataset, parse_move, winning_cells

    taught = make_chat_dataset(str(tmp_path), size=4, win_length=3, num_train=60, num_eval=5, teacher="tactics")
    kinds = set()
    for line in taught["train"].read_text().splitlines():
        board, reply = json.loads(line)["messages"]
        cells = [row.split()[1:] for row in board["content"].splitlines()[1:5]]
        planes = np.array([[[v == "X", v == "O"] for v in row] for row in cells], dtype=np.int8)
        mask = np.array([v == "." for row in cells for v in row], dtype=np.int8)
        mine, theirs = winning_cells(planes[..., 0], mask, 3), winning_cells(planes[..., 1], mask, 3)
        label = parse_move(reply["content"], 4)
        assert (mine == [label]) or (not mine and theirs == [label])  # the one right move: win, else block
        kinds.add("win" if mine else "block")
    assert kinds == {"win", "block"}


def test_listing_moves_names_exactly_the_empty_cells_and_the_dataset_follows(tmp_path):
    import json

    e = gomoku.raw_env(size=4, win_length=3)
    e.reset()
    e.step(5)  # black at B2
    e.step(0)  # white at A1
    text = gomoku.text_listing_moves(size=4)
    seen = text.render(e.observe("black"), "black")
    listed = next(line for line in seen.splitlines() if line.startswith("Empty cells:")).split()[2:]
    assert len(listed) == 14 and "A1" not in listed and "B2" not in listed and "D4" in listed
    assert seen.startswith(gomoku.render_board(e.board)) and text.parse("<move>C3</move>") == 10
    assert "Empty cells" not in gomoku.text(size=4).render(e.observe("black"), "black")
    paths = gomoku.make_chat_dataset(str(tmp_path), size=4, win_length=3, num_train=20, num_eval=5, list_moves=True)
    assert "-moves-" in paths["train"].name  # not the plain prompts' file
    for row in map(json.loads, paths["train"].read_text().splitlines()):
        prompt, reply = row["messages"][0]["content"], row["messages"][1]["content"]
        empty = next(line for line in prompt.splitlines() if line.startswith("Empty cells:")).split()[2:]
        assert reply[len("<move>"):-len("</move>")] in empty  # a random legal move, one the prompt lists


def test_winning_cells_are_the_empty_cells_that_complete_a_line():
    stones = np.zeros((4, 4), dtype=np.int8)
    stones[0, 0] = stones[0, 1] = 1  # A1 B1: C1 completes three (row 1)
    stones[2, 2] = 1  # C3: with A1 on the diagonal, B2 completes A1-B2-C3
    mask = np.ones(16, dtype=np.int8)
    mask[[0, 1, 10]] = 0
    assert gomoku.winning_cells(stones, mask, 3) == [2, 5]
    mask[5] = 0  # B2 taken (by the other player): no longer a threat
    assert gomoku.winning_cells(stones, mask, 3) == [2]
    assert gomoku.winning_cells(stones, mask, 4) == []  # nothing makes four


def _observation(mine: list[int], theirs: list[int], size: int = 4) -> dict[str, np.ndarray]:
    planes = np.zeros((size, size, 2), dtype=np.int8)
    for plane, cells in ((0, mine), (1, theirs)):
        for a in cells:
            planes[divmod(a, size) + (plane,)] = 1
    mask = np.ones(size * size, dtype=np.int8)
    mask[mine + theirs] = 0
    return {"observation": planes, "action_mask": mask}


def test_tactics_rewards_taking_a_win_and_blocking_a_single_threat_only():
    reward = lambda obs, action: gomoku.tactics(obs, "black", action, win_length=3, win=1.0, block=0.5)  # noqa: E731
    own_win = _observation(mine=[0, 1], theirs=[4, 5])  # A1 B1 (C1 wins) against A2 B2 (C2 would win)
    assert reward(own_win, 2) == 1.0  # took the win
    assert reward(own_win, 6) == 0.0  # blocked instead of winning: no reward
    assert reward(own_win, 15) == 0.0
    threat = _observation(mine=[15], theirs=[0, 1])  # the opponent's A1 B1: C1 is the one block
    assert reward(threat, 2) == 0.5 and reward(threat, 3) == 0.0
    double = _observation(mine=[15], theirs=[0, 1, 4])  # C1 and A3 both win for them: no saving move
    assert gomoku.winning_cells(double["observation"][..., 1], double["action_mask"], 3) == [2, 8]
    assert [reward(double, a) for a in (2, 8)] == [0.0, 0.0]
    assert reward(_observation(mine=[], theirs=[]), 5) == 0.0


def test_open_lines_name_every_run_that_holds_a_stone_and_an_empty_cell(tmp_path):
    import json

    assert len(gomoku.lines_of(4, 3)) == 24 and len(gomoku.lines_of(9, 5)) == 9 * 5 + 9 * 5 + 5 * 5 + 5 * 5
    assert sorted(map(len, gomoku.lines_of(5, 4))) == [4] * 28  # 5x5 / four: 2 a row and a column, 4 + 4 diagonals
    board = np.zeros((4, 4), dtype=np.int8)
    board[0, 0] = board[0, 1] = 2  # their A1 B1
    board[1, 1] = 1  # my B2
    shown = gomoku.render_lines(board, 3).splitlines()
    assert "A1 B1 C1: O O ." in shown and "A1 B2 C3: O X ." in shown  # their threat at C1, a mixed diagonal
    assert "D2 D3 D4: . . ." not in "\n".join(shown)  # empty lines are left out
    assert all(line.count(".") >= 1 for line in shown)
    obs = {"observation": np.stack([board == 1, board == 2], -1).astype(np.int8),
           "action_mask": (board.reshape(-1) == 0).astype(np.int8)}
    text = gomoku.text_with_lines(size=4, win_length=3).render(obs, "white")
    assert text.startswith(gomoku.render_board(board)) and "Lines:\nA1 B1 C1: O O ." in text
    paths = gomoku.make_chat_dataset(str(tmp_path), size=4, win_length=3, num_train=10, num_eval=2, lines=True)
    assert "-lines" in paths["train"].name
    assert all("Lines:" in json.loads(row)["messages"][0]["content"] for row in paths["train"].read_text().splitlines())
