"""How a Snake agent dies on held-out games: into a wall or its own body, and whether a move that
survives the step was there (a blunder: the board said where not to go) or not (trapped: the
moves before left no way out). A policy that dies trapped needs to plan ahead; one that blunders
needs to read its "Next to your head" line more reliably.

    python benchmarks/snake_deaths.py --adapter results/snake_cpu_15_steps/adapter --size 6 \\
        --max-steps 30 --episodes 50
"""

import argparse
import collections
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import baselines  # noqa: E402
import envs  # noqa: E402


def death_of(info_before: dict, direction: int) -> dict:
    """What a fatal move in `direction` (an index into envs.SNAKE_ACTIONS) ran into, and how many
    moves would have lived, from the game's info before the move."""
    cell = envs.next_cell(tuple(info_before["snake"][0]), direction)
    return {"into": "wall" if not envs.on_board(cell, info_before["size"]) else "body",
            "moves_that_lived": len(baselines.snake_safe_moves(info_before))}


def play(agent, seeds, **options) -> list[dict]:
    """Play one Snake game per seed in lockstep; one record per death (seed, step, what it ran
    into, moves that would have lived, whether the reply was unparseable or illegal)."""
    games = [envs.make("snake", **options) for _ in seeds]
    observations, infos = map(list, zip(*[game.reset(seed=s) for game, s in zip(games, seeds)]))
    live, deaths, step = list(range(len(seeds))), [], 0
    bar = tqdm(total=len(seeds), desc="games", leave=False)
    while live:
        step += 1
        replies = agent.act_batch([observations[i] for i in live], [infos[i] for i in live])
        still_live = []
        for i, reply in zip(live, replies):
            before = infos[i]
            observations[i], _, terminated, truncated, infos[i] = games[i].step(
                games[i].parse_action(reply))
            if infos[i]["died"]:
                deaths.append({"seed": seeds[i], "step": step, "invalid": infos[i]["invalid"],
                               **death_of(before, games[i].direction)})
            if not (terminated or truncated):
                still_live.append(i)
        bar.update(len(live) - len(still_live))
        live = still_live
    bar.close()
    return deaths


def table(deaths: list[dict], episodes: int) -> str:
    counts = collections.Counter((d["into"], d["moves_that_lived"] > 0, d["invalid"] > 0)
                                 for d in deaths)
    lines = [f"{len(deaths)} deaths in {episodes} games",
             "| into | a move that lived was there | reply unparseable or illegal | deaths |",
             "| --- | --- | --- | ---: |"]
    lines += [f"| {into} | {'yes' if lived else 'no'} | {'yes' if invalid else 'no'} | {n} |"
              for (into, lived, invalid), n in sorted(counts.items())]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapter", required=True, help="a trained LoRA adapter folder")
    parser.add_argument("--size", type=int, default=6)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--episodes", type=int, default=50)
    args = parser.parse_args(argv)
    agent = baselines.LLMAgent(adapter=args.adapter)
    deaths = play(agent, envs.heldout_seeds(args.episodes), size=args.size,
                  max_steps=args.max_steps)
    print(table(deaths, args.episodes))
    print("steps at death:", " ".join(str(step) for step in sorted(d["step"] for d in deaths)))


if __name__ == "__main__":
    main()
