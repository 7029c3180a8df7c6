"""The harness (`envs.evaluate`) and the random and optimal agents, checked against exact
numbers."""

import json

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.envs.toy_text.frozen_lake import MAPS

import baselines
import envs

CLASSIC = MAPS["4x4"]


def success_within(map_rows, slippery, action_probs, horizon):
    """Exact probability of reaching the goal within `horizon` steps under a stationary policy
    action_probs[s, a], computed from Gymnasium's own transition table."""
    P = gym.make("FrozenLake-v1", desc=map_rows, is_slippery=slippery).unwrapped.P
    flat = "".join(map_rows)
    T = np.zeros((len(flat), len(flat)))  # [s, s'] under the policy
    for s in range(len(flat)):
        for a in range(4):
            for p, s2, _, _ in P[s][a]:
                T[s, s2] += action_probs[s, a] * p
    goal = np.array([tile == "G" for tile in flat])
    value = goal.astype(float)  # value[s] = P(goal within k steps), k = 0, 1, ...
    for _ in range(horizon):
        value = np.where(goal, 1.0, T @ value)
    return value[flat.index("S")]


def test_optimal_agent_wins_every_one_of_500_random_maps():
    result = envs.evaluate(baselines.OptimalAgent(), "frozen_lake", range(500))
    assert result["success_rate"] == 1.0 and result["episodes"] == 500
    assert result["invalid_rate"] == 0.0


def test_optimal_agent_on_classic_slippery_map_matches_value_iteration():
    best, policy = envs.frozen_lake_values(CLASSIC, slippery=True)
    max_steps = 1000
    exact = success_within(CLASSIC, True, np.eye(4)[policy.ravel()], horizon=max_steps)
    assert abs(exact - best) < 1e-6  # 1000 steps is as good as no limit
    result = envs.evaluate(baselines.OptimalAgent(), "frozen_lake", envs.heldout_seeds(2000),
                           map="classic", slippery=True, max_steps=max_steps)
    lo, hi = result["success_ci95"]
    assert lo <= best <= hi, (result["success_rate"], best)


def test_random_agent_on_classic_slippery_map_matches_policy_evaluation():
    max_steps = 100  # the step limit changes the random agent's chances: evaluate that horizon
    exact = success_within(CLASSIC, True, np.full((16, 4), 0.25), horizon=max_steps)
    result = envs.evaluate(baselines.RandomAgent(seed=0), "frozen_lake", envs.heldout_seeds(4000),
                           map="classic", slippery=True, max_steps=max_steps)
    lo, hi = result["success_ci95"]
    assert lo <= exact <= hi, (result["success_rate"], exact)
    assert result["invalid_rate"] == 0.0


class BatchedOptimal:
    """An agent with only act_batch, as a language model has; records the batch sizes."""

    def __init__(self):
        self.inner = baselines.OptimalAgent()
        self.batch_sizes = []

    def act_batch(self, observations, infos):
        self.batch_sizes.append(len(observations))
        return [self.inner.act(obs, info) for obs, info in zip(observations, infos)]


def test_batched_agent_steps_in_lockstep_and_gives_the_same_numbers():
    seeds = list(range(10))
    plain = envs.evaluate(baselines.OptimalAgent(), "frozen_lake", seeds, slippery=True)
    agent = BatchedOptimal()
    batched = envs.evaluate(agent, "frozen_lake", seeds, batch_size=4, slippery=True)
    assert plain == batched
    assert max(agent.batch_sizes) == 4
    assert sum(agent.batch_sizes) == round(
        batched["mean_steps"] * len(seeds))  # one call per live step


def test_agent_that_never_answers_is_all_invalid():
    class Mumbler:
        def act(self, obs, info):
            return "hmm"

    result = envs.evaluate(Mumbler(), "frozen_lake", range(5), map="classic")
    assert result["invalid_rate"] == 1.0 and result["success_rate"] == 0.0
    assert result["mean_return"] == pytest.approx(16 * -0.1) and result["mean_steps"] == 16


def test_evaluate_returns_plain_json_with_the_promised_keys():
    result = envs.evaluate(baselines.RandomAgent(), "snake", range(3), opponent=True)
    json.dumps(result)
    for key in ["success_rate", "success_ci95", "mean_return", "return_ci95", "invalid_rate",
                "episodes", "mean_steps", "mean_apples", "apples_ci95", "deaths", "death_rate"]:
        assert key in result
    assert result["env_options"]["opponent"] is True and result["seed_min"] == 0


def test_bfs_agent_eats_far_more_apples_than_random():
    seeds = envs.heldout_seeds(20)
    for options in ({}, {"opponent": True}):
        bfs = envs.evaluate(baselines.OptimalAgent(), "snake", seeds, **options)
        rand = envs.evaluate(baselines.RandomAgent(), "snake", seeds, **options)
        assert bfs["mean_apples"] > 10 and bfs["mean_apples"] > 10 * rand["mean_apples"]
        assert bfs["death_rate"] < rand["death_rate"]


def test_bfs_agent_avoids_poison_apples():
    seeds = envs.heldout_seeds(10)
    result = envs.evaluate(baselines.OptimalAgent(), "snake_poison_apple", seeds, bananas=3)
    assert result["mean_apples"] < 1 and result["mean_return"] > 10


def test_bfs_avoids_poison_apples_and_eats_bananas():
    env = envs.make("snake_poison_apple", apples=0, bananas=1)
    env.reset(seed=0)
    env.snake, env.direction = [(5, 5), (5, 4), (5, 3)], envs.SNAKE_ACTIONS.index("right")
    env.apples, env.bananas = [(5, 6)], [(3, 5)]
    assert env.actions[baselines.snake_bfs_action(env.info(False))] == "up"


def test_wilson_interval_and_heldout_seeds():
    lo, hi = envs.wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(1.96**2 / (10 + 1.96**2))  # 0.2775
    lo, hi = envs.wilson_interval(5, 10)
    assert lo == pytest.approx(1 - hi) and lo < 0.5 < hi
    assert envs.wilson_interval(0, 0) == (0.0, 1.0)
    assert envs.heldout_seeds(3) == [1_000_000, 1_000_001, 1_000_002]


def test_cli_prints_a_table(capsys):
    baselines.main(["--env", "frozen_lake", "--agent", "optimal", "--episodes", "20"])
    out = capsys.readouterr().out
    assert "success [95% CI]" in out and "optimal" in out and "1.000" in out
    assert "held-out seeds 1000000..1000019" in out


@pytest.mark.parametrize("argv", [["--env", "snake", "--slippery"], ["--env", "lake"],
                                  ["--episodes", "0"], ["--agent", "genius"]])
def test_cli_rejects_bad_options(argv, capsys):
    with pytest.raises(SystemExit):
        baselines.main(argv)
    assert "error" in capsys.readouterr().err


def snake_state(snake, direction, apples=(), size=6):
    """Snake's symbolic state (info) for a board set up by hand."""
    return {"snake": list(snake), "direction": direction, "apples": list(apples), "bananas": [],
            "opponent": None, "size": size}


def test_snake_rules_on_hand_made_boards():
    import random
    rng = random.Random(0)
    up, right, down, left = range(4)
    # Head in the top right corner heading up: up and right are walls, down the neck; only left
    # lives.
    corner = snake_state([(0, 5), (1, 5), (2, 5)], "up")
    assert baselines.snake_safe_moves(corner) == [left]
    for rule in baselines.SNAKE_RULES.values():
        if rule is not baselines.circling_move:  # it reads only the heading
            assert rule(corner, rng) == left
    middle = snake_state([(3, 3), (3, 2), (3, 1)], "right", apples=[(1, 3)])
    assert baselines.straight_unless_deadly_move(middle, rng) == right
    assert baselines.apple_greedy_move(middle, rng) == up  # the only safe move toward (1, 3)
    assert baselines.circling_move(middle, rng) == down  # clockwise from right
    assert {baselines.never_die_move(middle, rng) for _ in range(50)} == {up, right, down}


@pytest.mark.parametrize("rule", ["never_die", "straight_unless_deadly", "apple_greedy"])
def test_snake_rules_that_check_their_move_never_die_on_a_board_with_room(rule):
    result = envs.evaluate(baselines.SnakeRuleAgent(rule), "snake", range(100), size=6, max_steps=5)
    assert result["invalid_rate"] == 0.0 and result["deaths"] == 0
    greedy = envs.evaluate(baselines.SnakeRuleAgent("apple_greedy"), "snake", range(100), size=6,
                           max_steps=5)
    assert greedy["mean_apples"] >= result["mean_apples"]  # reading the apple's offset pays


def refuse_to_play(*args, **kwargs):
    raise AssertionError("the evaluation started")


def test_episodes_beyond_the_cap_are_refused_before_any_seed_is_drawn(monkeypatch, capsys):
    """A billion episodes is a list of a billion seeds before the first game."""
    monkeypatch.setattr(baselines.envs, "heldout_seeds", refuse_to_play)
    with pytest.raises(SystemExit):
        baselines.main(["--agent", "random", "--episodes", "1000000000"])
    assert "error: --episodes must be from 1 to 100000" in capsys.readouterr().err


def test_json_into_a_missing_folder_makes_the_folder_and_keeps_the_result(tmp_path):
    path = tmp_path / "new" / "deeper" / "result.json"
    result = baselines.main(["--agent", "optimal", "--episodes", "2", "--json", str(path)])
    assert json.loads(path.read_text()) == result


@pytest.mark.parametrize("where", ["a folder", "under a file"])
def test_json_that_cannot_be_written_is_refused_before_the_evaluation(tmp_path, monkeypatch,
                                                                       where):
    (tmp_path / "file").write_text("kept")
    path = tmp_path if where == "a folder" else tmp_path / "file" / "result.json"
    monkeypatch.setattr(baselines.envs, "evaluate", refuse_to_play)
    with pytest.raises(SystemExit) as stop:
        baselines.main(["--agent", "optimal", "--episodes", "2", "--json", str(path)])
    message = str(stop.value.code)
    assert "--json" in message and str(path) in message and "\n" not in message
    assert (tmp_path / "file").read_text() == "kept"
