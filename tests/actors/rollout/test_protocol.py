"""ProtocolCoordinator without Ray: phases over G games, policies, per-agent trajectories."""

import pytest

from envs import gomoku
from envs.tictactoe_text import TEXT as TTT_TEXT
from otray.actors.rollout.agent_loop import Limits
from otray.actors.rollout.protocol import Policy, ProtocolCoordinator
from otray.actors.rollout.text_bridge import MoveRules
from otray.games import GameText, legal_actions
from otray.types import SamplingParams

GOMOKU_TEXT = GameText(render=gomoku.render_text, parse=lambda r: gomoku.parse_move(r, 5))


def first_legal(obs, agent):
    return legal_actions(obs)[0]


def _gomoku():
    return gomoku.env(size=5, win_length=4)


def test_turn_order_zero_sum_and_reproducible_games():
    pol = {"black": Policy("random"), "white": Policy("scripted", fn=first_legal)}
    runs = [ProtocolCoordinator(_gomoku, GOMOKU_TEXT, pol).run(range(8)) for _ in range(2)]
    assert [r.moves for r in runs[0]] == [r.moves for r in runs[1]]
    for game in runs[0]:
        assert game.error is None and sum(game.rewards.values()) == 0
        agents = [a for a, _ in game.moves]
        assert agents == ["black", "white"] * (len(agents) // 2) + ["black"] * (len(agents) % 2)  # AEC order
        assert game.phases == len(game.moves)  # one decision per game per phase
    assert len({tuple(g.moves) for g in runs[0]}) > 1


def test_a_broken_scripted_policy_ends_only_its_game():
    calls = []

    def breaks_once(obs, agent):  # white's 6th decision overall: game 1 in the second white phase
        calls.append(agent)
        if len(calls) == 6:
            raise RuntimeError("boom")
        return legal_actions(obs)[0]

    pol = {"black": Policy("random"), "white": Policy("scripted", fn=breaks_once)}
    results = ProtocolCoordinator(_gomoku, GOMOKU_TEXT, pol).run(range(4))
    assert [r.error is not None for r in results] == [False, True, False, False]
    assert results[1].error.kind == "policy_exception" and "boom" in results[1].error.message
    assert results[1].rewards == {"black": 0.0, "white": 0.0}
    for r in (results[0], results[2], results[3]):  # the other games played to the end
        assert sum(r.rewards.values()) == 0 and len(r.moves) > len(results[1].moves)


@pytest.fixture(scope="module")
def worker(tiny_path):
    from otray.actors.sampling.rollout import RolloutWorker

    return RolloutWorker(tiny_path, "hf", max_model_len=512, seed=0)


def test_model_policy_trajectories_masks_and_private_observations(worker, tokenizer):
    from pettingzoo.classic import tictactoe_v3

    calls = []

    def generate(prompts, params, n):
        calls.append(len(prompts))
        return worker.generate(prompts, params, n)

    pol = {"player_1": Policy("model", generate=generate, params=SamplingParams(max_tokens=8, temperature=1.0)),
           "player_2": Policy("random")}
    coord = ProtocolCoordinator(tictactoe_v3.env, TTT_TEXT, pol, tokenizer, rules=MoveRules(max_retries=0),
                                limits=Limits(max_turns=100, max_tokens_per_turn=8, max_tokens_per_episode=200,
                                              max_model_len=512))
    results = coord.run(range(6))
    assert max(calls) > 1 and len(calls) < sum(len(r.trajectories["player_1"].messages) for r in results)  # batched
    for game in results:
        assert game.error is None and set(game.trajectories) == {"player_1"}
        traj = game.trajectories["player_1"]
        # mask 1 exactly on sampled tokens: the assistant turns, as sampled
        sampled = [t for t, m in zip(traj.token_ids, traj.loss_mask) if m]
        assert len(sampled) == traj.num_sampled > 0 and len(traj.logprobs) == len(traj.token_ids)
        assert traj.reward == game.rewards["player_1"] and traj.agent_id == "player_1"
        # it only ever saw its own view (X = its marks), never player_2's: before its k-th move
        # the board shows k-1 of its marks as X
        boards = [m["content"] for m in traj.messages if m["role"] == "user" and not m["content"].startswith("Invalid")]
        before = [game.moves[: i] for i, (a, _) in enumerate(game.moves) if a == "player_1"]
        for board, history in zip(boards, before):
            grid = "\n".join(board.splitlines()[:3])
            assert grid.count("X") == sum(a == "player_1" for a, _ in history)
            assert grid.count("O") == sum(a == "player_2" for a, _ in history)
    assert all(r.counts["player_2"]["illegal"] == 0 for r in results)  # random never errs


def test_parallel_game_all_live_agents_act_in_the_same_phase(worker, tokenizer):
    from envs import rps

    calls = []

    def generate(prompts, params, n):
        calls.append(len(prompts))
        return worker.generate(prompts, params, n)

    model = Policy("model", generate=generate, params=SamplingParams(max_tokens=8, temperature=1.0))
    seen = []

    def rock(obs, agent):
        seen.append(obs)
        return 0

    # self-play seats share one policy: both agents of all 4 games answer in one call per phase
    coord = ProtocolCoordinator(rps.parallel_env, rps.TEXT, {"me": model, "rock": Policy("scripted", fn=rock)},
                                tokenizer, rules=MoveRules(max_retries=0),
                                limits=Limits(max_turns=100, max_tokens_per_turn=8, max_tokens_per_episode=100,
                                              max_model_len=512))
    results = coord.run(range(4), {"player_0": "me", "player_1": "me"})
    assert calls == [8] * 5  # 5 rounds = 5 phases, each with every agent of every game
    for game in results:
        assert game.error is None and game.phases == 5 and sum(game.rewards.values()) == 0
        assert [a for a, _ in game.moves] == ["player_0", "player_1"] * 5
        for agent in ("player_0", "player_1"):
            traj = game.trajectories[agent]
            assert traj.num_turns == 5 and traj.reward == game.rewards[agent]
    # vs a scripted player, per-game seatings: it sees only the model's last move (or none), never its own
    calls.clear()
    mixed = coord.run(range(2), [{"player_0": "me", "player_1": "rock"}, {"player_0": "rock", "player_1": "me"}])
    assert calls == [2] * 5 and [r.seating["player_1"] for r in mixed] == ["rock", "me"]
    for game in mixed:
        model_agent = next(a for a, p in game.seating.items() if p == "me")
        model_moves = [m for a, m in game.moves if a == model_agent]
        assert game.rewards[model_agent] == sum(0 if m == 0 else (1 if m == 1 else -1) for m in model_moves)
    assert set(seen) <= {0, 1, 2, 3} and seen.count(3) == 2  # 3 = "none yet", once per game


def test_turn_context_gives_one_trajectory_per_decision(worker, tokenizer):
    model = Policy("model", generate=worker.generate, params=SamplingParams(max_tokens=6, temperature=1.0))
    coord = ProtocolCoordinator(_gomoku, GOMOKU_TEXT, {"black": model, "white": Policy("random")}, tokenizer,
                                rules=MoveRules(max_retries=0), context="turn",
                                limits=Limits(max_turns=100, max_tokens_per_turn=6, max_tokens_per_episode=200,
                                              max_model_len=512))
    illegal = 0
    for game in coord.run(range(3)):
        turns = game.agent_trajectories("black")
        assert game.error is None and len(turns) == sum(a == "black" for a, _ in game.moves)
        for t in turns:  # each decision alone: one user message (the board), one reply, the game's reward
            assert [m["role"] for m in t.messages] == ["user", "assistant"] and t.reward == game.rewards["black"]
            assert sum(t.loss_mask) == t.num_sampled > 0
            # its own illegal reply (what game.illegal_penalty charges), beside the game's count
            assert t.info["illegal_replies"] in (0, 1) and t.info["illegal"] == game.counts["black"]["illegal"]
            if gomoku.parse_move(t.messages[1]["content"], 5) is None:  # an unreadable reply is always counted
                assert t.info["illegal_replies"] == 1
        assert sum(t.info["illegal_replies"] for t in turns) == game.counts["black"]["illegal"]
        illegal += game.counts["black"]["illegal"]
    assert illegal > 0  # the untrained model: some replies are unreadable, so the counts were checked
    with pytest.raises(ValueError, match="context"):
        ProtocolCoordinator(_gomoku, GOMOKU_TEXT, {}, context="chat")


def _first_empty_cell_player(tokenizer):
    """A model policy's generate function that reads the board in each prompt (through the tokenizer, as a
    model sees it) and replies with its first empty cell, except every third reply, which is unreadable."""
    import re

    from otray.types import FinishReason, GenerateResult, Sample

    calls = []

    def generate(prompts, params, n):
        out = []
        for ids in prompts:
            calls.append(1)
            rows = re.findall(r"^\s*(\d+) ([.XO](?: [.XO])*)$", tokenizer.decode(ids), re.M)
            cell = next(f"{'ABCDE'[c // 2]}{r}" for r, line in rows for c, v in enumerate(line) if v == ".")
            reply = "no idea" if len(calls) % 3 == 0 else f"<move>{cell}</move>"
            toks = tokenizer.encode(reply)
            out.append(GenerateResult([Sample(toks, [0.0] * len(toks), FinishReason.LENGTH)], 0))
        return out

    return generate


def test_move_reward_scores_each_legal_model_move_on_the_board_it_was_chosen_from(tokenizer):
    seen = []

    def stones_before(obs, agent, action):  # the shaping function: the stones on the board it chose from
        assert obs["action_mask"][action] == 1  # called before the move is played, for a legal move only
        seen.append(agent)
        return float(obs["observation"].sum())

    model = Policy("model", generate=_first_empty_cell_player(tokenizer), params=SamplingParams(max_tokens=10))
    kwargs = dict(rules=MoveRules(max_retries=0), context="turn",
                  limits=Limits(max_turns=100, max_tokens_per_turn=10, max_tokens_per_episode=200, max_model_len=512))
    policies = {"black": model, "white": Policy("scripted", fn=first_legal)}
    shaped = ProtocolCoordinator(_gomoku, GOMOKU_TEXT, policies, tokenizer, move_reward=stones_before, **kwargs)
    own = unreadable = 0
    for game in shaped.run(range(3)):
        assert game.error is None
        for t in game.agent_trajectories("black"):
            board = t.messages[0]["content"].split("You are")[0]
            if t.info["illegal_replies"]:  # the bridge's random replacement is not the policy's move: no reward
                unreadable += 1
                assert "move_reward" not in t.info
            else:
                own += 1
                assert t.info["move_reward"] == board.count("X") + board.count("O")
    assert own > unreadable > 0 and seen == ["black"] * own  # the model's own moves only, not the opponent's
    plain = ProtocolCoordinator(_gomoku, GOMOKU_TEXT, policies, tokenizer, **kwargs).run(range(1))[0]
    assert all("move_reward" not in t.info for t in plain.agent_trajectories("black"))
    for bad, says in ((lambda obs, agent, action: 1 / 0, "ZeroDivisionError"),
                      (lambda obs, agent, action: float("nan"), "finite number")):
        games = ProtocolCoordinator(_gomoku, GOMOKU_TEXT, policies, tokenizer, move_reward=bad, **kwargs).run(range(2))
        assert all(g.error.kind == "env_exception" and says in g.error.message for g in games)  # a game, not the run


def test_openings_are_random_plies_a_seed_shares_and_no_trajectory_holds(worker, tokenizer):
    model = Policy("model", generate=worker.generate, params=SamplingParams(max_tokens=6, temperature=1.0))
    coord = ProtocolCoordinator(_gomoku, GOMOKU_TEXT, {"black": model, "white": Policy("scripted", fn=gomoku.heuristic)},
                                tokenizer, rules=MoveRules(max_retries=0), context="turn",
                                limits=Limits(max_turns=100, max_tokens_per_turn=6, max_tokens_per_episode=200,
                                              max_model_len=512))
    a, b, c, fresh, done = coord.run([5, 5, 5, 6, 7], openings=[3, 3, 3, 0, 100])
    assert a.opening == b.opening == c.opening == 3 and a.moves[:4] == b.moves[:4] == c.moves[:4]
    assert [agent for agent, _ in a.moves[:4]] == ["black", "white", "black", "white"]  # 3 random, then white's own
    replay = ProtocolCoordinator(_gomoku, GOMOKU_TEXT, {"black": Policy("random"), "white": Policy("random")})
    assert replay.run([5])[0].moves[:3] == a.moves[:3]  # the random policy's moves, seeded by the game
    for game in (a, b, c):  # black decides from the 4th move on: 2 of its stones and 2 of white's on its first board
        turns = game.agent_trajectories("black")
        assert len(turns) == sum(agent == "black" for agent, _ in game.moves[3:])
        board = turns[0].messages[0]["content"].split("You are")[0]
        assert board.count("X") == 2 and board.count("O") == 2
    assert fresh.opening == 0 and "X" not in fresh.agent_trajectories("black")[0].messages[0]["content"].split("You")[0]
    assert done.error is None and done.agent_trajectories("black") == [] and done.opening == len(done.moves)
    assert sum(done.rewards.values()) == 0  # random plies to the game's end: a result, no decisions
    replayed, other = coord.run([8, 8], openings=[[m for _, m in a.moves[:5]], [0, 0]])
    assert replayed.moves[:5] == a.moves[:5] and replayed.opening == 5  # another seed's first moves, replayed
    board = replayed.agent_trajectories("black")[0].messages[0]["content"].split("You are")[0]
    assert board.count("X") == 3 and board.count("O") == 3  # black's first decision: after white's own 6th move
    assert other.error.kind == "env_exception" and "not legal" in other.error.message  # a taken cell: that game only
    with pytest.raises(ValueError, match="openings"):
        coord.run([1, 2], openings=[1])


def _play_many(make_env, policies, n):
    return ProtocolCoordinator(make_env, GameText(), policies).run(range(n))


def test_scripted_heuristics_beat_random():
    from pettingzoo.classic import tictactoe_v3

    from envs import tictactoe_text

    h = Policy("scripted", fn=tictactoe_text.heuristic)
    for seats in ({"player_1": h, "player_2": Policy("random")}, {"player_1": Policy("random"), "player_2": h}):
        me = next(a for a, p in seats.items() if p is h)
        results = _play_many(tictactoe_v3.env, seats, 100)
        wins = sum(r.rewards[me] > 0 for r in results)
        losses = sum(r.rewards[me] < 0 for r in results)
        assert wins >= 60 and losses <= 10, (me, wins, losses)
    g = Policy("scripted", fn=gomoku.heuristic)
    results = _play_many(_gomoku, {"black": g, "white": Policy("random")}, 30)
    assert sum(r.rewards["black"] > 0 for r in results) >= 27
    # it takes a win when one is there: X on A1 B1 C1 (row 1), the cell D1 wins
    env = _gomoku()
    env.reset()
    for move in ("A1", "A3", "B1", "B3", "C1", "C3"):
        env.step(gomoku.parse_move(f"<move>{move}</move>", 5))
    assert gomoku.move_name(gomoku.heuristic(env.observe("black"), "black"), 5) == "D1"


def test_heuristic_random_moves_replay_and_weaken_it():
    """OpenTinker's opponent: the heuristic with a random move 30% of the time, drawn from the rng the
    coordinator seeds per game and move, so the same seeds give the same games."""
    import functools

    noisy = Policy("scripted", fn=functools.partial(gomoku.heuristic, random_prob=0.3))
    assert noisy.takes_rng
    seats = {"black": Policy("scripted", fn=gomoku.heuristic), "white": noisy}
    runs = [ProtocolCoordinator(_gomoku, GOMOKU_TEXT, seats).run(range(20)) for _ in range(2)]
    assert [r.moves for r in runs[0]] == [r.moves for r in runs[1]]
    assert len({tuple(r.moves) for r in runs[0]}) > 5  # the random moves vary the games
    pure = ProtocolCoordinator(_gomoku, GOMOKU_TEXT, {"black": Policy("scripted", fn=gomoku.heuristic),
                                                      "white": Policy("scripted", fn=gomoku.heuristic)}).run(range(20))
    assert len({tuple(r.moves) for r in pure}) == 1  # without them every game is the same
    always = functools.partial(gomoku.heuristic, random_prob=1.0)
    vs_random = _play_many(_gomoku, {"black": Policy("scripted", fn=gomoku.heuristic),
                                     "white": Policy("scripted", fn=always)}, 30)
    assert sum(r.rewards["black"] > 0 for r in vs_random) >= 27  # random_prob=1 is the random player
    env = _gomoku()
    env.reset()
    with pytest.raises(ValueError, match="probability"):
        gomoku.heuristic(env.observe("black"), "black", random_prob=1.5)


def test_max_turns_ends_unfinished_games_as_timeouts():
    from otray.actors.job.game_source import game_rates

    pol = {"black": Policy("random"), "white": Policy("random")}
    limits = Limits(max_turns=6, max_tokens_per_turn=8, max_tokens_per_episode=64, max_model_len=512)
    results = ProtocolCoordinator(_gomoku, GOMOKU_TEXT, pol, limits=limits).run(range(10))
    assert all(len(r.moves) == 6 and r.error.kind == "timeout" and "max_turns=6" in r.error.message
               for r in results)  # four in a row needs at least seven moves
    rates = game_rates(results, "black")
    assert rates["timeout_rate"] == 1.0 and rates["win_rate"] == rates["error_rate"] == 0.0
    full = ProtocolCoordinator(_gomoku, GOMOKU_TEXT, pol).run(range(10))
    rates = game_rates(full + results[:5], "black")  # 10 finished games and 5 timeouts
    assert rates["timeout_rate"] == pytest.approx(1 / 3)
    assert sum(v for k, v in rates.items() if k.endswith("_rate")) == pytest.approx(1.0)
    assert rates["win_rate"] * 15 == sum(r.rewards["black"] > 0 for r in full)


def test_turn_budget_must_fit_a_well_formed_reply(tokenizer):
    from envs import rps, tictactoe_text
    from otray.actors.job.game_source import check_turn_budget
    from otray.types import ConfigError

    with pytest.raises(ConfigError, match=r"max_tokens_per_turn=6 .*'<move>4</move>' plus the end of turn is 8"):
        check_turn_budget(tictactoe_text.TEXT, tokenizer, 6)
    check_turn_budget(tictactoe_text.TEXT, tokenizer, 8)
    check_turn_budget(gomoku.text(size=7), tokenizer, 9)
    need = len(tokenizer.encode("<move>scissors</move>", add_special_tokens=False)) + 1
    with pytest.raises(ConfigError, match=f"at least {need}$"):
        check_turn_budget(rps.TEXT, tokenizer, need - 1)
    check_turn_budget(rps.TEXT, tokenizer, need)


def test_rotated_seatings_train_every_role_once():
    from otray.actors.job.game_source import seatings
    from otray.policies import PolicySpec

    me, rnd, roles = PolicySpec("trained", "main"), PolicySpec("random"), ["a", "b", "c"]
    rotated = seatings({"a": me, "b": rnd, "c": rnd}, roles, rotate=True)
    assert [[s[r] for r in roles] for s in rotated] == [[me, rnd, rnd], [rnd, me, rnd], [rnd, rnd, me]]
    assert len(seatings({"a": me, "b": me, "c": me}, roles, rotate=True)) == 1  # self-play: one seating
    assert seatings({"a": me, "b": rnd, "c": rnd}, roles, rotate=False) == [{"a": me, "b": rnd, "c": rnd}]


def test_a_coordinator_holding_workers_handles_imports_no_torch():
    """A game's ProtocolCoordinator holds its rollout workers' handles, and unpickling one imports the
    worker's module: that module leaves torch to the worker's own methods (seconds of CPU per game job)."""
    from tests.conftest import heavy_imports_of

    assert heavy_imports_of("otray.actors.rollout.protocol", "otray.actors.sampling.rollout") == []
