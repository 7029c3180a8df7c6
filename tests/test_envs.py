"""The games: Frozen Lake against Gymnasium itself, Snake's rules, the invalid-action rule,
errors."""

import hashlib
import re
import warnings
from collections import Counter, defaultdict

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.envs.toy_text.frozen_lake import MAPS, generate_random_map
from gymnasium.utils.env_checker import check_env

import envs

CLASSIC = MAPS["4x4"]
RANDOM_MAPS = [generate_random_map(size=size, p=0.8, seed=seed)
               for size in (4, 5, 8) for seed in range(8)]


# ---------------------------------------------------------------------------------------------
# Frozen Lake against Gymnasium's FrozenLake-v1
# ---------------------------------------------------------------------------------------------


def gym_transition_table(map_rows, slippery):
    """Gymnasium's own P[s][a] = [(prob, next_state, reward, terminated)]."""
    return gym.make("FrozenLake-v1", desc=map_rows, is_slippery=slippery).unwrapped.P


def summed(outcomes):
    """Gymnasium lists an outcome twice when two slip directions land on the same cell."""
    total = defaultdict(float)
    for prob, state in outcomes:
        total[state] += prob
    return dict(total)


@pytest.mark.parametrize("slippery", [False, True])
@pytest.mark.parametrize("map_rows", [CLASSIC, MAPS["8x8"]] + RANDOM_MAPS)
def test_frozen_lake_transitions_equal_gymnasium(map_rows, slippery):
    ncol = len(map_rows[0])
    P = gym_transition_table(map_rows, slippery)
    for state, by_action in P.items():
        row, col = divmod(state, ncol)
        for action, gym_outcomes in by_action.items():
            ours = envs.frozen_lake_transitions(map_rows, (row, col), action, slippery)
            ours = summed([(prob, r * ncol + c) for prob, (r, c) in ours])
            theirs = summed([(prob, next_state) for prob, next_state, _, _ in gym_outcomes])
            assert ours.keys() == theirs.keys()
            assert all(abs(ours[s] - theirs[s]) < 1e-12 for s in ours)
            if map_rows[row][col] in "HG":
                continue  # absorbing; our episode has ended before such a step
            for _, next_state, reward, terminated in gym_outcomes:
                tile = map_rows[next_state // ncol][next_state % ncol]
                assert reward == (1.0 if tile == "G" else 0.0)
                assert terminated == (tile in "HG")


@pytest.mark.parametrize("map_rows", [CLASSIC] + RANDOM_MAPS[:4])
def test_frozen_lake_step_follows_gymnasium_table(map_rows):
    """The env's sampled moves land only where Gymnasium's P allows, with its frequencies,
    rewards and termination flags."""
    ncol = len(map_rows[0])
    P = gym_transition_table(map_rows, slippery=True)
    env = envs.make("frozen_lake", map=map_rows, slippery=True, max_steps=50)
    rng = np.random.default_rng(0)
    counts = defaultdict(Counter)
    for seed in range(600):
        _, info = env.reset(seed=seed)
        done = False
        while not done:
            state = info["position"][0] * ncol + info["position"][1]
            action = int(rng.integers(4))
            _, reward, terminated, truncated, info = env.step(action)
            next_state = info["position"][0] * ncol + info["position"][1]
            allowed = {s: (r, t) for _, s, r, t in P[state][action]}
            assert next_state in allowed
            assert (reward, terminated) == allowed[next_state]
            counts[state, action][next_state] += 1
            done = terminated or truncated
    for (state, action), seen in counts.items():
        n = sum(seen.values())
        expected = summed([(p, s) for p, s, _, _ in P[state][action]])
        for next_state, prob in expected.items():
            assert abs(seen[next_state] / n - prob) < 5 * np.sqrt(prob * (1 - prob) / n) + 1e-9


def gym_optimal_success(map_rows, slippery):
    """An independent value iteration, written from Gymnasium's own P with plain loops."""
    P = gym_transition_table(map_rows, slippery)
    flat = "".join(map_rows)
    value = [1.0 if tile == "G" else 0.0 for tile in flat]
    for _ in range(100_000):
        new = [value[s] if flat[s] in "GH" else
               max(sum(p * value[s2] for p, s2, _, _ in P[s][a]) for a in range(4))
               for s in range(len(flat))]
        change = max(abs(a - b) for a, b in zip(new, value))
        value = new
        if change < 1e-14:
            break
    return value[flat.index("S")]


def test_optimal_success_probability_of_classic_slippery_map_matches_gymnasium_table():
    ours, _ = envs.frozen_lake_values(CLASSIC, slippery=True)
    theirs = gym_optimal_success(CLASSIC, slippery=True)
    assert abs(ours - theirs) < 1e-6
    assert abs(ours - 14 / 17) < 1e-6  # 0.8235...: both computations land on 14/17


@pytest.mark.parametrize("map_rows", [MAPS["8x8"]] + RANDOM_MAPS[::5])
def test_optimal_success_probability_matches_gymnasium_table_on_other_maps(map_rows):
    for slippery in (False, True):
        ours, _ = envs.frozen_lake_values(map_rows, slippery)
        assert abs(ours - gym_optimal_success(map_rows, slippery)) < 1e-6


def policy_success(map_rows, slippery, policy, horizon=5000):
    """Exact probability that a fixed policy reaches the goal within `horizon` steps."""
    flat = "".join(map_rows)
    goal = np.array([tile == "G" for tile in flat], float)
    T = envs.frozen_lake_transition_tensor(map_rows, slippery)
    T_policy = T[np.arange(len(flat)), policy.ravel()]  # [s, s'] under the policy
    value = goal.copy()
    for _ in range(horizon):
        value = np.where(goal == 1, 1.0, T_policy @ value)
    return value[flat.index("S")]


@pytest.mark.parametrize("map_rows", [CLASSIC, MAPS["8x8"]] + RANDOM_MAPS[::3])
@pytest.mark.parametrize("slippery", [False, True])
def test_value_iteration_policy_achieves_the_optimal_success_probability(map_rows, slippery):
    """Guards the tie-break: with no discount, bumping into a wall for ever also 'keeps V'."""
    best, policy = envs.frozen_lake_values(map_rows, slippery)
    achieved = policy_success(map_rows, slippery, policy)
    assert abs(achieved - best) < 1e-6


def test_value_iteration_on_unsolvable_and_solvable_maps():
    assert envs.frozen_lake_values(["SH", "HG"], slippery=False)[0] == 0.0
    for map_rows in RANDOM_MAPS:  # Gymnasium's generator guarantees a path
        assert abs(envs.frozen_lake_values(map_rows, slippery=False)[0] - 1.0) < 1e-9


# ---------------------------------------------------------------------------------------------
# Frozen Lake as a text game
# ---------------------------------------------------------------------------------------------


def test_random_maps_come_from_gymnasium_generator_and_follow_the_seed():
    env = envs.make("frozen_lake", size=5)
    _, info = env.reset(seed=123)
    assert info["map"] == generate_random_map(size=5, p=0.8, seed=123)
    assert env.reset(seed=123)[0] == env.reset(seed=123)[0]
    assert len({tuple(env.reset(seed=seed)[1]["map"]) for seed in range(20)}) > 10


def test_classic_map_and_given_map():
    assert envs.make("frozen_lake", map="classic").reset(seed=5)[1]["map"] == CLASSIC
    _, info = envs.make("frozen_lake", map=["FFS", "HFG"]).reset()
    assert info["position"] == (0, 2)


def test_exploring_starts_put_you_on_ice_or_beside_a_hole_chosen_by_the_seed():
    plain = envs.make("frozen_lake", map="classic")
    anywhere, beside = (envs.make("frozen_lake", map="classic", start=start)
                        for start in ("ice", "beside_hole"))
    assert plain.reset(seed=3)[1]["position"] == (0, 0)  # the default: Gymnasium's start, S
    starts = [anywhere.reset(seed=seed)[1]["position"] for seed in range(200)]
    assert len(set(starts)) == sum(tile in "SF"
                                   for row in CLASSIC for tile in row)  # every ice cell, in time
    assert starts == [anywhere.reset(seed=seed)[1]["position"]
                      for seed in range(200)]  # the seed decides
    # SFFF / FHFH / FFFH / HFFG: the ice cells with a hole one move away, worked out by hand
    assert {beside.reset(seed=seed)[1]["position"] for seed in range(200)} == {
        (0, 1), (0, 3), (1, 0), (1, 2), (2, 0), (2, 1), (2, 2), (3, 1)}
    holeless = envs.make("frozen_lake", map=["SF", "FG"], start="beside_hole")
    assert {holeless.reset(seed=seed)[1]["position"] for seed in range(50)} == {
        (0, 0), (0, 1), (1, 0)}
    obs, _ = anywhere.reset(seed=1)
    row, col = anywhere.position
    # the text is written from where you start
    assert f"Goal: {envs.offset_text(3 - row, 3 - col)}." in obs
    with pytest.raises(ValueError, match="start must be one of S, ice, beside_hole, "
                                         "hole_toward_goal, rule_loses"):
        envs.make("frozen_lake", start="corner")
    assert envs.option_from_text("frozen_lake", "start", " beside_hole ") == "beside_hole"


def test_starts_with_a_hole_toward_the_goal_test_only_the_moves_that_near_it():
    # SFFF / FHFH / FFFH / HFFG, goal at (3, 3): down and right near it wherever they move you.
    # (0, 1): down is the hole (1, 1). (2, 1) and (3, 1) are beside a hole too, but it lies up or
    # left, behind them.
    toward = envs.make("frozen_lake", map="classic", start="hole_toward_goal")
    assert {toward.reset(seed=seed)[1]["position"] for seed in range(200)} == {
        (0, 1), (0, 3), (1, 0), (1, 2), (2, 0), (2, 2)}
    assert toward.moves_toward_goal((3, 1)) == [
        envs.FROZEN_LAKE_ACTIONS.index("right")]  # down: the edge
    upside_down = envs.make("frozen_lake", map=["GFH", "FFS"],
                            start="hole_toward_goal")  # the goal top left
    assert {upside_down.reset(seed=seed)[1]["position"]
            for seed in range(50)} == {(1, 2)}  # up walks into H
    assert upside_down.moves_toward_goal((1, 1)) == [envs.FROZEN_LAKE_ACTIONS.index(m)
                                                     for m in ("left", "up")]
    holeless = envs.make("frozen_lake", map=["SF", "FG"], start="hole_toward_goal")
    assert {holeless.reset(seed=seed)[1]["position"] for seed in range(50)} == {
        (0, 0), (0, 1), (1, 0)}


def test_starts_where_the_neighbour_rule_loses_are_those_only_a_detour_wins():
    # SFF / FFF / FHG: "down, else right" walks down the left column and then right into the hole
    # from (0, 0), (1, 0) and (2, 0); from the other cells it reaches G. The goal is 4 moves from
    # (0, 0) and (2, 0), 3 from (1, 0), so with a budget of 3 moves only (1, 0) is a start where a
    # detour still wins.
    pocket = ["SFF", "FFF", "FHG"]
    assert envs.goal_distances(pocket) == {(2, 2): 0, (1, 2): 1, (0, 2): 2, (1, 1): 2, (0, 1): 3,
                                           (1, 0): 3, (0, 0): 4, (2, 0): 4}
    assert [envs.rule_walk_wins(pocket, cell, 16)
            for cell in ((0, 0), (1, 0), (2, 0), (0, 1), (1, 1))] == [
        False, False, False, True, True]
    assert not envs.rule_walk_wins(pocket, (0, 1), 2)  # three moves needed
    loses = envs.make("frozen_lake", map=pocket, start="rule_loses")
    assert {loses.reset(seed=seed)[1]["position"] for seed in range(50)} == {(0, 0), (1, 0), (2, 0)}
    short = envs.make("frozen_lake", map=pocket, start="rule_loses", max_steps=3)
    assert {short.reset(seed=seed)[1]["position"] for seed in range(20)} == {(1, 0)}
    easy = ["SFF", "FHF", "FFG"]  # the rule wins from each of the 7 ice cells
    assert all(envs.rule_walk_wins(easy, cell, 16) for cell in envs.cells_with(easy, "F"))
    everywhere = envs.make("frozen_lake", map=easy,
                           start="rule_loses")  # no such cell: any ice cell
    assert len({everywhere.reset(seed=seed)[1]["position"] for seed in range(100)}) == 7


def test_frozen_lake_goal_hole_and_info():
    env = envs.make("frozen_lake", map=["SG"])
    obs, info = env.reset(seed=0)
    assert info == {"position": (0, 0), "map": ["SG"], "slippery": False, "success": False,
                    "invalid": False, "steps": 0}
    _, reward, terminated, truncated, info = env.step(env.actions.index("right"))
    assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)
    env = envs.make("frozen_lake", map=["SHG"])
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step(env.actions.index("right"))
    assert (reward, terminated, info["success"], info["position"]) == (0.0, True, False, (0, 1))


def test_frozen_lake_observation_text():
    env = envs.make("frozen_lake", map="classic")
    obs, _ = env.reset(seed=0)
    assert env.rules in obs
    assert "Actions: left, down, right, up." in obs
    assert "Goal: 3 down, 3 right." in obs
    assert obs.endswith("Steps left: 16.\n"  # last: next to the reply
                        "Next to you: left edge, down ice, right ice, up edge.")
    assert "P F F F\nF H F H\nF F F H\nH F F G" in obs
    assert "P = you" in obs and "hole H" in obs and "goal G" in obs
    assert "<action>" not in obs  # the response format is the agent's business
    assert "slippery" not in obs
    assert "slippery" in envs.make("frozen_lake", slippery=True).rules
    assert env.actions == ["left", "down", "right", "up"]
    obs, *_ = env.step(env.actions.index("down"))  # to (1, 0): a hole to the right
    assert "Next to you: left edge, down ice, right hole, up ice." in obs
    assert envs.offset_text(-2, 0) == "2 up" and envs.offset_text(0, 0) == "here"


def test_a_hole_costs_hole_penalty_and_nothing_by_default():
    for options, expected in (({}, 0.0), ({"hole_penalty": -1}, -1.0)):
        env = envs.make("frozen_lake", map="classic",
                        **options)  # SFFF / FHFH: down, then right is a hole
        env.reset(seed=0)
        env.step(env.actions.index("down"))
        _, reward, terminated, _, info = env.step(env.actions.index("right"))
        assert (reward, terminated, info["position"]) == (expected, True, (1, 1))


def test_frozen_lake_invalid_action_stays_put_with_penalty():
    env = envs.make("frozen_lake", map="classic", invalid_penalty=-0.5)
    env.reset(seed=0)
    _, reward, terminated, truncated, info = env.step(None)
    assert info["position"] == (0, 0)
    assert ((reward, terminated, truncated, info["invalid"], info["steps"])
            == (-0.5, False, False, True, 1))
    _, reward, _, _, info = env.step(env.actions.index("right"))
    assert (reward, info["invalid"], info["position"]) == (0.0, False, (0, 1))
    env = envs.make("frozen_lake")
    env.reset(seed=0)
    assert env.step(None)[1] == pytest.approx(-0.1)  # the default penalty


def test_frozen_lake_truncates_at_max_steps():
    env = envs.make("frozen_lake", map="classic", max_steps=3)
    env.reset(seed=0)
    results = [env.step(env.actions.index("left")) for _ in range(3)]
    assert [r[3] for r in results] == [False, False, True]
    assert not any(r[2] for r in results)
    assert envs.make("frozen_lake").max_steps == 16
    assert envs.make("snake").max_steps == 100


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_unknown_env_lists_valid_envs():
    with pytest.raises(ValueError) as error:
        envs.make("frozen_pond")
    for name in envs.ENV_NAMES:
        assert name in str(error.value)
    assert envs.ENV_NAMES == ("frozen_lake", "snake", "snake_poison_apple")


@pytest.mark.parametrize("name, bad_option, valid_option", [
    ("frozen_lake", "slipery", "slippery"), ("snake", "bananas", "apples"),
    ("snake_poison_apple", "slippery", "bananas")])
def test_unknown_option_lists_valid_options(name, bad_option, valid_option):
    with pytest.raises(ValueError) as error:
        envs.make(name, **{bad_option: True})
    assert bad_option in str(error.value) and valid_option in str(error.value)


@pytest.mark.parametrize("bad", [dict(size=0), dict(max_steps=0), dict(map="huge"),
                                 dict(map=["SF", "FFF"]), dict(map=["FF", "FG"]),
                                 dict(map=["SX", "FG"])])
def test_bad_option_values_raise(bad):
    with pytest.raises(ValueError):
        envs.make("frozen_lake", **bad)


@pytest.mark.parametrize("name", envs.ENV_NAMES)
def test_bad_actions_and_finished_episodes_raise(name):
    env = envs.make(name, max_steps=1)
    with pytest.raises(RuntimeError):
        env.step(0)  # before reset
    env.reset(seed=0)
    for bad in (-1, 4, 10, "left", 1.0):
        with pytest.raises(ValueError):
            env.step(bad)
    *_, terminated, truncated, _ = env.step(env.actions.index("up"))
    assert terminated or truncated
    with pytest.raises(RuntimeError):
        env.step(0)
    env.reset(seed=1)
    env.step(np.int64(0))  # numpy ints are fine


# ---------------------------------------------------------------------------------------------
# Snake
# ---------------------------------------------------------------------------------------------

UP, RIGHT, DOWN, LEFT = (envs.SNAKE_ACTIONS.index(a) for a in ("up", "right", "down", "left"))


def snake_env(name="snake", **options):
    """A snake heading right with its head at (5, 5) and no fruit, to set up scenes by hand."""
    env = envs.make(name, **{"apples": 0, **options})
    env.reset(seed=0)
    env.snake = [(5, 5), (5, 4), (5, 3)]
    env.direction = RIGHT
    return env


def test_snake_apple_makes_it_grow_and_respawns():
    env = snake_env(apples=1)
    env.apples = [(5, 6)]
    _, reward, terminated, _, info = env.step(RIGHT)
    assert (reward, terminated, info["apples_eaten"]) == (1.0, False, 1)
    assert info["snake"] == [(5, 6), (5, 5), (5, 4), (5, 3)]
    assert len(info["apples"]) == 1 and info["apples"][0] not in info["snake"]
    _, reward, _, _, info = env.step(RIGHT)  # no apple: same length, tail follows
    assert reward == 0.0 and info["snake"] == [(5, 7), (5, 6), (5, 5), (5, 4)]


def test_snake_dies_on_wall():
    env = snake_env()
    for _ in range(4):  # (5,6) .. (5,9) are on the 10x10 board
        assert env.step(RIGHT)[2] is False
    _, reward, terminated, _, info = env.step(RIGHT)
    assert (reward, terminated, info["died"], info["success"]) == (-1.0, True, True, False)


def test_snake_dies_on_own_body_but_may_follow_its_tail():
    env = snake_env()
    env.snake = [(5, 5), (5, 4), (6, 4), (6, 5), (6, 6)]  # moving down hits (6,5), not the tail
    _, reward, terminated, _, info = env.step(DOWN)
    assert (reward, terminated, info["died"]) == (-1.0, True, True)
    env = snake_env()
    env.snake = [(5, 5), (5, 4), (6, 4), (6, 5)]  # (6,5) is the tail: it moves away this step
    _, _, terminated, _, info = env.step(DOWN)
    assert not terminated and info["snake"] == [(6, 5), (5, 5), (5, 4), (6, 4)]


def test_snake_dies_on_the_opponent():
    env = snake_env(opponent=True)
    env.opponent = [(5, 6), (4, 6), (3, 6)]
    _, reward, terminated, _, info = env.step(RIGHT)
    assert (reward, terminated, info["died"]) == (-1.0, True, True)


def test_snake_invalid_and_reversal_keep_going_with_penalty():
    env = snake_env()
    _, reward, _, _, info = env.step(None)
    assert info["invalid"] and reward == pytest.approx(-0.1) and info["snake"][0] == (5, 6)
    _, reward, _, _, info = env.step(LEFT)  # straight back into the neck: illegal
    assert info["invalid"] and reward == pytest.approx(-0.1) and info["snake"][0] == (5, 7)
    assert env.parse_action("<action>left</action>") == LEFT  # the parser still reads it
    _, reward, _, _, info = env.step(UP)
    assert not info["invalid"] and reward == 0.0 and info["direction"] == "up"


def test_poison_apples_cost_one_and_bananas_pay_one():
    env = snake_env("snake_poison_apple", bananas=1)
    env.apples, env.bananas = [(5, 6)], [(5, 7)]
    assert env.step(RIGHT)[1] == -1.0
    _, reward, _, _, info = env.step(RIGHT)
    assert reward == 1.0 and info["bananas_eaten"] == 1 and len(info["snake"]) == 5
    assert "poison" in env.rules and "banana" in env.rules.lower()
    assert "poison" not in envs.make("snake").rules


def test_step_reward_is_added_every_step():
    env = snake_env(step_reward=-0.01)
    assert env.step(RIGHT)[1] == pytest.approx(-0.01)


def play_random(env, seed, check=None):
    rng = np.random.default_rng(seed)
    obs, info = env.reset(seed=seed)
    trace = [obs]
    done = False
    while not done:
        obs, reward, terminated, truncated, info = env.step(int(rng.integers(4)))
        trace.append((obs, reward))
        if check:
            check(env, info)
        done = terminated or truncated
    return trace


def test_snake_cells_never_overlap_in_random_play():
    def check(env, info):
        own, other = info["snake"], info["opponent"] or []
        fruit = info["apples"] + info["bananas"]
        assert len(set(own)) == len(own) and len(set(other)) == len(other)
        assert not set(own) & set(other)
        assert len(set(fruit)) == len(fruit) and not set(fruit) & (set(own) | set(other))
        assert all(envs.on_board(cell, info["size"]) for cell in own + other + fruit)
        assert len(info["apples"]) == 5 and len(info["bananas"]) == 2

    for seed in range(40):
        play_random(envs.make("snake_poison_apple", opponent=True, bananas=2, size=6), seed, check)


def test_opponent_moves():
    env = envs.make("snake", opponent=True)
    _, info = env.reset(seed=3)
    start = info["opponent"]
    _, _, _, _, info = env.step(None)
    assert info["opponent"] != start


def test_same_seed_same_game():
    for name in envs.ENV_NAMES:
        options = {} if name == "frozen_lake" else {"opponent": True}
        assert (play_random(envs.make(name, **options), 7)
                == play_random(envs.make(name, **options), 7))
    snake = envs.make("snake")
    assert snake.reset(seed=1)[1]["apples"] != snake.reset(seed=2)[1]["apples"]


def test_snake_observation_text():
    env = envs.make("snake_poison_apple", opponent=True, bananas=1)
    obs, info = env.reset(seed=0)
    assert "Actions: up, right, down, left." in obs
    assert "You are moving right; your snake is 3 cells long." in obs
    head = info["snake"][0]
    nearest = min(info["apples"], key=lambda c: abs(c[0] - head[0]) + abs(c[1] - head[1]))
    assert f"Nearest apple: {envs.offset_text(nearest[0] - head[0], nearest[1] - head[1])}." in obs
    assert "Nearest banana: " in obs
    assert "H = your head" in obs and "X = other snake" in obs
    rows = obs.split("= empty):\n")[1].split("\n")[:10]
    assert rows[7].split()[3:6] == ["S", "S", "H"]
    assert obs.splitlines()[-1].startswith("Next to your head: up ")  # last, right before the reply
    assert "<action>" not in obs


def neighbour_line(env):
    return env.observation().splitlines()[-1]


def test_snake_neighbour_line_names_walls_neck_body_and_tail():
    env = snake_env(size=6)
    env.snake = [(0, 5), (1, 5), (2, 5)]  # the top right corner, heading up
    env.direction = UP
    assert neighbour_line(env) == ("Next to your head: up wall, right wall, "
                                   "down your neck (not allowed), left empty.")
    env.snake = [(2, 2), (2, 3), (3, 3), (3, 2), (3, 1), (2, 1)]  # coiled: left is the tail
    env.direction = LEFT
    assert neighbour_line(env) == ("Next to your head: up empty, right your neck (not allowed), "
                                   "down your body, left your tail.")


def test_snake_neighbour_line_names_fruit_and_the_other_snake():
    env = snake_env("snake_poison_apple", bananas=1, opponent=True)
    env.apples, env.bananas, env.opponent = [(4, 5)], [(6, 5)], [(5, 6), (4, 6), (3, 6)]
    assert neighbour_line(env) == ("Next to your head: up apple, right other snake, down banana, "
                                   "left your neck (not allowed).")


def test_snake_neighbour_line_agrees_with_what_the_move_does():
    """"wall", "your body" and "other snake" are exactly the moves that end the game."""
    env = envs.make("snake", size=5, opponent=True)
    for seed in range(30):
        env.reset(seed=seed)
        for _ in range(8):
            names, info = env.neighbours(), env.info(False)
            for move, name in enumerate(names):
                if name.startswith("your neck"):
                    continue
                cell = envs.next_cell(env.snake[0], move)
                deadly = envs.snake_dies(cell, env.snake, cell in env.apples, env.size,
                                         set(env.opponent or []))
                assert deadly == (name in ("wall", "your body", "other snake")), (seed, names)
            legal = [m for m, n in enumerate(names) if n not in ("wall", "your body", "other snake")
                     and not n.startswith("your neck")]
            if not legal:
                break
            if env.step(legal[seed % len(legal)])[2]:
                break


def test_snake_training_start_faces_the_wall_and_the_seed_chooses_it():
    standard = envs.make("snake", size=6)
    assert standard.reset(seed=5)[1]["snake"] == [(4, 3), (4, 2), (4, 1)]  # where evaluation starts
    facing = envs.make("snake", size=6, start="facing_wall")
    starts = []
    for seed in range(100):
        info = facing.reset(seed=seed)[1]
        assert facing.reset(seed=seed)[1]["snake"] == info["snake"]  # the same seed, the same start
        head, heading = info["snake"][0], envs.SNAKE_ACTIONS.index(info["direction"])
        assert not envs.on_board(envs.next_cell(head, heading), 6)  # straight on is the wall
        assert len(info["snake"]) == 3 and all(envs.on_board(cell, 6) for cell in info["snake"])
        starts.append((tuple(info["snake"]), heading))
    assert len(set(starts)) > 20  # different seeds, different starts
    with pytest.raises(ValueError, match="start must be one of standard, facing_wall"):
        envs.make("snake", start="corner")


# ---------------------------------------------------------------------------------------------
# Snake with varied rules: the rules text says which fruit is worth what
# ---------------------------------------------------------------------------------------------

STATED_WORTH = re.compile(r"Eating an? (\w+) gives ([+-]1) ")


def stated_worths(rules):
    """((fruit, worth), ...) as the rules text states them, in its order."""
    return tuple((fruit, float(worth)) for fruit, worth in STATED_WORTH.findall(rules))


def varied_rules_of(env, seed):
    _, info = env.reset(seed=seed)
    return env.rules, stated_worths(env.rules), info


def test_varied_rules_never_draw_poison_apples_held_out_combination_and_draw_every_other():
    """Snake Poison Apple (apples -1 with bananas +1) is held out: a game never trained on, to test
    whether an agent reads the rules. Its combination must never be drawn, in any wording or order,
    and every other combination of one fruit worth +1 or -1 and a second the opposite or absent
    must be, so that only the rules text tells which fruit to eat."""
    fruits = ("apple", "banana", "cherry")
    every = set()
    for first in fruits:
        for worth in (1.0, -1.0):
            every.add(((first, worth),))
            every |= {((first, worth), (second, -worth)) for second in fruits if second != first}
    held_out = {("apple", -1.0), ("banana", 1.0)}
    allowed = {draw for draw in every if not held_out <= set(draw)}
    assert len(every) == 18 and len(allowed) == 16
    poison_apple = envs.make("snake_poison_apple", size=6, bananas=2)
    env = envs.make("snake", size=6, varied_rules=True, start="facing_wall")  # as in training
    drawn = Counter()
    for seed in range(5000):
        rules, worths, info = varied_rules_of(env, seed)
        assert worths in allowed and not held_out <= set(worths), (seed, rules)
        assert rules != poison_apple.rules and "poison" not in rules.lower()
        assert envs.SnakePoisonApple.fruit_rules not in rules
        # The game pays what its rules state.
        assert (info["fruit_names"][0], info["apple_reward"]) == worths[0]
        if len(worths) == 2:
            assert (info["fruit_names"][1], info["banana_reward"]) == worths[1]
        assert len(info["bananas"]) == (len(worths) - 1) * len(info["apples"])
        drawn[worths] += 1
    assert set(drawn) == allowed
    assert min(drawn.values()) > 5000 / 16 / 2  # each about as often as the others
    assert set(envs.VARIED_WORTHS) == allowed


def test_varied_rules_follow_the_seed_so_a_group_shares_them():
    first, second = (envs.make("snake", size=6, varied_rules=True) for _ in range(2))
    for seed in range(30):
        rules, worths, info = varied_rules_of(first, seed)
        again_rules, again_worths, again_info = varied_rules_of(second, seed)
        assert (rules, worths, info) == (again_rules, again_worths, again_info)
        assert play_random(first, seed) == play_random(second, seed)
    assert len({varied_rules_of(first, seed)[0] for seed in range(30)}) > 5  # seeds differ
    assert len({varied_rules_of(first, seed)[1] for seed in range(30)}) > 5


def seed_drawing(worths):
    env = envs.make("snake", varied_rules=True, apples=1)
    return next(seed for seed in range(10_000) if varied_rules_of(env, seed)[1] == worths)


@pytest.mark.parametrize("worths", envs.VARIED_WORTHS)
def test_eating_a_fruit_pays_what_the_rules_state_it_is_worth(worths):
    env = envs.make("snake", varied_rules=True, apples=1)
    env.reset(seed=seed_drawing(worths))
    env.snake, env.direction = [(5, 5), (5, 4), (5, 3)], RIGHT
    (first, first_worth), *second = worths
    env.apples, env.bananas = [(5, 6)], [(5, 7)] if second else []
    assert f"right {first}," in neighbour_line(env)
    symbol = first[0].upper()
    observation = env.observation()
    assert f"{symbol} = {first}" in observation and f"\n. . . S S H {symbol}" in observation
    _, reward, terminated, _, info = env.step(RIGHT)
    assert (reward, terminated, len(info["snake"])) == (first_worth, False, 4)
    if second:
        [(fruit, worth)] = second
        assert f"right {fruit}," in neighbour_line(env)
        assert f"Nearest {fruit}: " in env.observation()
        _, reward, _, _, info = env.step(RIGHT)
        assert (reward, info["bananas_eaten"], len(info["snake"])) == (worth, 1, 5)


def test_varied_rules_observations_fit_the_space_and_pass_gymnasiums_checker():
    env = envs.make("snake", size=5, varied_rules=True, opponent=True, max_steps=30)
    for seed in range(60):
        for observation in play_random(env, seed):
            text = observation if isinstance(observation, str) else observation[0]
            assert text in env.observation_space, text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(gym.make(envs.GYMNASIUM_IDS["snake"], varied_rules=True).unwrapped)


def test_varied_rules_is_a_snake_option_checked_when_the_game_is_made():
    with pytest.raises(ValueError, match="option apples must be at most 11 with varied_rules"):
        envs.make("snake", size=5, apples=12, varied_rules=True)
    with pytest.raises(ValueError, match="varied_rules must be true or false"):
        envs.make("snake", varied_rules="yes")
    with pytest.raises(ValueError, match="unknown option"):  # Poison Apple's rules never vary
        envs.make("snake_poison_apple", varied_rules=True)
    assert not envs.make("snake").varied_rules


# ---------------------------------------------------------------------------------------------
# Standard Snake and Snake Poison Apple play exactly as they did before varied rules existed
# ---------------------------------------------------------------------------------------------


def play_greedy(env, seed):
    """Heads for the nearest fruit of either kind, so the traces eat fruit of both kinds."""
    observation, info = env.reset(seed=seed)
    trace, done = [observation], False
    while not done:
        head, fruit = info["snake"][0], info["apples"] + info["bananas"]
        target = min(fruit, key=lambda cell: abs(cell[0] - head[0]) + abs(cell[1] - head[1]))
        moves = [move for move in range(4) if env.is_legal(move)]
        move = min(moves, key=lambda move: abs(envs.next_cell(head, move)[0] - target[0])
                   + abs(envs.next_cell(head, move)[1] - target[1]))
        observation, reward, terminated, truncated, info = env.step(move)
        trace.append((observation, reward))
        done = terminated or truncated
    return trace


# sha256 of repr(trace) (observations and rewards), first 16 hex digits, for seeds 0, 1, 2 and
# the first held-out seed, recorded from the games as they were before varied rules were added.
RECORDED_TRACES = {
    ("snake", ()): (
        ["bb042b212bb1a1fd", "40a21997284f2522", "05a52b60e7709522", "0875764e2be11e96"],
        ["98252037c8a7b43c", "b0caa33861b883a9", "f45ed35966daa4d6", "f10330a5eb42cf0a"]),
    ("snake", (("size", 6), ("max_steps", 30), ("opponent", True))): (
        ["3cf8c57c6f41f7ac", "e3b9917ae2a4bec6", "b92b89677b0b5fb2", "6a457387445996ae"],
        ["120181b77890d3e6", "dec6eb3dda92e392", "76db950becff7021", "d643e4bffcbcef83"]),
    ("snake_poison_apple", (("size", 6), ("bananas", 2), ("max_steps", 30))): (
        ["32e6557f63b80eaf", "e7275962670ab257", "eeb871d695f0ff9a", "156948189bf1d3ac"],
        ["761d986b3a0568d3", "ad99c1686faa51f5", "ccbd5ad5fead58ef", "52b6986e421e6998"]),
    ("snake_poison_apple", (("opponent", True), ("bananas", 3))): (
        ["7f5279f038f09afe", "da2b4b1a8739e1b8", "8dfac793e6e45649", "d939036baab0e6e8"],
        ["04f251aa26546bff", "496e28fa39464cc6", "c9006a82fdd7405d", "b17afc58f92fc002"]),
}


@pytest.mark.parametrize("name, options", RECORDED_TRACES)
def test_standard_snake_and_poison_apple_play_as_before_varied_rules(name, options):
    random_digests, greedy_digests = RECORDED_TRACES[name, options]
    for seed, random_digest, greedy_digest in zip((0, 1, 2, envs.HELDOUT_SEED_START),
                                                  random_digests, greedy_digests):
        for play, digest in ((play_random, random_digest), (play_greedy, greedy_digest)):
            trace = play(envs.make(name, **dict(options)), seed)
            assert hashlib.sha256(repr(trace).encode()).hexdigest()[:16] == digest, (play, seed)
