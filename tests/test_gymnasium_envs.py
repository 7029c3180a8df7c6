"""The games as Gymnasium environments: registered ids, spaces, Gymnasium's own checker, seeds."""

import warnings

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import envs

OPTIONS = {"frozen_lake": [{}, {"size": 6, "slippery": True}, {"map": "classic", "start": "ice"}],
           "snake": [{}, {"size": 5, "opponent": True, "start": "facing_wall"}],
           "snake_poison_apple": [{"bananas": 3},
                                  {"size": 6, "opponent": True, "max_steps": 10**9}]}
GAMES_AND_OPTIONS = [(name, options) for name, choices in OPTIONS.items() for options in choices]


def play(env, seed, moves=30):
    """Observations of one game from `seed`; a seeded policy picks moves and invalid replies."""
    policy = np.random.default_rng(seed)
    observation, _ = env.reset(seed=seed)
    seen = [observation]
    for _ in range(moves):
        move = int(policy.integers(-1, env.action_space.n))
        observation, _, terminated, truncated, _ = env.step(None if move < 0 else move)
        seen.append(observation)
        if terminated or truncated:
            break
    return seen


@pytest.mark.parametrize("name, options", GAMES_AND_OPTIONS)
def test_gymnasium_checker_passes_every_game_without_a_warning(name, options):
    env = gymnasium.make(envs.GYMNASIUM_IDS[name], **options)
    assert isinstance(env.unwrapped, gymnasium.Env) and isinstance(env.unwrapped, envs.GAMES[name])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any remark of the checker fails the test
        check_env(env.unwrapped)


@pytest.mark.parametrize("name, options", GAMES_AND_OPTIONS)
def test_gymnasium_make_plays_the_same_games_as_envs_make(name, options):
    ours, theirs = envs.make(name, **options), gymnasium.make(envs.GYMNASIUM_IDS[name], **options)
    for seed in (0, 7, envs.HELDOUT_SEED_START):
        assert play(theirs, seed) == play(ours, seed)


def test_ids_are_registered_on_import_and_bad_options_fail_as_in_envs_make():
    assert envs.GYMNASIUM_IDS == {"frozen_lake": "msgrpo/FrozenLake-v0", "snake": "msgrpo/Snake-v0",
                                  "snake_poison_apple": "msgrpo/SnakePoisonApple-v0"}
    assert set(envs.GYMNASIUM_IDS.values()) <= set(gymnasium.registry)
    with pytest.raises(ValueError, match="unknown option.*slipery.*valid options"):
        gymnasium.make("msgrpo/FrozenLake-v0", slipery=True)


@pytest.mark.parametrize("name, options", GAMES_AND_OPTIONS)
def test_spaces_hold_every_move_and_every_observation(name, options):
    env = envs.make(name, **options)
    assert env.action_space == gymnasium.spaces.Discrete(len(env.actions))
    for seed in range(40):
        for observation in play(env, seed, moves=200):
            assert observation in env.observation_space, observation


@pytest.mark.parametrize("name", envs.ENV_NAMES)
def test_numpy_integer_seeds_play_the_game_of_that_integer(name):
    env = envs.make(name)
    for seed in (np.int64(3), np.int32(3), np.uint8(3)):
        assert env.reset(seed=seed) == env.reset(seed=3)
    with pytest.raises(ValueError, match="seed must be None or an integer >= 0"):
        env.reset(seed=-1)


@pytest.mark.parametrize("name", envs.ENV_NAMES)
def test_reset_takes_options_as_gymnasium_does_but_game_options_only_when_made(name):
    env = envs.make(name)
    assert env.reset(seed=1, options={}) == env.reset(seed=1, options=None) == env.reset(seed=1)
    with pytest.raises(ValueError, match=r"reset takes no options; set \['size'\]"):
        env.reset(seed=1, options={"size": 5})


@pytest.mark.parametrize("name", envs.ENV_NAMES)
def test_unseeded_resets_after_a_seed_repeat_and_vary(name):
    """Gymnasium's convention: the seed of the first reset decides the games of the later ones."""
    env = envs.make(name)

    def games_after(seed):
        env.reset(seed=seed)
        return [env.reset()[0] for _ in range(5)]

    assert games_after(11) == games_after(11) != games_after(12)
    assert len(set(games_after(11))) > 1


def test_step_none_is_still_the_invalid_action_through_gymnasium_make():
    env = gymnasium.make("msgrpo/FrozenLake-v0", map="classic", invalid_penalty=-0.5)
    env.reset(seed=0)
    _, reward, terminated, truncated, info = env.step(None)
    assert (reward, terminated, truncated) == (-0.5, False, False)
    assert info["invalid"] and info["position"] == (0, 0)


@pytest.mark.parametrize("name", envs.ENV_NAMES)
def test_async_vector_env_refuses_shared_memory_and_says_how_to_go_without(name):
    """Gymnasium's shared memory for Text reads the observations once, when the vector env is
    made: every later observation would be the same string of a's."""
    with pytest.raises(ValueError, match="shared_memory=False"):
        gymnasium.vector.AsyncVectorEnv([lambda: envs.make(name)] * 2)


def played_alone(name, seed, moves):
    """Observations of one game played alone, up to the end of its episode."""
    env = envs.make(name)
    seen = [env.reset(seed=seed)[0]]
    for move in moves:
        observation, _, terminated, truncated, _ = env.step(int(move))
        seen.append(observation)
        if terminated or truncated:
            break
    return seen


@pytest.mark.parametrize("name", envs.ENV_NAMES)
def test_async_vector_env_without_shared_memory_sees_what_sync_and_the_single_env_see(name):
    seeds, moves = [3, 4, 5], np.random.default_rng(0).integers(0, 4, size=(6, 3))
    sync = gymnasium.vector.SyncVectorEnv([lambda: envs.make(name)] * len(seeds))
    asynchronous = gymnasium.vector.AsyncVectorEnv([lambda: envs.make(name)] * len(seeds),
                                                   shared_memory=False)
    try:
        seen = {}
        for kind, vector in (("sync", sync), ("async", asynchronous)):
            observations = [vector.reset(seed=seeds)[0]]
            observations += [vector.step(step_moves)[0] for step_moves in moves]
            seen[kind] = [list(step) for step in observations]
    finally:
        sync.close()
        asynchronous.close()
    assert seen["async"] == seen["sync"]
    for index, seed in enumerate(seeds):
        alone = played_alone(name, seed, moves[:, index])
        assert [step[index] for step in seen["async"][:len(alone)]] == alone
        assert len(set(alone)) > 1
