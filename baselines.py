"""What MS-GRPO is compared with: other agents, and the other training algorithm (POAD, NTPO).

Every agent has `act(obs_text, info) -> str` or `act_batch(observations, infos) -> list[str]`: a
text response that `envs.evaluate` parses with the game's parser, exactly like a language model's.

    random, optimal    read the symbolic `info`; optimal is value iteration (Frozen Lake) or BFS
                       (Snake)
    SnakeRuleAgent     Snake's hand rules on the symbolic `info` (never_die, apple_greedy, ...)
    DQNAgent           CleanRL-style DQN on the symbolic state (one-hot grid channels)
    LLMAgent           a local language model (any model msgrpo.py loads, optional LoRA adapter),
                       zero-shot, with msgrpo's LAP prompt, generation and parser
    ChatServerAgent    any OpenAI-compatible chat-completions server (vLLM, llama.cpp,
                       transformers serve)
    poad_update        POAD's (and NTPO's) credit assignment and update: a critic and a per-token
                       backup, trained by msgrpo.train in place of msgrpo.msgrpo_update

    python baselines.py --env frozen_lake --agent optimal --episodes 200
    python baselines.py --env frozen_lake --agent random --map classic --slippery --max-steps 200
    python baselines.py --env frozen_lake --agent dqn --train-steps 30000
    python baselines.py --env frozen_lake --agent llm --adapter runs/frozen_lake-.../adapter
    python baselines.py --env frozen_lake --agent server --base-url http://localhost:8000/v1 \\
        --model NAME
    python baselines.py poad --env frozen_lake       (or ntpo; any msgrpo.py flag, plus --gamma ...)

Evaluation always runs on the held-out seeds (`envs.heldout_seeds`), never on training seeds.
The table of every agent on every game is benchmarks/compare.py's.
"""

import argparse
import collections
import copy
import dataclasses
import http.client
import json
import math
import os
import random
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

import cpu_speedups
import envs
import msgrpo
import support

# ---------------------------------------------------------------------------------------------
# 1. Random, optimal and Snake's hand rules: the floor, the ceiling, and what a rule reaches
# ---------------------------------------------------------------------------------------------


class RandomAgent:
    """A uniformly random move word. In Snake a random word is sometimes the illegal reversal,
    which counts as an invalid action, as it would for a language model."""

    def __init__(self, seed=0, actions=("left", "down", "right", "up")):
        self.rng = random.Random(seed)
        self.actions = list(actions)

    def act(self, obs_text, info):
        return self.rng.choice(self.actions)


class OptimalAgent:
    """The exact references: Frozen Lake's value-iteration policy, Snake's BFS-greedy policy."""

    def __init__(self):
        self.policies = {}  # (map, slippery) -> policy; value iteration once per map

    def act(self, obs_text, info):
        if "map" in info:
            key = (tuple(info["map"]), info["slippery"])
            if key not in self.policies:
                self.policies[key] = envs.frozen_lake_values(info["map"], info["slippery"])[1]
            row, col = info["position"]
            move = envs.FROZEN_LAKE_ACTIONS[self.policies[key][row, col]]
        else:
            move = envs.SNAKE_ACTIONS[snake_bfs_action(info)]
        return f"<action>{move}</action>"


def frozen_lake_optimum_within(map_rows, slippery, max_steps):
    """The best success probability any policy can reach within `max_steps` steps.

    Finite-horizon value iteration: V_0 = 1 at the goal, else 0;
    V_k(s) = max_a sum_s' P V_{k-1}(s').
    envs.frozen_lake_values has no step limit: on the classic slippery map it gives 14/17 = 0.824,
    but within 100 steps no policy wins more than 0.744 (0.817 within 200).
    """
    T = envs.frozen_lake_transition_tensor(map_rows, slippery)
    tiles = np.array([tile for row in map_rows for tile in row])
    goal, hole = tiles == "G", tiles == "H"
    values = goal.astype(float)
    for _ in range(max_steps):
        values = np.where(goal, 1.0, np.where(hole, 0.0, (T @ values).max(axis=1)))
    return float(values["".join(map_rows).index("S")])


def snake_bfs_action(info):
    """BFS-greedy reference policy for both snakes, from `info`: the first move of a shortest
    safe path to the nearest fruit worth eating (not into a pocket smaller than the snake);
    if none is reachable, the safe move with the most free space ahead; if every move dies,
    keep going."""
    size, snake = info["size"], [tuple(cell) for cell in info["snake"]]
    apples = {tuple(cell) for cell in info["apples"]}
    good = ({tuple(cell) for cell in info["bananas"]}
            | (apples if info["apple_reward"] > 0 else set()))
    bad = set() if info["apple_reward"] > 0 else apples
    deadly = set(snake[:-1]) | {tuple(cell) for cell in info["opponent"] or []}  # the tail moves on

    def passable(cell):
        return envs.on_board(cell, size) and cell not in deadly and cell not in bad

    direction = envs.SNAKE_ACTIONS.index(info["direction"])
    head = snake[0]
    survivable = [a for a in range(4) if a != (direction + 2) % 4
                  and envs.on_board(envs.next_cell(head, a), size)
                  and envs.next_cell(head, a) not in deadly]
    clean = [a for a in survivable if envs.next_cell(head, a) not in bad]
    # Do not chase fruit into a pocket too small to hold the snake.
    roomy = [a for a in clean if free_space(envs.next_cell(head, a), passable) >= len(snake)]
    queue = collections.deque((envs.next_cell(head, a), a) for a in roomy or clean)
    seen = {cell for cell, _ in queue}
    while queue:
        cell, first_move = queue.popleft()
        if cell in good:
            return first_move
        for a in range(4):
            nxt = envs.next_cell(cell, a)
            if passable(nxt) and nxt not in seen:
                seen.add(nxt)
                queue.append((nxt, first_move))
    if not survivable:
        return direction
    # A poisoned apple (-1, game goes on) beats death (-1, game over), so it is the last resort.
    return max(clean or survivable, key=lambda a: free_space(envs.next_cell(head, a), passable))


def free_space(start, passable):
    """How many cells a flood fill from `start` reaches."""
    seen, stack = {start}, [start]
    while stack:
        cell = stack.pop()
        for a in range(4):
            nxt = envs.next_cell(cell, a)
            if passable(nxt) and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return len(seen)


# Snake's hand rules: what reading the board's "Next to your head" line is worth, rule by rule.


def snake_safe_moves(info):
    """The moves (indices into envs.SNAKE_ACTIONS) that neither reverse nor die this step."""
    size, snake = info["size"], [tuple(cell) for cell in info["snake"]]
    fruit = {tuple(cell) for cell in info["apples"] + info["bananas"]}
    others = {tuple(cell) for cell in info["opponent"] or []}
    reverse = (envs.SNAKE_ACTIONS.index(info["direction"]) + 2) % 4
    return [a for a in range(4) if a != reverse and not envs.snake_dies(
        envs.next_cell(snake[0], a), snake, envs.next_cell(snake[0], a) in fruit, size, others)]


def never_die_move(info, rng):
    """A random move that hits nothing; keep going when every move dies."""
    safe = snake_safe_moves(info)
    return rng.choice(safe) if safe else envs.SNAKE_ACTIONS.index(info["direction"])


def straight_unless_deadly_move(info, rng):
    """Keep going unless that dies; then a random move that hits nothing."""
    ahead = envs.SNAKE_ACTIONS.index(info["direction"])
    return ahead if ahead in snake_safe_moves(info) else never_die_move(info, rng)


def apple_greedy_move(info, rng):
    """A safe move that brings the head nearer the nearest apple (whatever an apple is worth),
    else a random move that hits nothing."""
    head = tuple(info["snake"][0])

    def to_apple(cell):
        return min((abs(cell[0] - r) + abs(cell[1] - c) for r, c in info["apples"]), default=0)

    nearer = [a for a in snake_safe_moves(info)
              if to_apple(envs.next_cell(head, a)) < to_apple(head)]
    return rng.choice(nearer) if nearer else never_die_move(info, rng)


def circling_move(info, rng):
    """Turn clockwise every step, reading only the heading: a snake of 3 or 4 cells chases its tail
    round a 2x2 square and never dies once inside the board."""
    return (envs.SNAKE_ACTIONS.index(info["direction"]) + 1) % 4


SNAKE_RULES = {"never_die": never_die_move, "straight_unless_deadly": straight_unless_deadly_move,
               "apple_greedy": apple_greedy_move, "circling": circling_move}


class SnakeRuleAgent:
    """One of SNAKE_RULES, played from the symbolic `info` (Snake and Snake Poison Apple only)."""

    def __init__(self, rule, seed=0):
        self.move, self.rng = SNAKE_RULES[rule], random.Random(seed)

    def act(self, obs_text, info):
        if "snake" not in info:
            raise ValueError("the Snake rules play Snake and Snake Poison Apple only")
        return f"<action>{envs.SNAKE_ACTIONS[self.move(info, self.rng)]}</action>"


# ---------------------------------------------------------------------------------------------
# 2. DQN on the symbolic state (CleanRL's dqn.py, written out for these games)
#    Q-learning target: y = r + gamma * (1 - terminated) * max_a' Q_target(s', a')
#    loss: Huber(Q(s, a) - y) over a minibatch drawn uniformly from the replay buffer
# ---------------------------------------------------------------------------------------------


def symbolic_state(info):
    """The game state from `info` as a flat float vector of one-hot grid channels.

    Frozen Lake: channels player, hole, goal over the map (the map changes every episode, so it
    is part of the state). Snake: channels head, body, apple, banana, other snake, then the
    direction the snake moves in, one-hot (a reversal is illegal, so the direction matters).
    """
    if "map" in info:
        rows = info["map"]
        grid = np.zeros((3, len(rows), len(rows[0])), dtype=np.float32)
        grid[0][tuple(info["position"])] = 1.0
        for r, row in enumerate(rows):
            for c, tile in enumerate(row):
                grid[1, r, c] = tile == "H"
                grid[2, r, c] = tile == "G"
        return grid.ravel()
    size = info["size"]
    grid = np.zeros((5, size, size), dtype=np.float32)
    channels = [info["snake"][:1], info["snake"][1:], info["apples"], info["bananas"],
                info["opponent"] or []]
    for channel, cells in enumerate(channels):
        for row, col in cells:
            grid[channel, row, col] = 1.0
    direction = np.zeros(4, dtype=np.float32)
    direction[envs.SNAKE_ACTIONS.index(info["direction"])] = 1.0
    return np.concatenate([grid.ravel(), direction])


@dataclass
class DQNConfig:
    env: str = "frozen_lake"
    env_options: dict = field(default_factory=dict)  # passed to envs.make
    train_steps: int = 30_000  # environment steps
    seed: int = 0
    hidden: int = 256  # width of the two hidden layers
    lr: float = 5e-4  # Adam
    gamma: float | None = None  # None: default_gamma(env, env_options)
    buffer_size: int = 50_000
    batch_size: int = 128
    learning_starts: int = 1_000  # random steps before the first update
    train_every: int = 4  # environment steps per gradient step
    target_every: int = 500  # environment steps between copies of Q into the target network
    start_epsilon: float = 1.0
    end_epsilon: float = 0.05
    exploration_fraction: float = 0.5  # epsilon reaches end_epsilon after this fraction of training

    def __post_init__(self):
        if self.gamma is None:
            self.gamma = default_gamma(self.env, self.env_options)


def default_gamma(env_name, env_options):
    """0.9 on non-slippery Frozen Lake, 0.99 elsewhere (measured; see the README).

    On firm ice, walking into the edge keeps the state, so with gamma 0.99 stalling looks almost
    as good as walking on: trained on random 4x4 maps for 100k steps the greedy policy stalled and
    won 0 of 500 held-out maps; with 0.9 each wasted step costs 10% and it won 499. On slippery
    ice the best route is long and careful, and 0.9 prefers a shorter, riskier one (on the classic
    map it wins 0.780 of games instead of 0.824).
    """
    firm_lake = env_name == "frozen_lake" and not env_options.get("slippery", False)
    return 0.9 if firm_lake else 0.99


def q_network(n_inputs, n_actions, hidden):
    return torch.nn.Sequential(
        torch.nn.Linear(n_inputs, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, n_actions),
    )


def linear_epsilon(step, cfg):
    """Epsilon falls linearly from start to end over the first exploration_fraction of training."""
    duration = max(1, int(cfg.exploration_fraction * cfg.train_steps))
    return max(cfg.end_epsilon,
               cfg.start_epsilon + (cfg.end_epsilon - cfg.start_epsilon) * step / duration)


class ReplayBuffer:
    """The last `capacity` transitions in flat arrays; the oldest is overwritten first."""

    def __init__(self, capacity, n_inputs):
        self.states = np.zeros((capacity, n_inputs), dtype=np.float32)
        self.next_states = np.zeros((capacity, n_inputs), dtype=np.float32)
        self.actions = np.zeros(capacity, dtype=np.int64)
        self.rewards = np.zeros(capacity, dtype=np.float32)
        self.terminated = np.zeros(capacity, dtype=np.float32)
        self.capacity, self.size, self.next = capacity, 0, 0

    def add(self, state, action, reward, next_state, terminated):
        i = self.next
        self.states[i], self.actions[i], self.rewards[i] = state, action, reward
        self.next_states[i], self.terminated[i] = next_state, terminated
        self.next = (i + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def sample(self, batch_size, rng):
        idx = rng.integers(self.size, size=batch_size)
        return (torch.from_numpy(self.states[idx]), torch.from_numpy(self.actions[idx]),
                torch.from_numpy(self.rewards[idx]), torch.from_numpy(self.next_states[idx]),
                torch.from_numpy(self.terminated[idx]))


def td_update(q, target, optimizer, batch, gamma):
    """One gradient step on the Huber loss between Q(s, a) and the target network's bootstrap."""
    states, actions, rewards, next_states, terminated = batch
    with torch.no_grad():
        # Only a real end (hole, goal, death) stops the bootstrap; hitting the step limit does not,
        # because the state does not show the step count.
        y = rewards + gamma * (1 - terminated) * target(next_states).max(dim=1).values
    q_taken = q(states).gather(1, actions[:, None]).squeeze(1)
    loss = torch.nn.functional.smooth_l1_loss(q_taken, y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def training_seed(rng):
    """A new game (map, apples, slips) per episode, always below the held-out seeds."""
    return int(rng.integers(0, envs.HELDOUT_SEED_START))


def train_dqn(cfg, progress=True):
    """Train a Q-network on cfg.env; returns (network, stats). Same seed, same numbers (CPU)."""
    threads = torch.get_num_threads()
    # a small MLP gains nothing from threads, and one thread is reproducible
    torch.set_num_threads(1)
    try:
        return _train_dqn(cfg, progress)
    finally:
        torch.set_num_threads(threads)


def _train_dqn(cfg, progress):
    rng = np.random.default_rng(cfg.seed)
    torch.manual_seed(cfg.seed)
    game = envs.make(cfg.env, **cfg.env_options)
    state = symbolic_state(game.reset(seed=training_seed(rng))[1])
    q = q_network(len(state), len(game.actions), cfg.hidden)
    target = copy.deepcopy(q)
    optimizer = torch.optim.Adam(q.parameters(), lr=cfg.lr)
    buffer = ReplayBuffer(cfg.buffer_size, len(state))
    episode_return, returns, losses = 0.0, [], []
    bar = tqdm(range(cfg.train_steps), desc=f"DQN {cfg.env}", disable=not progress, mininterval=2)
    for step in bar:
        if rng.random() < linear_epsilon(step, cfg):
            action = int(rng.integers(len(game.actions)))
        else:
            with torch.no_grad():
                action = int(q(torch.from_numpy(state)).argmax())
        _, reward, terminated, truncated, info = game.step(action)
        next_state = symbolic_state(info)
        buffer.add(state, action, reward, next_state, terminated)
        episode_return += reward
        state = next_state
        if terminated or truncated:
            returns.append(episode_return)
            episode_return = 0.0
            state = symbolic_state(game.reset(seed=training_seed(rng))[1])
        if step >= cfg.learning_starts and step % cfg.train_every == 0:
            losses.append(td_update(q, target, optimizer, buffer.sample(cfg.batch_size, rng),
                                    cfg.gamma))
        if step % cfg.target_every == 0:
            target.load_state_dict(q.state_dict())
        if progress and returns and step % 5000 == 0:
            bar.set_postfix(epsilon=f"{linear_epsilon(step, cfg):.2f}",
                            recent_return=f"{np.mean(returns[-100:]):.2f}")
    stats = {"episodes": len(returns),
             "last_100_return": float(np.mean(returns[-100:])) if returns else 0.0,
             "last_1000_loss": float(np.mean(losses[-1000:])) if losses else 0.0}
    return q, stats


class DQNAgent:
    """The greedy policy of a trained Q-network, answering in the LAP format like a language
    model."""

    def __init__(self, q, actions):
        self.q, self.actions = q.eval(), list(actions)

    def act_batch(self, observations, infos):
        states = torch.from_numpy(np.stack([symbolic_state(info) for info in infos]))
        with torch.no_grad():
            moves = self.q(states).argmax(dim=1).tolist()
        return [f"<action>{self.actions[m]}</action>" for m in moves]

    def act(self, obs_text, info):
        return self.act_batch([obs_text], [info])[0]

    @classmethod
    def load(cls, run_dir):
        config = json.loads((Path(run_dir) / "config.json").read_text())
        cfg = DQNConfig(**config["dqn"])
        q = q_network(config["n_inputs"], len(config["actions"]), cfg.hidden)
        q.load_state_dict(torch.load(Path(run_dir) / "model.pt", weights_only=True))
        return cls(q, config["actions"])


def dqn_run_dir(env_name, env_options, runs="runs"):
    """runs/dqn-<env>, plus the options that differ from the game's defaults, in name order."""
    defaults = envs.GAMES[env_name].defaults
    tags = [f"-{k}={env_options[k]}" for k in sorted(env_options)
            if env_options[k] != defaults.get(k)]
    return Path(runs) / f"dqn-{env_name}{''.join(tags)}"


DQN_FILES = ("model.pt", "config.json")


def save_dqn(run_dir, q, cfg, stats):
    """model.pt and config.json, each written whole, and both before either replaces its old one."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config = {"dqn": dataclasses.asdict(cfg), "n_inputs": q[0].in_features,
              "actions": envs.make(cfg.env, **cfg.env_options).actions, "training": stats}
    text = json.dumps(config, indent=2).encode()
    write_atomically({run_dir / "model.pt": lambda file: torch.save(q.state_dict(), file),
                      run_dir / "config.json": lambda file: file.write(text)})


def write_atomically(writes):
    """{path: write}: write(file) fills a temporary file beside `path`, flushed to the disk; once
    every file is written they are renamed over their paths. A save cut short (a full disk, a
    kill) leaves the old files, never part of one."""
    temporary = {Path(path): Path(path).with_name(f".{Path(path).name}.tmp") for path in writes}
    try:
        for path, write in writes.items():
            with open(temporary[Path(path)], "wb") as file:
                write(file)
                file.flush()
                os.fsync(file.fileno())
        for path, tmp in temporary.items():
            os.replace(tmp, path)
    finally:
        for tmp in temporary.values():
            tmp.unlink(missing_ok=True)  # left only by a failed save


def find_dqn_run(env_name, env_options, runs="runs", given=()):
    """A trained DQN for exactly this game and these options, or None: first among the `given`
    run folders, then under runs/dqn-*. Folder names are a convenience; config.json decides."""
    options = envs.make(env_name, **env_options).options
    for config_path in ([Path(p) / "config.json" for p in given]
                        + sorted(Path(runs).glob("dqn-*/config.json"))):
        saved = json.loads(config_path.read_text())["dqn"]
        if (saved["env"] == env_name
                and envs.make(env_name, **saved["env_options"]).options == options):
            return config_path.parent
    return None


# ---------------------------------------------------------------------------------------------
# 3. Zero-shot language models: msgrpo's LAP policy, local or behind a chat server
# ---------------------------------------------------------------------------------------------


def lap_config(model="", adapter=None, **overrides):
    """The LAP settings (prompt, prefix, token budget, quantisation) to play a model with.

    A trained adapter is played with the settings it was trained with: msgrpo writes them to
    config.json next to adapter/. Keys this msgrpo.Config does not know are ignored. Without an
    adapter, `env=` in overrides gives the game's own defaults (Snake's replies are one token).
    """
    known = {f.name for f in dataclasses.fields(msgrpo.Config)}
    saved = {}
    if adapter is not None and (Path(adapter).parent / "config.json").exists():
        saved = json.loads((Path(adapter).parent / "config.json").read_text())
    settings = {k: v for k, v in saved.items()
                if k in known and k not in ("run_dir", "env", "env_options")}
    if model:
        settings["model"] = model
    return msgrpo.resolve_defaults(msgrpo.Config(**{**settings, **overrides, "run_dir": "unused"}))


class LLMAgent:
    """A local language model (with an optional LoRA adapter) as a zero-shot agent: msgrpo's own
    LAP prompt, batched generation and parser, greedy by default."""

    def __init__(self, model="", adapter=None, greedy=True, **overrides):
        self.cfg = lap_config(model, adapter, **overrides)
        # load_policy wraps the base in a fresh LoRA when no adapter is given; a fresh adapter's
        # B matrices are zero, so the model computes exactly the base model.
        network, tokenizer = msgrpo.load_policy(self.cfg, adapter=adapter)
        self.lap = msgrpo.LAPAgent(network, tokenizer, self.cfg, greedy=greedy)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            self.rng_state = torch.get_rng_state()

    def act_batch(self, observations, infos):
        # The agent samples (greedy=False) from its own seeded random stream, which it neither
        # takes from nor leaves to anyone else: the same seed plays the same games.
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.rng_state)
            responses = self.lap.act_batch(observations, infos)
            self.rng_state = torch.get_rng_state()
        return responses

    def act(self, obs_text, info):
        return self.act_batch([obs_text], [info])[0]


class RequestFailed(Exception):
    pass


class ReplyTooLong(ValueError):
    pass


def url_problem(base_url):
    """Why `base_url` cannot be a server's address, or "": it needs the scheme http or https, a
    host, and a port from 1 to 65535 if it names one."""
    url = urllib.parse.urlsplit(base_url)
    if url.scheme not in ("http", "https"):
        return "it must start with http:// or https://"
    if not url.hostname:
        return "it names no host"
    try:
        port = url.port  # ValueError when out of 0..65535 or not a number
    except ValueError:
        port = 0
    return "its port must be a number from 1 to 65535" if port == 0 else ""


class ChatServerAgent:
    """Any OpenAI-compatible chat-completions server as an agent, e.g. a 72B model behind vLLM.

    One request per live episode, `concurrency` at a time. A request that times out, fails or
    returns malformed content is retried `retries` times, after `backoff` seconds, then twice that
    and so on; then the response is "" - an invalid action, counted by the game like any other, so
    an episode is never lost to the network. `timeout` bounds each network operation (connecting,
    each read); `deadline` bounds the whole reply, every try and wait included, so that a server
    that sends a byte now and then cannot hold an episode for ever. A reply body longer than
    `max_reply_bytes`, or nested too deeply to decode, is malformed content like any other.
    The chat API has no standard way to pre-fill the assistant turn, so the "<action>" prefix
    is not sent; the stop string "</action>" keeps answers short (the parser accepts an
    unclosed tag).
    """

    # A reply of `max_tokens` tokens is a few KB of JSON; this leaves room for long thinking
    # replies and stops a server that sends without end before it fills the memory.
    max_reply_bytes = 1 << 20

    def __init__(self, base_url, model, api_key=None, think=False, max_tokens=32, temperature=0.0,
                 timeout=60.0, retries=2, backoff=1.0, deadline=180.0, concurrency=8):
        if problem := url_problem(base_url):
            raise ValueError(f"base_url {base_url!r}: {problem}")
        settings = dict(max_tokens=max_tokens, timeout=timeout, retries=retries, backoff=backoff,
                        deadline=deadline, concurrency=concurrency)
        for name, value in settings.items():
            if problem := server_setting_problem(name, value):
                raise ValueError(f"{name} {problem}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.max_tokens, self.temperature = model, max_tokens, temperature
        self.api_key = os.environ.get("OPENAI_API_KEY") if api_key is None else api_key
        self.cfg = msgrpo.Config(think=think)
        self.timeout, self.retries, self.backoff, self.concurrency = (timeout, retries, backoff,
                                                                      concurrency)
        self.deadline = deadline
        self.lock = threading.Lock()  # requests run in threads; they share the counter
        self.reset_counts()

    def reset_counts(self):
        """Count requests from zero, so that each evaluation reports its own failures."""
        self.requests = self.failures = 0  # failures: responses given up on (after retries)
        # what went wrong, every try: "TimeoutError", "HTTP 500"
        self.errors = collections.Counter()

    def act_batch(self, observations, infos):
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            answers = list(pool.map(self.respond, observations))
        self.requests += len(answers)
        self.failures += sum(answer is None for answer in answers)
        return [answer if answer is not None else "" for answer in answers]

    def act(self, obs_text, info):
        return self.act_batch([obs_text], [info])[0]

    def respond(self, obs_text):
        """The reply text, or None when every try failed."""
        body = {"model": self.model, "messages": msgrpo.lap_messages(obs_text, self.cfg),
                "max_tokens": self.max_tokens, "temperature": self.temperature,
                "stop": [msgrpo.ACTION_END]}
        give_up_at = time.monotonic() + self.deadline
        for attempt in range(self.retries + 1):
            try:
                return self.post(body, give_up_at)
            except RequestFailed as error:
                self.record(error)
                return None  # the server rejected the request itself: asking again will not help
            except (OSError, ValueError, KeyError, IndexError, TypeError,
                    http.client.HTTPException) as error:
                self.record(error)
                wait = self.backoff * 2**attempt
                if attempt == self.retries or time.monotonic() + wait >= give_up_at:
                    break
                time.sleep(wait)
        return None

    def record(self, error):
        kind = (f"HTTP {error.code}" if isinstance(error, urllib.error.HTTPError)
                else type(error).__name__)
        with self.lock:
            if not self.errors:  # say it once, so a dead server is noticed early
                print(f"{self.url}: {kind}: {error} (counted as an invalid action after "
                      f"{self.retries} retries; further errors are only counted)", file=sys.stderr)
            self.errors[kind] += 1

    def post(self, body, give_up_at):
        """One request, answered by the reply's text; raises on any failure.

        A watchdog shuts the socket at `give_up_at` (time.monotonic()): the timeout applies to each
        read on its own, which a server sending a byte now and then never reaches.
        """
        url = urllib.parse.urlsplit(self.url)
        remaining = give_up_at - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no reply within the {self.deadline:g} s deadline")
        kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        connection = kind(url.hostname, url.port, timeout=min(self.timeout, remaining))
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        cut = threading.Event()

        def cut_off():
            cut.set()
            try:
                connection.sock.shutdown(socket.SHUT_RDWR)  # wakes a read blocked in another thread
            except (AttributeError, OSError):
                pass

        watchdog = None
        try:
            connection.connect()  # before the watchdog starts, so that it has a socket to shut
            watchdog = threading.Timer(max(0.0, give_up_at - time.monotonic()), cut_off)
            watchdog.start()
            path = url.path + (f"?{url.query}" if url.query else "")
            connection.request("POST", path, body=json.dumps(body).encode(), headers=headers)
            reply = connection.getresponse()
            payload = reply.read(self.max_reply_bytes + 1)
        except (OSError, http.client.HTTPException):
            if cut.is_set():
                raise TimeoutError(f"no complete reply within the {self.deadline:g} s "
                                   "deadline") from None
            raise
        finally:
            if watchdog is not None:
                watchdog.cancel()
            connection.close()
        if cut.is_set():
            raise TimeoutError(f"no complete reply within the {self.deadline:g} s deadline")
        if reply.status >= 400:
            if reply.status < 500 and reply.status not in (408, 429):  # 408, 429: try again later
                raise RequestFailed(f"HTTP {reply.status}: {payload[:200]!r}")
            raise urllib.error.HTTPError(self.url, reply.status, reply.reason, reply.headers, None)
        if len(payload) > self.max_reply_bytes:
            raise ReplyTooLong(f"the reply is longer than {self.max_reply_bytes} bytes")
        try:
            data = json.loads(payload)
        except RecursionError:  # "[[[[..." deeper than Python's recursion limit
            raise ValueError("the reply is nested too deeply to decode") from None
        content = data["choices"][0]["message"]["content"]
        if not isinstance(content, str):
            raise TypeError(f"message content is {type(content).__name__}, not text")
        return content

    def summary(self):
        """One line for the terminal: how many replies were given up on, and why."""
        causes = ", ".join(f"{kind} {count}" for kind, count in self.errors.most_common())
        return (f"server requests: {self.failures} of {self.requests} failed "
                "(counted as invalid actions)"
                + (f"; errors over all tries: {causes}" if causes else ""))


# ---------------------------------------------------------------------------------------------
# 4. POAD and NTPO: the other answer to credit assignment, trained in msgrpo.py's own loop
#    A critic gives every token its own advantage by the Bellman backup with Action Decomposition
#    (BAD; arXiv 2405.15821). Action t is the tokens w_1..w_n of reply t, and V_j = V(o_t, w_1..w_j)
#    is the value before token w_j+1 is sampled (V_0 = V(o_t)):
#      inside an action   delta_j = V_j - V_j-1                       (no reward, no discount)
#      its last token     delta_n = r_t + gamma V(o_t+1) - V_n-1
#      GAE                A_j = delta_j + lambda A_j+1 inside an action, gamma lambda across actions
#    NTPO flattens the episode into one token sequence instead: delta = r + gamma V(next token) - V
#    at every token, gamma lambda everywhere, so credit decays with the number of tokens in between
#    rather than the number of actions. With one-token actions the two are the same.
#
#    MS-GRPO and POAD differ in one function, msgrpo.train's `update`: msgrpo.msgrpo_update there,
#    poad_update here. Rollouts, loss, gradient accumulation and evaluation are msgrpo.py's; the run
#    folder is support.py's.
#        python baselines.py poad --env frozen_lake          (ntpo: the naive backup)
# ---------------------------------------------------------------------------------------------

CRITIC_ALGOS = ("poad", "ntpo")


@dataclass
class POADConfig(msgrpo.Config):
    """msgrpo's settings plus the critic's. sampling, sample_frac, scale_advantages, episode_mean
    and beta are MS-GRPO's and do not apply: the critic's update trains on every step."""
    algo: str = "poad"  # poad: the BAD backup; ntpo: the naive token-level one
    gamma: float = 0.99  # discount across actions (poad) or across tokens (ntpo)
    gae_lambda: float = 0.95
    # weight of the value loss; eps_clip also clips the value change (CleanRL's ppo.py)
    vf_coef: float = 0.5
    # PPO's several optimizer steps per iteration, as results/algo_comparison ran: a critic that
    # starts at V = 0 learns from more than MS-GRPO's one step per batch of rollouts.
    minibatch: int = 32

    def __post_init__(self):
        if self.algo not in CRITIC_ALGOS:
            raise ValueError(f"algo must be one of {', '.join(CRITIC_ALGOS)}, not {self.algo!r}")


class ValueHead(torch.nn.Module):
    """V from one last-layer hidden state: a two-layer MLP, fp32 like the LoRA weights."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden_size, hidden_size), torch.nn.Tanh(),
                                       torch.nn.Linear(hidden_size, 1))
        # V starts at 0 everywhere, so the first backups are plain discounted returns, not noise.
        torch.nn.init.zeros_(self.mlp[2].weight)
        torch.nn.init.zeros_(self.mlp[2].bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mlp(hidden.float()).squeeze(-1)


def value_head_beside(model) -> dict:
    """The critic, for msgrpo.train's extra_modules: set as model.value_head, so the optimizer
    trains it with the policy; checkpoint.pt keeps it, out of the peft adapter (it is not part of
    the policy)."""
    return {"value_head": ValueHead(model.config.hidden_size).to(next(model.parameters()).device)}


def bad_advantages(values: list, rewards: list[float], gamma: float,
                   lam: float) -> list[np.ndarray]:
    """values[t][j] = V(o_t, w_1..w_j) for each token of action t; rewards[t] = r_t.

    Nothing follows the last action (V = 0 after it): the observation counts the steps left, so
    running out of steps is a terminal state of what the model sees, like falling in a hole.
    """
    advantages = [np.zeros(len(v)) for v in values]
    next_value = next_advantage = 0.0  # V(o_t+1) and the advantage of action t+1's first token
    for t in reversed(range(len(values))):
        v, a = np.asarray(values[t], dtype=float), advantages[t]
        a[-1] = rewards[t] + gamma * next_value - v[-1] + gamma * lam * next_advantage
        for j in reversed(range(len(v) - 1)):
            a[j] = v[j + 1] - v[j] + lam * a[j + 1]
        next_value, next_advantage = v[0], a[0]
    return advantages


def ntpo_advantages(values: list, rewards: list[float], gamma: float,
                    lam: float) -> list[np.ndarray]:
    """The naive token-level backup: r_t on action t's last token, gamma and lambda at every
    token."""
    lengths = [len(v) for v in values]
    flat_values = np.concatenate([np.asarray(v, dtype=float) for v in values])
    flat_rewards = np.zeros_like(flat_values)
    flat_rewards[np.cumsum(lengths) - 1] = rewards
    deltas = flat_rewards + gamma * np.append(flat_values[1:], 0.0) - flat_values
    advantages, running = np.zeros_like(deltas), 0.0
    for k in reversed(range(len(deltas))):
        running = advantages[k] = deltas[k] + gamma * lam * running
    return np.split(advantages, np.cumsum(lengths)[:-1])


def clipped_value_loss(values, old_values, returns, mask, eps_clip: float = 0.2) -> torch.Tensor:
    """0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2), mean over masked tokens."""
    clipped = old_values + (values - old_values).clamp(-eps_clip, eps_clip)
    loss = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    mask = mask.to(loss.dtype)
    return (loss * mask).sum() / mask.sum().clamp(min=1)


def logprobs_and_values(model, batch: msgrpo.StepBatch, temperature: float):
    """msgrpo.response_logprobs plus V at the same positions, from the hidden states entering the
    LM head.

    The critic reads the adapted trunk, detached: the policy's forward computes those states
    anyway (the adapter-disabled trunk would cost a second pass of every step, which on the CPU
    is most of an update), and detaching keeps value gradients out of the LoRA weights, so the
    critic cannot pull the policy's features towards predicting returns.
    """
    hidden = []
    hook = model.get_output_embeddings().register_forward_pre_hook(
        lambda _, args: hidden.append(args[0]))
    try:
        logprobs, mask = msgrpo.response_logprobs(model, batch, temperature)
    finally:
        hook.remove()
    # logits_to_keep = n + 1 hands the LM head the last n + 1 positions; the first n predict the
    # response.
    return logprobs, mask, model.value_head(hidden[-1][:, :-1].detach())


@dataclass
class TokenStep:
    """One step for the critic's update: its ids and, per response token, what the backup
    computed."""
    prompt: list
    response: list
    advantages: np.ndarray
    returns: np.ndarray  # A + V: the value targets
    old_values: np.ndarray
    old_logprobs: np.ndarray


def right_aligned(rows: list, width: int) -> torch.Tensor:
    """Per-token arrays as one [N, width] tensor, each row at the right end like the responses."""
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        if len(row):
            out[i, width - len(row):] = torch.as_tensor(np.asarray(row), dtype=torch.float32)
    return out


def backed_up_steps(model, tokenizer, episodes: list[msgrpo.Episode],
                    cfg: POADConfig) -> list[TokenStep]:
    """Score every step once (old log-probs and values), then run the backup episode by episode."""
    steps = [(p, r, 0.0) for ep in episodes for p, r in zip(ep.prompts, ep.responses)]
    old_logprobs, old_values = [], []
    model.eval()
    with torch.no_grad(), cpu_speedups.dequantized_4bit_weights(model):
        for micro in msgrpo.chunks(steps, cfg.micro_batch):
            logprobs, _, values = logprobs_and_values(
                model, msgrpo.collate_steps(micro, tokenizer.pad_token_id), cfg.temperature)
            for row, (_, response, _) in enumerate(micro):
                start = logprobs.shape[1] - len(response)
                old_logprobs.append(logprobs[row, start:].cpu().numpy())
                old_values.append(values[row, start:].cpu().numpy())
    backup = bad_advantages if cfg.algo == "poad" else ntpo_advantages
    token_steps, first = [], 0
    for ep in episodes:
        last = first + len(ep.responses)
        advantages = backup(old_values[first:last], ep.rewards, cfg.gamma, cfg.gae_lambda)
        for (prompt, response, _), a, v, logp in zip(steps[first:last], advantages,
                                                     old_values[first:last],
                                                     old_logprobs[first:last]):
            token_steps.append(TokenStep(prompt, response, a, a + v, v, logp))
        first = last
    return token_steps


def policy_and_value_loss(model, tokenizer, micro: list[TokenStep], cfg: POADConfig):
    """One micro-batch's loss: the clipped policy loss with per-token advantages + vf_coef * the
    clipped value loss, means over its response tokens; logged: each of the two."""
    batch = msgrpo.collate_steps([(s.prompt, s.response, 0.0) for s in micro],
                                 tokenizer.pad_token_id)
    logprobs, mask, values = logprobs_and_values(model, batch, cfg.temperature)
    width = mask.shape[1]
    advantages, returns, old_values, old_logprobs = (
        right_aligned([getattr(s, name) for s in micro], width).to(logprobs.device)
        for name in ("advantages", "returns", "old_values", "old_logprobs"))
    policy_loss = msgrpo.clipped_policy_loss(logprobs, old_logprobs, advantages, mask, cfg.eps_clip)
    value_loss = clipped_value_loss(values, old_values, returns, mask, cfg.eps_clip)
    return (policy_loss + cfg.vf_coef * value_loss, logprobs, old_logprobs, mask,
            {"loss": policy_loss.item(), "value_loss": value_loss.item()})


def update_policy_and_critic(model, optimizer, tokenizer, steps: list[TokenStep], cfg: POADConfig,
                             rng: np.random.Generator) -> dict:
    """PPO over every step, each minibatch one AdamW step on policy_and_value_loss, its gradient
    accumulated over micro-batches as MS-GRPO's is (msgrpo.update_policy): each micro-batch's
    token mean weighted by its share n_m / N of the minibatch's response tokens."""
    model.train()
    order = [steps[i] for i in rng.permutation(len(steps))]
    stats = {"loss": [], "value_loss": [], "clip_frac": [], "grad_norm": []}
    for _ in range(cfg.epochs):
        for minibatch in msgrpo.chunks(order, cfg.minibatch):
            optimizer.zero_grad(set_to_none=True)
            total_tokens = sum(len(s.response) for s in minibatch)
            logged = {"clip_frac": 0.0}
            for micro in msgrpo.chunks(minibatch, cfg.micro_batch):
                loss, logp, logp_old, mask, means = policy_and_value_loss(model, tokenizer, micro,
                                                                          cfg)
                weight = mask.sum().item() / total_tokens
                (loss * weight).backward()
                clipped = ((torch.exp(logp.detach() - logp_old) - 1).abs() > cfg.eps_clip)
                logged["clip_frac"] += (clipped & mask.bool()).sum().item() / total_tokens
                for name, value in means.items():
                    logged[name] = logged.get(name, 0.0) + value * weight
            for name, value in logged.items():
                stats[name].append(value)
            # Clipped apart: one norm over both would let a large value gradient shrink the
            # policy's.
            policy = [p for name, p in model.named_parameters()
                      if p.requires_grad and not name.startswith("value_head.")]
            stats["grad_norm"].append(torch.nn.utils.clip_grad_norm_(policy, cfg.grad_clip).item())
            torch.nn.utils.clip_grad_norm_(model.value_head.parameters(), cfg.grad_clip)
            optimizer.step()
    return {name: float(np.mean(values)) for name, values in stats.items()}


def poad_update(model, optimizer, tokenizer, episodes: list[msgrpo.Episode], cfg: POADConfig,
                rng: np.random.Generator) -> dict:
    """POAD's (or NTPO's) credit assignment and update, in place of msgrpo.msgrpo_update: the
    critic's backup gives every token its own advantage, and every step trains (no group
    advantages, no AAW)."""
    steps = backed_up_steps(model, tokenizer, episodes, cfg)
    return {"episodes_trained": len(episodes), "steps_trained": len(steps),
            "tokens_trained": sum(len(s.prompt) + len(s.response) for s in steps),
            **update_policy_and_critic(model, optimizer, tokenizer, steps, cfg, rng)}


def train_poad(cfg: POADConfig, resume: bool = False) -> Path:
    """msgrpo.train with POAD's update and its critic beside the policy."""
    return msgrpo.train(cfg, resume=resume, update=poad_update, extra_modules=value_head_beside)


POAD_RANGES = {  # checked with support.SETTING_RANGES before the model loads
    "gamma": (lambda v: 0 <= v <= 1, "from 0 to 1"),
    "gae_lambda": (lambda v: 0 <= v <= 1, "from 0 to 1"),
    "vf_coef": (lambda v: v >= 0, "at least 0"),
}


def train_poad_main(algo: str, argv: list[str]) -> Path:
    """python baselines.py poad|ntpo [msgrpo.py's flags] [--gamma G] [--gae-lambda L]
    [--vf-coef C]"""
    parser = msgrpo.build_parser()
    parser.prog, parser.description = (f"baselines.py {algo}",
                                       f"Train {algo.upper()} in msgrpo.py's loop.")
    d = POADConfig()
    for name, text in [("gamma", "discount"), ("gae-lambda", "GAE lambda"),
                       ("vf-coef", "value-loss weight")]:
        parser.add_argument(f"--{name}", type=float,
                            help=f"{text} (default {getattr(d, name.replace('-', '_'))})")
    minibatch = parser._option_string_actions["--minibatch"]
    minibatch.help = f"steps per optimizer step (default {d.minibatch})"
    args = parser.parse_args(argv)
    args.algo = algo
    cfg, resume = support.config_from_args(args, POADConfig, msgrpo.resolve_defaults,
                                           msgrpo.env_options, support.SETTING_RANGES | POAD_RANGES)
    return train_poad(cfg, resume=resume)


# ---------------------------------------------------------------------------------------------
# 5. Tables
# ---------------------------------------------------------------------------------------------


def format_table(rows):
    """A list of dicts -> aligned text columns, headers from the first row's keys."""
    headers = list(rows[0])
    cells = [[str(row[h]) for h in headers] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def summary_row(agent_name, result):
    """The numbers a person reads first, from one `envs.evaluate` result."""
    lo, hi = result["success_ci95"]
    row = {"agent": agent_name, "env": result["env"], "episodes": result["episodes"],
           "success [95% CI]": f"{result['success_rate']:.3f} [{lo:.3f}, {hi:.3f}]",
           "mean return": f"{result['mean_return']:.3f}",
           "invalid rate": f"{result['invalid_rate']:.3f}",
           "mean steps": f"{result['mean_steps']:.1f}"}
    if "mean_apples" in result:
        lo, hi = result["apples_ci95"]
        row.update({"mean apples [95% CI]": f"{result['mean_apples']:.2f} [{lo:.2f}, {hi:.2f}]",
                    "deaths": result["deaths"]})
    return row


# ---------------------------------------------------------------------------------------------
# 6. CLI
# ---------------------------------------------------------------------------------------------


def env_options_from(args):
    """Only the options given on the command line, so each game keeps its own defaults.
    --env-opt KEY=VALUE is typed by the game (envs.option_from_text); ValueError if it is not
    one."""
    options = {"size": args.size, "map": args.map, "max_steps": args.max_steps,
               "apples": args.apples, "bananas": args.bananas,
               "slippery": args.slippery or None, "opponent": args.opponent or None}
    given = {name: value for name, value in options.items() if value is not None}
    return {**given, **envs.options_from_text(args.env, args.env_opt or [])}


def name_equals_path(text):
    """NAME=PATH, or just PATH (then named after its run folder)."""
    if "=" in text:
        return tuple(text.split("=", 1))
    return (Path(text).parent.name or text, text)


def build_parser():
    parser = argparse.ArgumentParser(description="Evaluate baseline agents on held-out seeds.")
    parser.add_argument("--env", choices=envs.ENV_NAMES, default="frozen_lake")
    parser.add_argument("--agent",
                        choices=["random", "optimal", *SNAKE_RULES, "dqn", "llm", "server"],
                        default="optimal",
                        help="never_die, straight_unless_deadly, apple_greedy, circling: "
                             "Snake's hand rules")
    parser.add_argument("--episodes", type=int, default=200, help="held-out episodes")
    parser.add_argument("--seed", type=int, default=0, help="the random agent's and the DQN's seed")
    parser.add_argument("--json", help="also write the full result to this JSON file")
    game = parser.add_argument_group("game options (the game's default when left out)")
    game.add_argument("--size", type=int)
    game.add_argument("--map", choices=["classic"],
                      help="Frozen Lake: Gymnasium's classic 4x4 map instead of a random map "
                           "per seed")
    game.add_argument("--slippery", action="store_true", help="Frozen Lake: slippery ice")
    game.add_argument("--max-steps", type=int)
    game.add_argument("--apples", type=int, help="Snake: apples on the board")
    game.add_argument("--bananas", type=int, help="Snake Poison Apple: bananas on the board")
    game.add_argument("--opponent", action="store_true", help="Snake: add a random opponent snake")
    game.add_argument("--env-opt", action="append", type=support.parse_env_option,
                      metavar="KEY=VALUE",
                      help="any game option, as msgrpo.py takes it: slippery=false, "
                           "hole_penalty=-1 ...")
    dqn = parser.add_argument_group("DQN")
    dqn.add_argument("--train-steps", type=int,
                     help="train for this many environment steps (else load)")
    dqn.add_argument("--runs", default="runs", help="where DQN weights are saved and looked for")
    dqn.add_argument("--dqn-dir", help="the DQN run folder (default runs/dqn-<env>[-<options>])")
    dqn.add_argument("--overwrite", action="store_true",
                     help="with --train-steps: replace the trained DQN the run folder holds")
    llm = parser.add_argument_group("language models")
    llm.add_argument("--llm-model", default="", help="local model for --agent llm "
                                                     "(default: msgrpo's, smollm2-135m on the CPU)")
    llm.add_argument("--adapter", action="append", type=name_equals_path, metavar="[NAME=]PATH",
                     help="a LoRA adapter for --agent llm (the last one given)")
    add_server_flags(llm)
    return parser


def add_server_flags(parser):
    """The chat server agent's flags; check them with check_server_flags, build it with
    server_agent."""
    parser.add_argument("--base-url",
                        help="OpenAI-compatible server, e.g. http://localhost:8000/v1")
    parser.add_argument("--model",
                        help="the model name the server knows (API key: $OPENAI_API_KEY)")
    parser.add_argument("--max-tokens", type=int, default=32, help="server: tokens per reply")
    parser.add_argument("--concurrency", type=int, default=8, help="server: requests in flight")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="server: seconds per network operation")
    parser.add_argument("--retries", type=int, default=2, help="server: tries after a failed one")
    parser.add_argument("--backoff", type=float, default=1.0,
                        help="server: seconds before the first retry, doubling")
    parser.add_argument("--deadline", type=float, default=180.0,
                        help="server: seconds for a whole reply, all tries included; then it "
                             "counts as invalid")


# The chat server agent's settings: (lowest, whether lowest itself is refused, highest or None).
# Seconds above a million overflow the watchdog's timer (1e10 s: "timestamp out of range"); past
# 1000 retries the doubling wait, backoff * 2**retry, no longer fits a float; each request in
# flight is a thread.
SERVER_LIMITS = {"concurrency": (1, False, 1024), "max_tokens": (1, False, None),
                 "timeout": (0, True, 1_000_000), "retries": (0, False, 1000),
                 "backoff": (0, False, 1_000_000), "deadline": (0, True, 1_000_000)}


def server_setting_problem(name, value):
    """Why `value` cannot be the chat server agent's setting `name` (SERVER_LIMITS), or ""."""
    lowest, strict, highest = SERVER_LIMITS[name]
    too_low = value < lowest or (strict and value == lowest)
    if math.isfinite(value) and not too_low and (highest is None or value <= highest):
        return ""
    allowed = f"{'above' if strict else 'at least'} {lowest}"
    return f"must be {allowed}" + ("" if highest is None else f" and at most {highest}") \
        + f", got {value}"


def check_server_flags(args, parser):
    if args.base_url is not None and (problem := url_problem(args.base_url)):
        raise SystemExit(f"{parser.prog}: error: --base-url {args.base_url!r}: {problem}")
    for name in SERVER_LIMITS:
        if problem := server_setting_problem(name, getattr(args, name)):
            parser.error(f"--{name.replace('_', '-')} {problem}")


def server_agent(args):
    return ChatServerAgent(args.base_url, args.model, max_tokens=args.max_tokens,
                           timeout=args.timeout, retries=args.retries, backoff=args.backoff,
                           deadline=args.deadline, concurrency=args.concurrency)


def make_agent(args, options, parser):
    if args.agent == "random":
        return RandomAgent(args.seed)
    if args.agent == "optimal":
        return OptimalAgent()
    if args.agent in SNAKE_RULES:
        if args.env == "frozen_lake":
            parser.error(f"--agent {args.agent} is a Snake rule; it does not play frozen_lake")
        return SnakeRuleAgent(args.agent, args.seed)
    if args.agent == "llm":
        adapter = args.adapter[-1][1] if args.adapter else None
        if adapter is not None and not Path(adapter, "adapter_config.json").exists():
            parser.error(f"no LoRA adapter at {adapter} (it has no adapter_config.json)")
        if problem := support.model_folder_problem(args.llm_model):
            raise SystemExit(f"{parser.prog}: error: --llm-model {problem}")
        return LLMAgent(args.llm_model, adapter=adapter, env=args.env)
    if args.agent == "server":
        return server_agent(args)
    run_dir = Path(args.dqn_dir) if args.dqn_dir else dqn_run_dir(args.env, options, args.runs)
    if args.train_steps is not None:
        refuse_to_replace(run_dir, args.overwrite, parser.prog)  # before the training, not after
        cfg = DQNConfig(env=args.env, env_options=options, train_steps=args.train_steps,
                        seed=args.seed)
        start = time.time()
        q, stats = train_dqn(cfg)
        stats["seconds"] = round(time.time() - start, 1)
        save_dqn(run_dir, q, cfg, stats)
        print(f"trained {cfg.train_steps} steps in {stats['seconds']} s; saved to {run_dir}")
    elif not (run_dir / "model.pt").exists():
        parser.error(f"no DQN weights in {run_dir}; train them with --train-steps N")
    return DQNAgent.load(run_dir)


def holds_a_dqn(run_dir):
    """Whether run_dir's config.json is a DQN's (save_dqn's, with its "dqn" settings)."""
    try:
        config = json.loads((Path(run_dir) / "config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(config, dict) and "dqn" in config


def refuse_to_replace(run_dir, overwrite, prog):
    """Stop with one line, before any training, where the run folder is a file, holds files but
    no DQN (a training run, a model: --overwrite would replace its config.json), or holds a
    trained DQN and --overwrite was not given."""
    if run_dir.exists() and not run_dir.is_dir():
        raise SystemExit(f"{prog}: error: the DQN run folder {run_dir} is a file")
    leftovers = {f".{name}.tmp" for name in DQN_FILES}  # of a save that was killed
    held = sorted(p.name for p in run_dir.iterdir() if p.name not in leftovers) \
        if run_dir.is_dir() else []
    if held and not holds_a_dqn(run_dir):
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise SystemExit(f"{prog}: error: {run_dir} holds no DQN but other files ({shown}); a "
                         f"DQN is saved only in a new or empty folder or over another DQN: "
                         f"choose another --dqn-dir")
    if not overwrite and held:
        raise SystemExit(f"{prog}: error: {run_dir} already holds a trained DQN: evaluate it "
                         f"without --train-steps, or replace it with --overwrite")


# More held-out episodes than this is days of a language model's play; a count in the billions
# would allocate its list of seeds before the first game.
MAX_EPISODES = 100_000


def output_file_problem(path):
    """Make the folders above `path`, and say why a file cannot be written there, or "": checked
    before an evaluation, so that its result is not lost at the end."""
    path = Path(path)
    if path.is_dir():
        return "is a folder"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"cannot make its folder: {support.one_line(error)}"
    if not os.access(path if path.exists() else path.parent, os.W_OK):
        return "cannot be written (permission denied)"
    return ""


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in CRITIC_ALGOS:
        return train_poad_main(argv[0], argv[1:])
    parser = build_parser()
    parser.epilog = f"python baselines.py {{{','.join(CRITIC_ALGOS)}}} --help: train POAD or NTPO"
    args = parser.parse_args(argv)
    if not 1 <= args.episodes <= MAX_EPISODES:
        parser.error(f"--episodes must be from 1 to {MAX_EPISODES}, got {args.episodes}")
    if args.json is not None and (problem := output_file_problem(args.json)):
        raise SystemExit(f"{parser.prog}: error: --json {args.json}: {problem}")
    if args.train_steps is not None and args.train_steps < 1:
        raise SystemExit(f"{parser.prog}: error: --train-steps must be a positive integer, "
                         f"got {args.train_steps}")
    check_server_flags(args, parser)
    try:
        options = env_options_from(args)
        game = envs.make(args.env, **options)  # a bad option fails here, with the valid ones listed
    except ValueError as error:
        parser.error(str(error))
    if warning := envs.pointless_options_warning(game):
        print(f"{args.env}: {warning}", file=sys.stderr)
    if args.agent == "server" and not (args.base_url and args.model):
        parser.error("--agent server needs --base-url and --model")

    agent = make_agent(args, options, parser)
    seeds = envs.heldout_seeds(args.episodes)
    result = envs.evaluate(agent, args.env, seeds, progress=True, **options)
    result["agent"] = args.agent
    if isinstance(agent, ChatServerAgent):
        result.update(failed_requests=agent.failures, request_errors=dict(agent.errors))
    settings = ", ".join(f"{k}={v}" for k, v in result["env_options"].items())
    print(f"\n{args.env} ({settings}); held-out seeds {seeds[0]}..{seeds[-1]}")
    print(format_table([summary_row(args.agent, result)]))
    if isinstance(agent, ChatServerAgent):
        print(agent.summary())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    cpu_speedups.run_under_jemalloc(sys.argv)
    main()
