"""TextArena games (the real ``textarena`` package) through envs/textarena_game.py and the coordinator.

PettingZoo's ``api_test`` runs on the adapter with the other bundled games (tests/envs/test_gomoku.py: an
observation carries its text and a fixed-length byte view the checker compares); here whole games are
played through ``agent_iter`` / ``last`` / ``step(None)``, as PettingZoo documents it."""

import random

import pytest

from envs import textarena_game as ta_game
from otray.actors.rollout.agent_loop import Limits
from otray.actors.rollout.protocol import Policy, ProtocolCoordinator
from otray.types import SamplingParams



def _play_random(game, rng):
    """One game through PettingZoo's loop with random legal moves; returns the final rewards."""
    game.reset(seed=rng.randrange(2**31))
    totals = {a: 0.0 for a in game.possible_agents}
    for agent in game.agent_iter(max_iter=200):
        obs, reward, term, trunc, info = game.last()
        totals[agent] += reward
        assert isinstance(obs["text"], str) and game.observation_space(agent).contains(obs)
        assert bytes(obs["observation"]).rstrip(b"\0") == obs["text"].encode()[:len(obs["observation"])].rstrip(b"\0")
        game.step(None if term or trunc else rng.choice(game.legal_moves(agent)))
    return totals


@pytest.mark.parametrize("env_id, players", [("TicTacToe-v0-train", 2), ("TicTacToe-v0", 2),
                                             ("ThreePlayerTicTacToe-v0-train", 3)])
def test_random_games_follow_the_aec_protocol(env_id, players):
    rng = random.Random(0)
    game = ta_game.env(env_id, players)
    outcomes = [_play_random(game, rng) for _ in range(20)]
    for totals in outcomes:
        assert set(totals) == {f"player_{i}" for i in range(players)} and not game.agents
        assert all(r in (-1.0, 0.0, 1.0) for r in totals.values())
        if players == 2:
            assert sum(totals.values()) == 0  # TextArena's two-player games are zero-sum
    assert any(max(t.values()) == 1.0 for t in outcomes)


def test_invalid_replies_follow_textarenas_rule_and_are_flagged():
    game = ta_game.env("TicTacToe-v0-train")
    game.reset(seed=3)
    game.step("I would like the centre please [4]")  # TextArena reads the reply itself
    assert game.infos["player_0"] == {"invalid_move": False} and game.agent_selection == "player_1"
    game.step("[4]")  # taken: TextArena asks again (error_allowance 1) ...
    assert game.infos["player_1"]["invalid_move"] and game.agent_selection == "player_1"
    assert "[4]" not in game.legal_moves("player_1") and len(game.legal_moves("player_1")) == 8
    game.step("no idea")  # ... and a second invalid reply loses the game
    assert game.infos["player_1"]["invalid_move"] and all(game.terminations.values())
    assert game.rewards == {"player_0": 1.0, "player_1": -1.0}


def test_bad_games_name_the_problem():
    with pytest.raises(ValueError, match="no game 'TicTacToe-v9'"):
        ta_game.env("TicTacToe-v9")
    with pytest.raises(ValueError, match="cannot seat 3 players"):
        ta_game.env("TicTacToe-v0", 3).reset(seed=0)
    nim = ta_game.env("Nim-v0-train")
    nim.reset(seed=0)
    with pytest.raises(ValueError, match="lists no legal moves.*scripted"):
        nim.legal_moves(nim.agent_selection)


def test_heuristic_beats_random_through_the_coordinator():
    text = ta_game.text()
    heuristic = Policy("scripted", fn=ta_game.heuristic)
    for seats in ({"player_0": heuristic, "player_1": Policy("random")},
                  {"player_0": Policy("random"), "player_1": heuristic}):
        me = next(a for a, p in seats.items() if p is heuristic)
        results = ProtocolCoordinator(ta_game.env, text, seats).run(range(60))
        assert all(r.error is None for r in results)
        wins, losses = sum(r.rewards[me] > 0 for r in results), sum(r.rewards[me] < 0 for r in results)
        assert wins >= 36 and losses <= 6, (me, wins, losses)
        assert all(isinstance(m, str) and m.startswith("[") for r in results for _, m in r.moves)


@pytest.fixture(scope="module")
def worker(tiny_path):
    from otray.actors.sampling.rollout import RolloutWorker

    return RolloutWorker(tiny_path, "hf", max_model_len=1024, seed=0)


def test_a_model_plays_textarena_with_its_own_prompts(worker, tokenizer):
    """The model sees TextArena's observation as is and its reply goes to TextArena whole; each invalid
    reply is counted, and TextArena's rule (not game.max_retries) decides what follows."""
    model = Policy("model", generate=worker.generate, params=SamplingParams(max_tokens=6, temperature=1.0))
    coord = ProtocolCoordinator(ta_game.env, ta_game.text(), {"model": model, "random": Policy("random")}, tokenizer,
                                limits=Limits(max_turns=50, max_tokens_per_turn=6, max_tokens_per_episode=200,
                                              max_model_len=1024), context="turn")
    results = coord.run(range(6), {"player_0": "model", "player_1": "random"})
    for game in results:
        assert game.error is None and sum(game.rewards.values()) == 0
        turns = game.agent_trajectories("player_0")
        assert turns and all(t.reward == game.rewards["player_0"] for t in turns)
        first = turns[0].messages
        assert first[0]["content"].startswith("You are Player 0 in Tic Tac Toe") and first[1]["role"] == "assistant"
        replies = [m for a, m in game.moves if a == "player_0"]
        assert replies == [t.messages[1]["content"] for t in turns]  # every reply went to TextArena whole
        # replaying the moves on a fresh game gives the same game: the same invalid replies, the same result
        replay, invalid = ta_game.env(), 0
        replay.reset(seed=game.seed)
        for agent, move in game.moves:
            assert replay.agent_selection == agent
            replay.step(move)
            invalid += agent == "player_0" and replay.infos[agent]["invalid_move"]
        assert all(replay.terminations.values()) and replay.rewards == game.rewards
        assert invalid == game.counts["player_0"]["illegal"]
    assert sum(r.counts["player_0"]["illegal"] for r in results) > 0


def test_chat_dataset_holds_legal_textarena_moves(tmp_path):
    import json

    paths = ta_game.make_chat_dataset(str(tmp_path), num_train=30, num_eval=5)
    rows = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    assert len(rows) == 30 and len({r["id"] for r in rows}) == 30
    for row in rows:
        user, reply = row["messages"][0]["content"], row["messages"][1]["content"]
        assert user.startswith("You are Player") and f"'{reply}'" in user.split("Available Moves:")[-1]
