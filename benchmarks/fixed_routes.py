"""What a map-blind fixed route wins: each of the 20 monotone routes from start to goal
on 4x4 Frozen Lake.

    python benchmarks/fixed_routes.py --maps 100

A policy that ignores the holes and always walks the same route ("right to the edge, then down")
wins exactly the held-out maps on which that route is hole-free. A trained greedy policy must beat
the best of these to show it reads the map.

The second table is the other reference: rules that read the observation's "Next to you" line
("down unless that is a hole or the edge, else right") and play greedily. They show what reading
one line of the prompt is worth.

The third table scores those rules with the trainer's map-reading probe (support.probe_summary, on
msgrpo's probe states): what a policy that reads only what lies below it gets for P(right) into a
hole / onto ice, next to one that also reads what lies to its right.

    python benchmarks/fixed_routes.py --against results/frozen_lake_cpu/eval.json

compares a trained policy with the first rule map by map: of the held-out maps the rule loses, how
many the policy wins, and of those the rule wins, how many it loses.
"""

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import envs  # noqa: E402
import msgrpo  # noqa: E402
import support  # noqa: E402


def route_cells(route: str) -> list[tuple[int, int]]:
    row = col = 0
    cells = [(0, 0)]
    for move in route:
        row, col = (row + 1, col) if move == "D" else (row, col + 1)
        cells.append((row, col))
    return cells


def clear_fraction(route: str, maps: list) -> float:
    return sum(all(m[r][c] != "H" for r, c in route_cells(route)) for m in maps) / len(maps)


def neighbour_rule_wins(map_rows, *preference) -> bool:
    """Greedy play of envs.rule_move from S: e.g. ("down", "right"): down unless it walks onto a
    hole or the edge, else right."""
    start = envs.cells_with(map_rows, "S")[0]
    return envs.rule_walk_wins(map_rows, start, envs.FrozenLake.defaults["max_steps"], preference)


def against_the_rule(won_seeds, seeds) -> dict:
    """Map by map against "down unless hole or edge, else right": of the maps of `seeds` the rule
    loses, how many a policy that won `won_seeds` wins; of those it wins, how many the policy
    loses."""
    maps = {seed: envs.make("frozen_lake").reset(seed=seed)[1]["map"] for seed in seeds}
    rule_won = {seed for seed in seeds if neighbour_rule_wins(maps[seed], "down", "right")}
    won = set(won_seeds)
    return {"rule_loses": len(maps) - len(rule_won), "policy_wins_those": len(won - rule_won),
            "rule_wins": len(rule_won), "policy_loses_those": len(rule_won - won)}


def print_against_the_rule(eval_json: Path) -> None:
    """The table for the last evaluation in a run's eval.json: greedy, and sampled if it was run."""
    last = json.loads(eval_json.read_text())[-1]
    seeds = range(last["seed_min"], last["seed_max"] + 1)
    print(f"\n| {eval_json.parent.name}, iteration {last['iteration']} | maps the rule loses "
          "| the policy wins of those | maps the rule wins | the policy loses of those |\n"
          "| --- | ---: | ---: | ---: | ---: |")
    for play, result in (("greedy", last), ("sampled at T = 1", last.get("sampled"))):
        if result and "won_seeds" in result:
            t = against_the_rule(result["won_seeds"], seeds)
            print(f"| {play} | {t['rule_loses']} | {t['policy_wins_those']} | {t['rule_wins']} "
                  f"| {t['policy_loses_those']} |")


def rule_on_the_probe(preference) -> dict:
    """The map-reading probe's numbers (support.probe_summary) for greedy play of rule_move."""
    cfg = msgrpo.Config()
    states = envs.probe_states(support.PROBE_MAPS, support.PROBE_FIRST_SEED,
                               **msgrpo.env_options(cfg))
    moves = np.array([envs.rule_move(map_rows, cell, preference) for map_rows, cell, _ in states])
    return support.probe_summary(states, np.eye(4)[moves], moves,
                                 envs.make(cfg.env, **msgrpo.env_options(cfg)).max_steps)


RULES = [("down", "right"), ("right", "down"), ("down", "right", "left", "up")]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--maps", type=int, default=200,
                        help="held-out maps, from envs.heldout_seeds")
    parser.add_argument("--against", type=Path, metavar="EVAL_JSON",
                        help="a run's eval.json: print only its maps won against the rule's, "
                             "map by map")
    args = parser.parse_args(argv)
    if args.against:
        return print_against_the_rule(args.against)
    maps = [envs.make("frozen_lake").reset(seed=seed)[1]["map"]
            for seed in envs.heldout_seeds(args.maps)]
    routes = ["".join("D" if k in downs else "R" for k in range(6))
              for downs in itertools.combinations(range(6), 3)]
    print(f"| route (D down, R right) | hole-free on the first {args.maps} held-out maps |\n"
          f"| --- | ---: |")
    for route in sorted(routes, key=lambda r: -clear_fraction(r, maps)):
        print(f"| {route} | {clear_fraction(route, maps):.3f} |")
    print(f"\n| rule read from the neighbour line | wins on the first {args.maps} held-out maps, "
          f"greedy |")
    print("| --- | ---: |")
    for preference in RULES:
        wins = sum(neighbour_rule_wins(m, *preference) for m in maps)
        print(f"| {rule_name(preference)} | {wins / len(maps):.3f} |")
    print("\n| rule, on the map-reading probe | P(down) hole / ice (ratio) "
          "| P(right) hole / ice (ratio) "
          "| probe maps won greedily |\n| --- | --- | --- | ---: |")
    for preference in RULES:
        probe = rule_on_the_probe(preference)
        down, right = (f"{probe[f'probe_{m}_hole']:.2f} / {probe[f'probe_{m}_ice']:.2f} "
                       f"({probe[f'probe_{m}_ratio']:.2f})" for m in ("down", "right"))
        print(f"| {rule_name(preference)} | {down} | {right} "
              f"| {probe['probe_greedy_success']:.2f} |")


def rule_name(preference) -> str:
    return f"{preference[0]} unless hole or edge, else " + ", else ".join(preference[1:])


if __name__ == "__main__":
    main()
