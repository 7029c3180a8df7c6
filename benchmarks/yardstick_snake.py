"""Can the model learn to read Snake's "Next to your head" line? The supervised yardstick.

    python benchmarks/yardstick_snake.py --out results/yardstick_snake

benchmarks/yardstick.py asks this of Frozen Lake's neighbour line; this script asks it of Snake's.
On Snake states from held-out games it teaches a fresh LoRA adapter the never-die rule, which
needs nothing but the line "Next to your head: up wall, right empty, down your neck (not allowed),
left apple": answer a move that runs into neither a wall, your body, nor your neck. The label of a
state is the straight-unless-deadly move (keep going if that is safe, else a safe move drawn at
random), written as "MOVE</action>" after the trainer's own prompt, with the trainer's loss pieces
(yardstick.supervised_step: collate_steps, msgrpo.response_logprobs). Half the training states
have the move straight on deadly, so a model that ignores the line and says "keep going" scores a
half there at best.

The score is read on states of games never trained on: the most likely first reply token is a
safe move (or not), split by whether going straight on is deadly there, and the mean probability
on deadly or not-allowed moves. A policy that reads the line scores near 1 in both columns;
one that keeps going everywhere scores 0 where straight on is deadly.
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
import baselines  # noqa: E402
import envs  # noqa: E402
import msgrpo  # noqa: E402
import support  # noqa: E402
from yardstick import (add_training_flags, balanced_draw, observation_step,  # noqa: E402
                       save_table, scored_pass, trainable_parameters)

TRAIN_SEED, HELDOUT_SEED = 10_000, 20_000  # game seeds of training states / held-out states
MAX_WALK = 3  # safe moves played from the start before the state is shown
OPTIONS = {"size": 6, "apples": 5, "max_steps": 5}  # Snake's CPU training setting
# move_probabilities' columns are in Frozen Lake's action order; Snake's moves are the same words.
COLUMN_OF_MOVE = [envs.FROZEN_LAKE_ACTIONS.index(move) for move in envs.SNAKE_ACTIONS]


@dataclass(frozen=True)
class State:
    observation: str  # what the game shows, the neighbour line last
    safe: frozenset  # moves (indices into envs.SNAKE_ACTIONS) that neither reverse nor die
    straight_deadly: bool  # going straight on runs into a wall or the body
    label: str  # the straight-unless-deadly move


def draw_state(seed: int, rng: np.random.Generator) -> State | None:
    """A state of the game of `seed`: half from the standard start, half facing the wall, then
    0-3 random safe moves; None when the snake is boxed in (no safe move to label)."""
    start = "facing_wall" if rng.random() < 0.5 else "standard"
    game = envs.make("snake", **OPTIONS, start=start)
    _, info = game.reset(seed=seed)
    for _ in range(int(rng.integers(0, MAX_WALK + 1))):
        safe = baselines.snake_safe_moves(info)
        if not safe:
            return None
        _, _, terminated, truncated, info = game.step(int(rng.choice(safe)))
        if terminated or truncated:
            return None
    safe = baselines.snake_safe_moves(info)
    if not safe:
        return None
    ahead = envs.SNAKE_ACTIONS.index(info["direction"])
    label = ahead if ahead in safe else int(rng.choice(safe))
    return State(game.observation(), frozenset(safe), ahead not in safe, envs.SNAKE_ACTIONS[label])


def states(count: int, first_seed: int, rng_seed: int, balanced: bool) -> list[State]:
    """`count` states, one per game seed from `first_seed` on; balanced: half with straight on
    deadly, shuffled; else in the games' natural mix."""
    rng = np.random.default_rng(rng_seed)
    drawn = (draw_state(seed, rng) for seed in itertools.count(first_seed))
    candidates = (state for state in drawn if state is not None)  # boxed-in states: no label
    if not balanced:
        return list(itertools.islice(candidates, count))
    chosen = balanced_draw(candidates, count, lambda state: state.straight_deadly)
    return [chosen[i] for i in rng.permutation(len(chosen))]

def score(model, tokenizer, cfg, heldout: list[State]) -> dict:
    prompts = [msgrpo.lap_prompt_ids(tokenizer, s.observation, cfg) for s in heldout]
    probs = support.move_probabilities(model, tokenizer, prompts, cfg.micro_batch)
    probs = probs[:, COLUMN_OF_MOVE]
    top = probs.argmax(axis=1)
    safe = np.array([int(top[i]) in s.safe for i, s in enumerate(heldout)])
    unsafe_mass = np.array([sum(p for m, p in enumerate(probs[i]) if m not in s.safe)
                            for i, s in enumerate(heldout)])
    deadly_ahead = np.array([s.straight_deadly for s in heldout])
    return {"safe": float(safe.mean()),
            "safe_straight_deadly": float(safe[deadly_ahead].mean()),
            "safe_straight_open": float(safe[~deadly_ahead].mean()),
            "unsafe_probability": float(unsafe_mass.mean()),
            "invalid_probability": float(1 - probs.sum(axis=1).mean()),
            "straight_deadly": int(deadly_ahead.sum()), "states": len(heldout)}


COLUMNS = ("| states seen | safe move | where straight on is deadly (n) | where it is open "
           "| P(deadly or not allowed) | P(no move) | seconds |\n"
           "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
TABLE_NOTE = ("Scored on held-out games' states (6x6, 5 apples, standard and facing-the-wall "
              "starts, 0-3 safe moves in). Safe move: the most likely first reply token is a move "
              "that runs into nothing; the two columns split the states by whether going straight "
              "on is deadly (n of them). P(deadly or not allowed): the mean probability on moves "
              "into a wall, the body or the neck; P(no move): on first tokens that name no move. "
              "Seconds: since training began, scoring included.")


def table_row(r: dict) -> str:
    return (f"| {r['states_seen']} | {r['safe']:.3f} | {r['safe_straight_deadly']:.3f} "
            f"({r['straight_deadly']}) | {r['safe_straight_open']:.3f} "
            f"| {r['unsafe_probability']:.3f} | {r['invalid_probability']:.3f} "
            f"| {r['seconds']:.0f} |")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--states", type=int, default=512,
                        help="training states, half with straight on deadly")
    parser.add_argument("--eval-states", type=int, default=200, help="held-out states, natural mix")
    add_training_flags(parser, eval_every=128)
    args = parser.parse_args(argv)

    heldout = states(args.eval_states, HELDOUT_SEED, HELDOUT_SEED, balanced=False)
    train = states(args.states, TRAIN_SEED, args.seed, balanced=True)
    cfg = msgrpo.resolve_defaults(msgrpo.Config(env="snake", model=args.model, seed=args.seed,
                                                run_dir="unused"))
    torch.manual_seed(args.seed)
    model, tokenizer = msgrpo.load_policy(cfg)
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=args.lr)
    print(COLUMNS, flush=True)
    rows = scored_pass(train, args, lambda: score(model, tokenizer, cfg, heldout),
                       lambda batch: observation_step(model, optimizer, tokenizer, cfg, batch),
                       table_row, "yardstick: snake")
    if args.out:
        save_table(args.out, "python benchmarks/yardstick_snake.py " + shlex.join(argv),
                   {"rows": rows}, [COLUMNS, *map(table_row, rows), "", TABLE_NOTE])
    return rows


if __name__ == "__main__":
    main()
