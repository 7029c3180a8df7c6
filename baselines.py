"""The other agents, to compare the trained language model with: random and optimal (so far).

Every agent has `act(obs_text, info) -> str`, a text response that `envs.evaluate` parses with the
game's parser, exactly like a language model's. These two read the symbolic `info`, not the text.

    python baselines.py --env frozen_lake --agent optimal --episodes 200
    python baselines.py --env frozen_lake --agent random --map classic --slippery --max-steps 100
    python baselines.py --env snake --agent optimal --opponent

Evaluation always runs on the held-out seeds (`envs.heldout_seeds`), never on training seeds.
"""

import argparse
import json
import random

import envs


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


AGENTS = {"random": RandomAgent, "optimal": OptimalAgent}


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
        row.update({"mean apples": f"{result['mean_apples']:.2f}", "deaths": result["deaths"]})
    return row


def env_options_from(args):
    """Only the options given on the command line, so each game keeps its own defaults."""
    options = {"size": args.size, "map": args.map, "max_steps": args.max_steps, "apples": args.apples,
               "bananas": args.bananas, "slippery": args.slippery or None, "opponent": args.opponent or None}
    return {name: value for name, value in options.items() if value is not None}


def main(argv=None):
    parser = argparse.ArgumentParser(description="Evaluate a baseline agent on held-out seeds.")
    parser.add_argument("--env", choices=envs.ENV_NAMES, default="frozen_lake")
    parser.add_argument("--agent", choices=sorted(AGENTS), default="optimal")
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0, help="the random agent's own seed")
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
    args = parser.parse_args(argv)
    if args.episodes < 1:
        parser.error("--episodes must be at least 1")
    options = env_options_from(args)
    try:
        envs.make(args.env, **options)  # a bad option fails here, with the valid ones listed
    except ValueError as error:
        parser.error(str(error))

    agent = RandomAgent(args.seed) if args.agent == "random" else OptimalAgent()
    seeds = envs.heldout_seeds(args.episodes)
    result = envs.evaluate(agent, args.env, seeds, progress=True, **options)
    result["agent"] = args.agent
    settings = ", ".join(f"{k}={v}" for k, v in result["env_options"].items())
    print(f"\n{args.env} ({settings}); held-out seeds {seeds[0]}..{seeds[-1]}")
    print(format_table([summary_row(args.agent, result)]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
