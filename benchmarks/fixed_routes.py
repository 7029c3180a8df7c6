"""What a map-blind fixed route wins: each of the 20 monotone routes from start to goal on 4x4 Frozen Lake.

    python benchmarks/fixed_routes.py --maps 100

A policy that ignores the holes and always walks the same route ("right to the edge, then down")
wins exactly the held-out maps on which that route is hole-free. A trained greedy policy must beat
the best of these to show it reads the map.

The second table is the other reference: a rule that reads only the observation's "Next to you"
line ("down unless that is a hole or the edge, else right") and plays it greedily. It shows what
reading one line of the prompt is worth.
"""

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import envs  # noqa: E402


def route_cells(route: str) -> list[tuple[int, int]]:
    row = col = 0
    cells = [(0, 0)]
    for move in route:
        row, col = (row + 1, col) if move == "D" else (row, col + 1)
        cells.append((row, col))
    return cells


def clear_fraction(route: str, maps: list) -> float:
    return sum(all(m[r][c] != "H" for r, c in route_cells(route)) for m in maps) / len(maps)


def neighbour_rule_wins(map_rows, first, second) -> bool:
    """Greedy play of "move `first` unless it walks onto a hole or the edge, else `second`"."""
    game = envs.make("frozen_lake", map=list(map_rows))
    game.reset(seed=0)
    first, second = game.actions.index(first), game.actions.index(second)
    done = False
    while not done:
        blocked = envs.walks_onto(game.map, game.position, first) in ("hole", "edge")
        _, _, terminated, truncated, info = game.step(second if blocked else first)
        done = terminated or truncated
    return info["success"]


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
    for first, second in (("down", "right"), ("right", "down")):
        wins = sum(neighbour_rule_wins(m, first, second) for m in maps)
        print(f"| {first} unless hole or edge, else {second} | {wins / len(maps):.3f} |")


if __name__ == "__main__":
    main()
