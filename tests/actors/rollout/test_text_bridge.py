"""The PettingZoo <-> text bridge on Gomoku: prompts, moves, the illegal-move rule."""

import pytest

from envs import gomoku
from otray.actors.rollout.text_bridge import MoveRules, TextBridge
from otray.games import GameText, generic_parse, generic_render


def _bridge(rules=None, text=None):
    env = gomoku.env(size=5, win_length=4)
    env.reset(seed=0)
    text = text or GameText(render=gomoku.render_text, parse=lambda r: gomoku.parse_move(r, 5))
    return env, TextBridge(env, text, rules or MoveRules())


def test_moves_alternate_and_the_winner_is_rewarded():
    env, bridge = _bridge()
    assert "You are X" in bridge.prompt("black")
    moves = ["A1", "A2", "B1", "B2", "C1", "C2", "D1"]  # black gets A1..D1 (four in a row)
    for i, move in enumerate(moves):
        agent = env.agent_selection
        assert agent == ("black" if i % 2 == 0 else "white")
        assert bridge.act(agent, f"<move>{move}</move>").kind == "played"
    assert all(env.terminations.values()) and bridge.rewards() == {"black": 1.0, "white": -1.0}
    with pytest.raises(ValueError, match="turn"):
        _bridge()[1].act("white", "<move>A1</move>")


def test_illegal_moves_retry_then_random_or_forfeit():
    env, bridge = _bridge(MoveRules(max_retries=2, on_exhausted="random"))
    bridge.act("black", "<move>A1</move>")
    first = bridge.act("white", "<move>A1</move>")  # taken
    assert first.kind == "retry" and "not legal" in first.observation
    assert bridge.act("white", "no idea").kind == "retry"
    played = bridge.act("white", "still no idea")
    assert played.kind == "random" and played.action != 0 and env.agent_selection == "black"
    assert bridge.counts["white"] == {"illegal": 3, "random_moves": 1, "forfeits": 0}
    env, bridge = _bridge(MoveRules(max_retries=0, on_exhausted="forfeit"))
    assert bridge.act("black", "pass").kind == "forfeit"
    assert bridge.rewards() == {"black": -1.0, "white": 1.0} and bridge.counts["black"]["forfeits"] == 1


def test_generic_fallback_lists_legal_indices():
    env, bridge = _bridge(text=GameText())
    text = bridge.prompt("black")
    assert "Legal moves: 0, 1, 2" in text and "<move>N</move>" in text
    assert bridge.act("black", "<move>7</move>").action == 7
    legal = bridge.prompt("white").split("Legal moves:")[1].split(".")[0]
    assert 7 not in [int(x) for x in legal.split(",")] and 8 in [int(x) for x in legal.split(",")]
    assert generic_parse("<move> 12 </move>") == 12 and generic_parse("12") is None
    assert generic_render({"observation": [1], "action_mask": [0, 1]}, "p").endswith("Reply with one as <move>N</move>.")


def test_pettingzoo_tictactoe_unmodified_through_the_bridge():
    from pettingzoo.classic import tictactoe_v3

    from envs.tictactoe_text import TEXT

    env = tictactoe_v3.env()
    env.reset(seed=0)
    bridge = TextBridge(env, TEXT, MoveRules(max_retries=1))
    assert bridge.prompt("player_1").splitlines()[0] == "0 | 3 | 6"
    for agent, square in [("player_1", 0), ("player_2", 1), ("player_1", 3), ("player_2", 4)]:
        assert bridge.act(agent, f"<move>{square}</move>").kind == "played"
    # player_1 sees the opponent's marks as O: squares 1 and 4 (left and centre of the middle row)
    assert bridge.prompt("player_1").splitlines()[1] == "O | O | 7"
    assert bridge.act("player_1", "<move>4</move>").kind == "retry"  # taken
    assert bridge.act("player_1", "<move>6</move>").kind == "played"  # top row: X X X
    assert all(env.terminations.values()) and bridge.rewards() == {"player_1": 1.0, "player_2": -1.0}


def test_pettingzoo_connect_four_unmodified_through_the_bridge():
    from pettingzoo.classic import connect_four_v3

    from envs.connect_four_text import TEXT

    env = connect_four_v3.env()
    env.reset(seed=0)
    bridge = TextBridge(env, TEXT, MoveRules(max_retries=1))
    assert bridge.prompt("player_0").splitlines()[0] == "0 1 2 3 4 5 6"
    for agent, column in [("player_0", 3), ("player_1", 3), ("player_0", 4), ("player_1", 4),
                          ("player_0", 5), ("player_1", 5)]:
        assert bridge.act(agent, f"<move>{column}</move>").kind == "played"
    board = bridge.prompt("player_0").splitlines()
    assert board[6] == ". . . X X X ." and board[5] == ". . . O O O ."  # the bottom row is its own, as X
    assert bridge.act("player_0", "<move>9</move>").kind == "retry"  # no column 9
    assert bridge.act("player_0", "<move>6</move>").kind == "played"  # four in the bottom row
    assert all(env.terminations.values()) and bridge.rewards() == {"player_0": 1.0, "player_1": -1.0}
