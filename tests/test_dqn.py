"""The DQN baseline: its state encoding, replay buffer and schedule, reproducibility, the CLI, and
(slow) the numbers it must reach."""

import json

import numpy as np
import pytest
import torch
from gymnasium.envs.toy_text.frozen_lake import MAPS

import baselines
import envs

CLASSIC = MAPS["4x4"]


def test_frozen_lake_state_is_player_hole_goal_channels():
    _, info = envs.make("frozen_lake", map="classic").reset(seed=0)
    grid = baselines.symbolic_state(info).reshape(3, 4, 4)
    assert grid[0].sum() == 1 and grid[0, 0, 0] == 1  # the player starts top left
    np.testing.assert_array_equal(grid[1], [[tile == "H" for tile in row] for row in CLASSIC])
    assert grid[2].sum() == 1 and grid[2, 3, 3] == 1


def test_snake_state_has_head_body_fruit_opponent_channels_and_direction():
    game = envs.make("snake_poison_apple", size=6, apples=2, bananas=1, opponent=True)
    _, info = game.reset(seed=3)
    state = baselines.symbolic_state(info)
    assert state.shape == (5 * 36 + 4,)
    grid, direction = state[:-4].reshape(5, 6, 6), state[-4:]
    head, *body = info["snake"]
    assert grid[0][head] == 1 and grid[0].sum() == 1
    assert all(grid[1][cell] == 1 for cell in body) and grid[1].sum() == len(body)
    assert grid[2].sum() == 2 and grid[3].sum() == 1 and grid[4].sum() == len(info["opponent"])
    np.testing.assert_array_equal(direction, [0, 1, 0, 0])  # heading right


def test_replay_buffer_overwrites_the_oldest_first():
    buffer = baselines.ReplayBuffer(capacity=3, n_inputs=2)
    for i in range(5):
        buffer.add(np.full(2, i), i % 4, float(i), np.full(2, i + 1), i == 4)
    assert buffer.size == 3
    assert sorted(buffer.rewards.tolist()) == [2.0, 3.0, 4.0]
    states, actions, rewards, next_states, terminated = buffer.sample(64, np.random.default_rng(0))
    assert set(rewards.tolist()) <= {2.0, 3.0, 4.0}
    torch.testing.assert_close(next_states[:, 0], states[:, 0] + 1)
    assert terminated[rewards == 4.0].eq(1).all() and terminated[rewards != 4.0].eq(0).all()


def test_epsilon_falls_linearly_then_stays():
    cfg = baselines.DQNConfig(train_steps=1000, start_epsilon=1.0, end_epsilon=0.1,
                              exploration_fraction=0.5)
    assert baselines.linear_epsilon(0, cfg) == 1.0
    assert baselines.linear_epsilon(250, cfg) == pytest.approx(0.55)
    assert baselines.linear_epsilon(500, cfg) == pytest.approx(0.1)
    assert baselines.linear_epsilon(999, cfg) == pytest.approx(0.1)


def test_td_target_stops_at_real_ends_only():
    """y = r + gamma * (1 - terminated) * max Q_target(s'): a terminal step's target is its
    reward."""
    torch.manual_seed(0)
    q = baselines.q_network(2, 2, 8)
    target = baselines.q_network(2, 2, 8)
    with torch.no_grad():
        for layer in target:
            if isinstance(layer, torch.nn.Linear):
                layer.weight.zero_()
                layer.bias.fill_(0.0)
        target[-1].bias.copy_(torch.tensor([0.5, 2.0]))  # Q_target = (0.5, 2.0) everywhere
    states = torch.zeros(2, 2)
    batch = (states, torch.tensor([0, 1]), torch.tensor([1.0, 0.0]), states,
             torch.tensor([1.0, 0.0]))
    q_before = q(states).gather(1, batch[1][:, None]).squeeze(1).detach()
    optimizer = torch.optim.SGD(q.parameters(), lr=0.0)  # lr 0: read the loss, change nothing
    loss = baselines.td_update(q, target, optimizer, batch, gamma=0.5)
    expected = torch.nn.functional.smooth_l1_loss(q_before, torch.tensor([1.0, 0.0 + 0.5 * 2.0]))
    assert loss == pytest.approx(expected.item())


def test_default_discount_depends_on_the_ice():
    assert baselines.DQNConfig(env="frozen_lake").gamma == 0.9
    assert baselines.DQNConfig(env="frozen_lake", env_options={"slippery": True}).gamma == 0.99
    assert baselines.DQNConfig(env="snake").gamma == 0.99
    assert baselines.DQNConfig(env="frozen_lake", gamma=0.5).gamma == 0.5


def small_run(seed):
    cfg = baselines.DQNConfig(env="frozen_lake", train_steps=600, learning_starts=100, hidden=32,
                              seed=seed)
    return baselines.train_dqn(cfg, progress=False)


def test_same_seed_same_network_other_seed_other_network():
    (a, stats_a), (b, stats_b), (c, _) = small_run(0), small_run(0), small_run(1)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert stats_a == stats_b
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def test_training_leaves_the_torch_thread_count_alone():
    threads = torch.get_num_threads()
    small_run(0)
    assert torch.get_num_threads() == threads


def test_dqn_agent_answers_in_the_lap_format_and_plays_every_seed():
    q, _ = small_run(0)
    agent = baselines.DQNAgent(q, envs.FROZEN_LAKE_ACTIONS)
    result = envs.evaluate(agent, "frozen_lake", envs.heldout_seeds(10))
    assert result["episodes"] == 10 and result["invalid_rate"] == 0.0
    _, info = envs.make("frozen_lake").reset(seed=0)
    assert envs.parse_action(agent.act("", info), envs.FROZEN_LAKE_ACTIONS) is not None


def test_run_folder_names_the_options_that_differ_from_the_defaults():
    assert baselines.dqn_run_dir("frozen_lake", {}).as_posix() == "runs/dqn-frozen_lake"
    assert (baselines.dqn_run_dir("frozen_lake", {"size": 4, "slippery": True, "map": "classic"})
            .as_posix() == "runs/dqn-frozen_lake-map=classic-slippery=True")


def test_cli_trains_saves_reloads_and_finds_the_weights(tmp_path, capsys):
    argv = ["--env", "frozen_lake", "--agent", "dqn", "--train-steps", "300", "--episodes", "5",
            "--map", "classic", "--runs", str(tmp_path)]
    trained = baselines.main(argv)
    run_dir = tmp_path / "dqn-frozen_lake-map=classic"
    config = json.loads((run_dir / "config.json").read_text())
    assert (config["dqn"]["train_steps"] == 300
            and config["dqn"]["env_options"] == {"map": "classic"})
    assert (run_dir / "model.pt").exists()
    assert "dqn" in capsys.readouterr().out
    reloaded = baselines.main(argv[:4] + argv[6:])  # no --train-steps: load the saved weights
    assert reloaded == trained
    assert baselines.find_dqn_run("frozen_lake", {"map": "classic"}, tmp_path) == run_dir
    assert baselines.find_dqn_run("frozen_lake", {"map": "classic", "slippery": True},
                                  tmp_path) is None


def test_cli_without_weights_says_how_to_train(tmp_path, capsys):
    with pytest.raises(SystemExit):
        baselines.main(["--agent", "dqn", "--runs", str(tmp_path)])
    assert "--train-steps" in capsys.readouterr().err


# --- the numbers the DQN must reach (README: "Known numbers") --------------------------------


def exact_success_within(map_rows, slippery, policy, horizon):
    """Probability that a fixed policy (one move per cell) reaches the goal within `horizon`
    steps."""
    T = envs.frozen_lake_transition_tensor(map_rows, slippery)
    flat = "".join(map_rows)
    P = T[np.arange(len(flat)), policy]
    goal = np.array([tile == "G" for tile in flat])
    value = goal.astype(float)
    for _ in range(horizon):
        value = np.where(goal, 1.0, P @ value)
    return value[flat.index("S")]


@pytest.mark.slow
def test_dqn_solves_random_firm_maps():
    q, _ = baselines.train_dqn(baselines.DQNConfig(env="frozen_lake", train_steps=30_000),
                               progress=False)
    result = envs.evaluate(baselines.DQNAgent(q, envs.FROZEN_LAKE_ACTIONS), "frozen_lake",
                           envs.heldout_seeds(500))
    assert result["success_rate"] >= 0.95, result


@pytest.mark.slow
def test_dqn_is_near_optimal_on_the_classic_slippery_map():
    options = {"map": "classic", "slippery": True, "max_steps": 200}
    q, _ = baselines.train_dqn(baselines.DQNConfig(env="frozen_lake", env_options=options,
                                                   train_steps=100_000), progress=False)
    agent = baselines.DQNAgent(q, envs.FROZEN_LAKE_ACTIONS)
    game = envs.make("frozen_lake", **options)
    _, info = game.reset(seed=0)
    states = [{**info, "position": divmod(s, 4)} for s in range(16)]
    policy = np.array([envs.parse_action(agent.act("", st), envs.FROZEN_LAKE_ACTIONS)
                       for st in states])
    best, _ = envs.frozen_lake_values(CLASSIC, slippery=True)
    # Exact, not sampled: the greedy policy's chance of winning within the 200 steps.
    assert exact_success_within(CLASSIC, True, policy, 200) >= best - 0.05
    result = envs.evaluate(agent, "frozen_lake", envs.heldout_seeds(1000), **options)
    assert result["success_rate"] >= best - 0.05, result


@pytest.mark.slow
def test_dqn_eats_clearly_more_apples_than_random():
    q, _ = baselines.train_dqn(baselines.DQNConfig(env="snake", train_steps=50_000), progress=False)
    seeds = envs.heldout_seeds(200)
    dqn = envs.evaluate(baselines.DQNAgent(q, envs.SNAKE_ACTIONS), "snake", seeds)
    rand = envs.evaluate(baselines.RandomAgent(), "snake", seeds)
    assert dqn["apples_ci95"][0] > rand["apples_ci95"][1], (dqn["apples_ci95"], rand["apples_ci95"])


# --- the run folder: trained weights are replaced only when asked, and whole ------------------


def train_cli(runs, steps, *extra):
    return baselines.main(["--env", "frozen_lake", "--agent", "dqn", "--train-steps", str(steps),
                           "--episodes", "1", "--map", "classic", "--runs", str(runs), *extra])


def folder_bytes(folder):
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


@pytest.mark.parametrize("steps", ["0", "-5"])
def test_train_steps_must_be_positive_before_anything_is_written(tmp_path, steps):
    with pytest.raises(SystemExit) as stop:
        train_cli(tmp_path, steps)
    message = str(stop.value.code)
    assert "--train-steps must be a positive integer" in message and "\n" not in message
    assert not list(tmp_path.iterdir())


def test_a_trained_dqn_is_replaced_only_with_overwrite(tmp_path):
    train_cli(tmp_path, 50)
    run_dir = tmp_path / "dqn-frozen_lake-map=classic"
    trained = folder_bytes(run_dir)
    with pytest.raises(SystemExit) as stop:
        train_cli(tmp_path, 60)
    message = str(stop.value.code)
    assert str(run_dir) in message and "--overwrite" in message and "\n" not in message
    assert folder_bytes(run_dir) == trained
    train_cli(tmp_path, 60, "--overwrite")
    assert json.loads((run_dir / "config.json").read_text())["dqn"]["train_steps"] == 60
    assert sorted(path.name for path in run_dir.iterdir()) == ["config.json", "model.pt"]


def test_a_save_cut_short_leaves_the_trained_dqn_whole(tmp_path, monkeypatch):
    train_cli(tmp_path, 50)
    run_dir = tmp_path / "dqn-frozen_lake-map=classic"
    trained = folder_bytes(run_dir)

    def disk_full(state, file):
        file.write(b"half a model")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(baselines.torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        train_cli(tmp_path, 60, "--overwrite")
    assert folder_bytes(run_dir) == trained  # the old files, and no temporary one beside them


def test_files_written_together_replace_the_old_ones_only_once_all_are_whole(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    baselines.write_atomically({first: lambda file: file.write(b"old a"),
                                second: lambda file: file.write(b"old b")})

    def half_then_fail(file):
        file.write(b"ne")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        baselines.write_atomically({first: lambda file: file.write(b"new a"),
                                    second: half_then_fail})
    assert folder_bytes(tmp_path) == {"a.json": b"old a", "b.json": b"old b"}
    baselines.write_atomically({first: lambda file: file.write(b"new a")})
    assert folder_bytes(tmp_path) == {"a.json": b"new a", "b.json": b"old b"}


FOREIGN_FOLDERS = {
    "msgrpo run": {"config.json": '{"env": "frozen_lake", "lora_r": 8}', "metrics.jsonl": "{}\n",
                   "checkpoint.pt": "weights"},
    "model": {"config.json": '{"model_type": "llama"}', "model.safetensors": "weights"},
    "other files": {"notes.txt": "mine"},
    "damaged config": {"config.json": "{", "model.pt": "weights"},
}


@pytest.mark.parametrize("kind", FOREIGN_FOLDERS)
@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_a_folder_that_holds_no_dqn_is_never_written(tmp_path, monkeypatch, kind, overwrite):
    run_dir = tmp_path / "theirs"
    run_dir.mkdir()
    for name, text in FOREIGN_FOLDERS[kind].items():
        (run_dir / name).write_text(text)
    before = folder_bytes(run_dir)

    def no_training(*args, **kwargs):
        raise AssertionError("the DQN trained")

    monkeypatch.setattr(baselines, "train_dqn", no_training)
    with pytest.raises(SystemExit) as stop:
        train_cli(tmp_path, 50, "--dqn-dir", str(run_dir), *overwrite)
    message = str(stop.value.code)
    assert str(run_dir) in message and "no DQN" in message and "\n" not in message
    assert folder_bytes(run_dir) == before


def test_an_empty_folder_takes_a_new_dqn(tmp_path):
    run_dir = tmp_path / "empty"
    run_dir.mkdir()
    train_cli(tmp_path, 50, "--dqn-dir", str(run_dir))
    assert sorted(path.name for path in run_dir.iterdir()) == ["config.json", "model.pt"]
