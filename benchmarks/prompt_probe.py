"""How well does a model play Frozen Lake under a prompt, before any training? Exactly, cheaply.

    python benchmarks/prompt_probe.py --maps 16
    python benchmarks/prompt_probe.py --adapter runs/fl-b/adapter

With `<action>` pre-filled, the reply's first token decides the move, so one forward pass per
(map, cell) gives the policy's probability of each move in every cell (the rest of the mass is an
invalid reply: stay put, as the game does). Dynamic programming over those probabilities then gives
the exact success probability within the step limit when sampling at temperature 1, and the greedy
policy's success, with no sampling noise. Approximations: the step counter in the prompt is held
at its start value, and a reply whose first token names a move is taken to be that move.

Prints one row per format instruction: valid-reply mass, P(success | sampling), greedy success.
With --adapter it also prints how the policy's P(down) and P(right) depend on what that move walks
onto (the observation's "Next to you" line): a policy that reads it avoids holes. And, in the cells
where down is blocked (a hole or the edge), all four moves' probabilities by what lies to the right:
where right is a hole too, a player that reads the map has only left and up.
"""

import argparse
import sys
from unittest import mock
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import envs  # noqa: E402
import msgrpo  # noqa: E402
import support  # noqa: E402

EXAMPLES = ("Answer with exactly one action word from the action list, inside <action></action>, "
            "e.g. ")
FORMATS = {
    "one example: up": EXAMPLES + "<action>up</action>.",
    "one example: right": EXAMPLES + "<action>right</action>.",
    "all four examples": EXAMPLES + "<action>left</action>, <action>down</action>, "
                                    "<action>right</action> or <action>up</action>.",
    "two examples: down, right (msgrpo.FORMAT_PLAIN)": msgrpo.FORMAT_PLAIN,
}


def cell_probabilities(model, tokenizer, cfg, states):
    """{(map, cell): (P(first reply token names each move), greedy move or None)} per probe state
    (envs.probe_states), by support.move_probabilities under cfg's prompt."""
    prompts = [msgrpo.lap_prompt_ids(tokenizer, obs, cfg) for _, _, obs in states]
    probs, greedy = support.move_probabilities(model, tokenizer, prompts, cfg.micro_batch,
                                               greedy=True)
    return {(map_rows, cell): (p, int(move) if move >= 0 else None)
            for (map_rows, cell, _), p, move in zip(states, probs, greedy)}


def success_probability(map_rows, policy, max_steps):
    """P(reach the goal within max_steps) from the start; policy(cell) -> move probabilities."""
    cells = [(r, c) for r in range(len(map_rows)) for c in range(len(map_rows[0]))]
    values = {cell: float(map_rows[cell[0]][cell[1]] == "G") for cell in cells}
    for _ in range(max_steps):
        new = {}
        for cell in cells:
            if map_rows[cell[0]][cell[1]] in "HG":
                new[cell] = values[cell]
                continue
            p = policy(cell)
            new[cell] = (sum(p[a] * values[envs.frozen_lake_slide(map_rows, cell, a)]
                             for a in range(4))
                         + (1 - p.sum()) * values[cell])
        values = new
    return values[envs.cells_with(map_rows, "S")[0]]


def one_hot(move):
    """The greedy policy as probabilities: all on one move, or none (an invalid reply)."""
    return np.eye(4)[move] if move is not None else np.zeros(4)


def by_neighbour(probabilities, move):
    """Mean P(move) over the probed cells, grouped by what the move walks onto: ice, hole, goal or
    edge."""
    groups = {}
    for (map_rows, cell), (p, _) in probabilities.items():
        groups.setdefault(envs.walks_onto(map_rows, cell, move), []).append(p[move])
    return {onto: (float(np.mean(values)), len(values)) for onto, values in groups.items()}


def where_down_is_blocked(probabilities):
    """Mean P(each move) over the probed cells where down walks into a hole or off the edge,
    grouped by what right walks onto: {onto: (array of 4 means in envs.FROZEN_LAKE_ACTIONS order,
    n cells)}."""
    down, right = envs.FROZEN_LAKE_ACTIONS.index("down"), envs.FROZEN_LAKE_ACTIONS.index("right")
    groups = {}
    for (map_rows, cell), (p, _) in probabilities.items():
        if envs.walks_onto(map_rows, cell, down) in ("hole", "edge"):
            groups.setdefault(envs.walks_onto(map_rows, cell, right), []).append(p)
    return {onto: (np.mean(values, axis=0), len(values)) for onto, values in groups.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--maps", type=int, default=16,
                        help="random 4x4 maps (seeds 700, 701, ...)")
    parser.add_argument("--adapter", help="a trained LoRA adapter folder (default: the base model)")
    parser.add_argument("--model", default=msgrpo.CPU_MODEL)
    args = parser.parse_args(argv)
    cfg = msgrpo.resolve_defaults(msgrpo.Config(model=args.model, run_dir="unused"))
    model, tokenizer = msgrpo.load_policy(cfg, adapter=args.adapter)
    max_steps = envs.make("frozen_lake").max_steps
    maps = [tuple(envs.make("frozen_lake").reset(seed=700 + i)[1]["map"]) for i in range(args.maps)]
    states = envs.probe_states(args.maps, 700,
                               **msgrpo.env_options(cfg))  # every open cell of those maps
    formats = {"msgrpo.FORMAT_PLAIN": msgrpo.FORMAT_PLAIN} if args.adapter else FORMATS
    print("| format instruction | valid-reply mass | P(success), sampled at T=1 | greedy success |")
    print("| --- | ---: | ---: | ---: |")
    for name, instruction in formats.items():
        # the trainer's prompt, this instruction
        with mock.patch.object(msgrpo, "FORMAT_PLAIN", instruction):
            probs = cell_probabilities(model, tokenizer, cfg, states)
        valid = np.mean([p.sum() for p, _ in probs.values()])
        sampled = np.mean([success_probability(m, lambda cell: probs[(m, cell)][0], max_steps)
                           for m in maps])
        greedy = np.mean([success_probability(m, lambda cell: one_hot(probs[(m, cell)][1]),
                                              max_steps)
                          for m in maps])
        print(f"| {name} | {valid:.2f} | {sampled:.3f} | {greedy:.3f} |")
    if args.adapter:
        print("\n| move | P(move) where it walks onto: ice | hole | goal | edge |\n"
              "| --- | ---: | ---: | ---: | ---: |")
        for move in ("down", "right"):
            means = by_neighbour(probs, envs.FROZEN_LAKE_ACTIONS.index(move))
            print(f"| {move} | " + " | ".join(f"{means[onto][0]:.2f} (n={means[onto][1]})"
                                              if onto in means else "-"
                                              for onto in ("ice", "hole", "goal", "edge")) + " |")
        print("\n| where down is blocked, right walks onto | cells | "
              + " | ".join(envs.FROZEN_LAKE_ACTIONS)
              + " |\n| --- | ---: |" + " ---: |" * 4)
        for onto, (means, n) in sorted(where_down_is_blocked(probs).items()):
            print(f"| {onto} | {n} | " + " | ".join(f"{m:.3f}" for m in means) + " |")


if __name__ == "__main__":
    main()
