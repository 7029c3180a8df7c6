"""Can the model learn a detour on Frozen Lake from labels? The supervised yardstick for planning.

    python benchmarks/yardstick_detour.py --out results/yardstick_detour

A trained Frozen Lake policy plays the neighbour rule "down unless that is a hole or the edge,
else right" (envs.rule_move), which reads one line of the prompt and loses the maps where that
walk ends in a pocket. Winning those needs a detour: a move chosen from the map, one or more steps
before the pocket. This script asks whether SmolLM2 can learn that from the game's own wording
when every decision is labelled, with no rollouts. It teaches a fresh LoRA adapter the first
move of a shortest path to the goal (envs.goal_distances; among equally short moves the first of
down, right, left, up, so it agrees with the neighbour rule wherever that rule's move is on a
shortest path), through the trainer's own prompt and loss pieces (benchmarks/yardstick.py).

Half the training states, and half the held-out ones, need a detour: the neighbour rule's move
is on no shortest path there. A model that learns only the neighbour rule scores near 1 on the
other half and near 0 on these; one that reads the map scores near 1 on both. A rule that reads
only the neighbour line but tries right first already gets most detours (the table under the
scores says how many), so a column counts the detour states where it misses too. States are
drawn as in benchmarks/yardstick.py: the start cell, then 0-5 random moves onto ice, one state per
map; held-out states are on maps never trained on. If labels on every step cannot teach the detours,
reinforcement learning from episode returns, a far weaker signal, has little chance to.
"""

import argparse
import itertools
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import envs  # noqa: E402
import msgrpo  # noqa: E402
import support  # noqa: E402
from yardstick import (HELDOUT_MAP_SEED, MAX_STEPS, TRAIN_MAP_SEED,  # noqa: E402
                       add_training_flags, balanced_draw, game_wording, observation_step,
                       random_walk, save_table, scored_pass, states_on_maps,
                       trainable_parameters)

LABEL_ORDER = ("down", "right", "left", "up")  # the label among equally short moves: the first


@dataclass(frozen=True)
class State:
    map_rows: tuple  # the map's row strings
    position: tuple  # (row, col), on ice
    observation: str  # what the game shows
    optimal: frozenset  # moves (indices into envs.FROZEN_LAKE_ACTIONS) on a shortest path to G
    rule_move: int  # the neighbour rule's move
    label: str  # the first of LABEL_ORDER in `optimal`

    @property
    def detour(self) -> bool:
        """The neighbour rule's move is on no shortest path: a player of that rule gets it wrong."""
        return self.rule_move not in self.optimal


def shortest_path_moves(map_rows, position) -> frozenset:
    """The moves from `position` (which must reach the goal) that leave one move fewer to go."""
    distances = envs.goal_distances(map_rows)
    return frozenset(action for action in range(len(envs.FROZEN_LAKE_ACTIONS)) if distances.get(
        envs.frozen_lake_slide(map_rows, position, action), -1) == distances[tuple(position)] - 1)


def draw_state(map_rows, rng) -> State:
    """A state on `map_rows` after a random walk from the start. Moves on ice can be walked back,
    so every cell the walk reaches can reach the goal the random map is drawn to connect to S."""
    position, walked = random_walk(map_rows, rng)
    optimal = shortest_path_moves(map_rows, position)
    label = next(move for move in LABEL_ORDER if envs.FROZEN_LAKE_ACTIONS.index(move) in optimal)
    return State(map_rows, position, game_wording(map_rows, position, MAX_STEPS - walked), optimal,
                 envs.rule_move(map_rows, position), label)


def states(count: int, first_seed: int, rng_seed: int, excluded_maps=frozenset()):
    """`count` states, one per map of seeds first_seed, first_seed + 1, ..., half of them needing a
    detour, shuffled, and the set of their maps. Maps in `excluded_maps` are skipped: different
    seeds can draw the same map, and held-out states must be on maps never trained on."""
    rng = np.random.default_rng(rng_seed)
    candidates = states_on_maps(itertools.count(first_seed), excluded_maps,
                                lambda map_rows: draw_state(map_rows, rng))
    drawn = balanced_draw(candidates, count, lambda state: state.detour)
    return [drawn[i] for i in rng.permutation(len(drawn))], {s.map_rows for s in drawn}


# Rules that read only the "Next to you" line, scored like the model: what a detour column of a
# model that learned no more than such a rule would read.
REFERENCE_RULES = {
    "always right": ("right",),
    "down unless hole or edge, else right": ("down", "right"),
    "right unless hole or edge, else down, left, up": ("right", "down", "left", "up")}


def score(model, tokenizer, cfg, heldout: list[State]) -> dict:
    """How often the most likely first reply token is a shortest-path move, split by whether the
    state needs a detour; and where it does, the mean probability of the neighbour rule's move."""
    prompts = [msgrpo.lap_prompt_ids(tokenizer, s.observation, cfg) for s in heldout]
    probs = support.move_probabilities(model, tokenizer, prompts, cfg.micro_batch)
    top = probs.argmax(axis=1)
    optimal = np.array([int(top[i]) in s.optimal for i, s in enumerate(heldout)])
    detour = np.array([s.detour for s in heldout])
    rule_probability = np.array([probs[i, s.rule_move] for i, s in enumerate(heldout)])
    right_first = REFERENCE_RULES["right unless hole or edge, else down, left, up"]
    beyond = detour & np.array([envs.rule_move(s.map_rows, s.position, right_first) not in s.optimal
                                for s in heldout])  # neither down-first nor right-first finds these
    return {"optimal": float(optimal.mean()),
            "optimal_detour": float(optimal[detour].mean()),
            "optimal_beyond_rules": float(optimal[beyond].mean()),
            "beyond_rules": int(beyond.sum()),
            "optimal_elsewhere": float(optimal[~detour].mean()),
            "rule_probability_detour": float(rule_probability[detour].mean()),
            "detours": int(detour.sum()), "states": len(heldout)}


def rule_scores(heldout: list[State]) -> dict:
    """{rule: (shortest-path move where a detour is needed, elsewhere)} for REFERENCE_RULES."""
    scores, detour = {}, np.array([s.detour for s in heldout])
    for name, preference in REFERENCE_RULES.items():
        hits = np.array([envs.rule_move(s.map_rows, s.position, preference) in s.optimal
                         for s in heldout])
        scores[name] = (float(hits[detour].mean()), float(hits[~detour].mean()))
    return scores


COLUMNS = ("| states seen | shortest-path move | where a detour is needed (n) | of those, where "
           "right-first misses too (n) | elsewhere | P(the rule's move) where a detour is needed "
           "| seconds |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
TABLE_NOTE = ("Scored on held-out maps (4x4, the game's wording), half the states needing a "
              "detour. Shortest-path move: the most likely first reply token starts a shortest "
              "path to the goal. Where a detour is needed: the neighbour rule's move (down unless "
              "that is a hole or the edge, else right) is on no shortest path there, n states; "
              "elsewhere it is. Where right-first misses too: of those, the states where \"right "
              "unless hole or edge, else down, left, up\" is on no shortest path either: neither "
              "order of the two moves toward the goal, read off the neighbour line, finds them. "
              "Seconds: since training began, scoring included.")


RULES_NOTE = ("The same held-out states played by rules that read only the neighbour line: a "
              "model's detour column above theirs reads more of the map than that line.")


def table_row(r: dict) -> str:
    return (f"| {r['states_seen']} | {r['optimal']:.3f} "
            f"| {r['optimal_detour']:.3f} ({r['detours']}) "
            f"| {r['optimal_beyond_rules']:.3f} ({r['beyond_rules']}) "
            f"| {r['optimal_elsewhere']:.3f} | {r['rule_probability_detour']:.3f} "
            f"| {r['seconds']:.0f} |")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--states", type=int, default=3072,
                        help="training states, half of them needing a detour")
    parser.add_argument("--eval-states", type=int, default=200,
                        help="held-out states, half of them needing a detour")
    add_training_flags(parser, eval_every=256)
    args = parser.parse_args(argv)

    heldout, heldout_maps = states(args.eval_states, HELDOUT_MAP_SEED, HELDOUT_MAP_SEED)
    train, _ = states(args.states, TRAIN_MAP_SEED, args.seed, heldout_maps)
    cfg = msgrpo.resolve_defaults(msgrpo.Config(model=args.model, seed=args.seed, run_dir="unused"))
    torch.manual_seed(args.seed)
    model, tokenizer = msgrpo.load_policy(cfg)
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=args.lr)
    print(COLUMNS, flush=True)
    rows = scored_pass(train, args, lambda: score(model, tokenizer, cfg, heldout),
                       lambda batch: observation_step(model, optimizer, tokenizer, cfg, batch),
                       table_row, "yardstick: detours")
    rules = rule_scores(heldout)
    rule_lines = ["| rule read from the neighbour line | where a detour is needed | elsewhere |",
                  "| --- | ---: | ---: |",
                  *(f"| {name} | {detour:.3f} | {elsewhere:.3f} |"
                    for name, (detour, elsewhere) in rules.items())]
    print("\n".join(rule_lines))
    if args.out:
        save_table(args.out, "python benchmarks/yardstick_detour.py " + shlex.join(argv),
                   {"rows": rows, "rules": rules},
                   [COLUMNS, *map(table_row, rows), "", TABLE_NOTE, "", *rule_lines, "",
                    RULES_NOTE])
    return rows


if __name__ == "__main__":
    main()
