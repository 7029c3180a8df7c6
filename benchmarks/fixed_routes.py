"""What a map-blind fixed route wins: each of the 20 monotone routes from start to goal on 4x4 Frozen Lake.

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
"""

import argparse
import itertools
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


def rule_move(map_rows, cell, preference) -> int:
    """The first move of `preference` (move names) that walks onto neither a hole nor the edge; the
    last one if each does."""
    moves = [envs.FROZEN_LAKE_ACTIONS.index(name) for name in preference]
    return next((m for m in moves if envs.walks_onto(map_rows, cell, m) not in ("hole", "edge")), moves[-1])


def neighbour_rule_wins(map_rows, *preference) -> bool:
    """Greedy play of rule_move: e.g. ("down", "right"): down unless it walks onto a hole or the edge, else right."""
    game = envs.make("frozen_lake", map=list(map_rows))
    game.reset(seed=0)
    done = False
    while not done:
        _, _, terminated, truncated, info = game.step(rule_move(game.map, game.position, preference))
        done = terminated or truncated
    return info["success"]


def rule_on_the_probe(preference) -> dict:
    """The map-reading probe's numbers (support.probe_summary) for greedy play of rule_move."""
    cfg = msgrpo.Config()
    states = envs.probe_states(support.PROBE_MAPS, support.PROBE_FIRST_SEED, **msgrpo.env_options(cfg))
    moves = np.array([rule_move(map_rows, cell, preference) for map_rows, cell, _ in states])
    return support.probe_summary(states, np.eye(4)[moves], moves, envs.make(cfg.env, **msgrpo.env_options(cfg)).max_steps)


RULES = [("down", "right"), ("right", "down"), ("down", "right", "left", "up")]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--maps", type=int, default=200, help="held-out maps, from envs.heldout_seeds")
    args = parser.parse_args(argv)
    maps = [envs.make("frozen_lake").reset(seed=seed)[1]["map"] for seed in envs.heldout_seeds(args.maps)]
    routes = ["".join("D" if k in downs else "R" for k in range(6)) for downs in itertools.combinations(range(6), 3)]
    print(f"| route (D down, R right) | hole-free on the first {args.maps} held-out maps |\n| --- | ---: |")
    for route in sorted(routes, key=lambda r: -clear_fraction(r, maps)):
        print(f"| {route} | {clear_fraction(route, maps):.3f} |")
    print(f"\n| rule read from the neighbour line | wins on the first {args.maps} held-out maps, greedy |")
    print("| --- | ---: |")
    for preference in RULES:
        wins = sum(neighbour_rule_wins(m, *preference) for m in maps)
        print(f"| {rule_name(preference)} | {wins / len(maps):.3f} |")
    print("\n| rule, on the map-reading probe | P(down) hole / ice (ratio) | P(right) hole / ice (ratio) "
          "| probe maps won greedily |\n| --- | --- | --- | ---: |")
    for preference in RULES:
        probe = rule_on_the_probe(preference)
        down, right = (f"{probe[f'probe_{m}_hole']:.2f} / {probe[f'probe_{m}_ice']:.2f} "
                       f"({probe[f'probe_{m}_ratio']:.2f})" for m in ("down", "right"))
        print(f"| {rule_name(preference)} | {down} | {right} | {probe['probe_greedy_success']:.2f} |")


def rule_name(preference) -> str:
    return f"{preference[0]} unless hole or edge, else " + ", else ".join(preference[1:])


if __name__ == "__main__":
    main()
