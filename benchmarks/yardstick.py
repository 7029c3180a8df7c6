"""Can the model learn to read an observation wording? A supervised yardstick, in minutes.

    python benchmarks/yardstick.py --out results/yardstick
    python benchmarks/yardstick.py --wordings "one line per move" --out results/yardstick

Reinforcement learning from episode returns only works if the policy can, in principle, read the
state it is shown: the reward says a move was bad, but the model must find in the prompt why. This
script asks that question directly, with every decision labelled and no rollouts. On random Frozen
Lake states it teaches a fresh LoRA adapter one rule that needs nothing but the neighbour
information: answer "down" unless moving down walks into a hole or off the edge, then answer
"right". The loss is the trainer's own: the log-probability of "down</action>" or
"right</action>" after the trainer's prompt (system prompt, format instruction, pre-filled
"<action>"), computed by msgrpo.response_logprobs. Training sees half "down" and half "right"
states, so a model that ignores the prompt cannot average more than a half over the two
columns "where blocked" and "where open" of the table.

The score is read on states from maps never trained on (held-out, in their natural mix of
labels): the first reply token's probability of each move, one forward per state. A wording the
model reads reaches high accuracy both where down is blocked and where it is open; a wording it
cannot read leaves one of the two near zero (it says one move everywhere) or both near a half.
It is a cheap proxy: if supervised labels on every step cannot teach the rule, RL from episode
returns, a far weaker signal, has little chance with that wording.

Each wording trains from the same base model and the same LoRA initialisation, on the same states
in the same order (--seed draws the training states and the LoRA; the held-out states are fixed).
Prints one Markdown row per (wording, states seen); with --out also writes yardstick.md and
yardstick.json there, replacing only the rows of the wordings run now.
"""

import argparse
import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cpu_speedups  # noqa: E402
import envs  # noqa: E402
import msgrpo  # noqa: E402
import support  # noqa: E402

TRAIN_MAP_SEED = 10_000  # training states: one per map of seeds 10_000, 10_001, ... (below 20_000)
HELDOUT_MAP_SEED = 20_000  # held-out state i: on the map of seed 20_000 + i
MAX_WALK = 5  # moves from the start to a state's position
DOWN = envs.FROZEN_LAKE_ACTIONS.index("down")
BLOCKED = {"hole", "edge"}  # what makes the rule answer "right" instead of "down"
MAX_STEPS = envs.FrozenLake.defaults["max_steps"]


# ---- Labelled states ----------------------------------------------------------------------------


@dataclass(frozen=True)
class State:
    map_rows: tuple  # the map's row strings
    position: tuple  # (row, col), always on ice
    steps_left: int  # the game's step budget less the moves walked to get here
    label: str  # the rule's move: "down" or "right"


def label_of(map_rows, position):
    """The rule, read from the neighbour information only: down unless down is a hole or the
    edge."""
    return "right" if envs.walks_onto(map_rows, position, DOWN) in BLOCKED else "down"


def random_map(seed):
    """The 4x4 map the game draws for this seed."""
    return tuple(envs.make("frozen_lake").reset(seed=seed)[1]["map"])


def random_walk(map_rows, rng):
    """The start cell, then 0-5 random moves onto ice: never onto a hole or the goal (those end the
    game, so no observation is ever shown there) and never into the edge (it would not move)."""
    position = envs.cells_with(map_rows, "S")[0]
    moves = int(rng.integers(0, MAX_WALK + 1))
    for walked in range(moves):
        onto_ice = [a for a in range(4) if envs.walks_onto(map_rows, position, a) == "ice"]
        if not onto_ice:
            return position, walked
        position = envs.frozen_lake_slide(map_rows, position, int(rng.choice(onto_ice)))
    return position, moves


def draw_state(map_rows, rng):
    position, walked = random_walk(map_rows, rng)
    return State(map_rows, position, MAX_STEPS - walked, label_of(map_rows, position))


def heldout_states(count):
    """One state per map, seeds 20_000 + i, in the labels' natural mix. The same for every --seed,
    so runs with different seeds are scored on the same states."""
    rng = np.random.default_rng(HELDOUT_MAP_SEED)
    return [draw_state(random_map(HELDOUT_MAP_SEED + i), rng) for i in range(count)]


def training_states(count, seed, excluded_maps):
    """`count` states, half labelled down and half right, one per map (seeds 10_000 + i), shuffled.

    Maps in `excluded_maps` are skipped: different seeds can draw the same map (all-ice maps are
    common), and the held-out score must be on maps never trained on.
    """
    rng = np.random.default_rng(seed)
    seeds = range(TRAIN_MAP_SEED, HELDOUT_MAP_SEED)  # never into the held-out seeds
    candidates = states_on_maps(seeds, excluded_maps, lambda map_rows: draw_state(map_rows, rng))
    states = balanced_draw(candidates, count, lambda state: state.label == "down")
    if len(states) < count:
        raise ValueError(f"could not draw {count} balanced training states from the training seeds")
    # Drawn until both halves are full, the tail is all one label: shuffle so every batch mixes
    # both.
    return [states[i] for i in rng.permutation(len(states))]


def states_on_maps(map_seeds, excluded_maps, draw):
    """draw(map_rows) on the map of each seed in turn, skipping maps in `excluded_maps`; lazily, so
    nothing is drawn beyond what the consumer takes."""
    for map_seed in map_seeds:
        map_rows = random_map(map_seed)
        if map_rows not in excluded_maps:
            yield draw(map_rows)


def balanced_draw(candidates, count, half):
    """The states of the iterator `candidates`, in order, that fill count // 2 places with
    half(state) true and the other count - count // 2 with it false; fewer if candidates run out.
    Nothing more is taken once both halves are full, so a random stream behind it stops there."""
    wanted = {True: count // 2, False: count - count // 2}
    drawn = []
    while len(drawn) < count and (state := next(candidates, None)) is not None:
        if wanted[half(state)] > 0:
            wanted[half(state)] -= 1
            drawn.append(state)
    return drawn


# ---- Wordings: (map rows, position, steps left) -> the observation text -------------------------


def game_wording(map_rows, position, steps_left):
    """Exactly what the game shows (the neighbour line last), so this row follows the game's
    wording."""
    game = envs.make("frozen_lake", map=list(map_rows))
    game.reset(seed=0)
    game.position = tuple(position)
    game.steps = game.max_steps - steps_left
    return game.observation()


def header_lines():
    return [envs.make("frozen_lake").rules, f"Actions: {', '.join(envs.FROZEN_LAKE_ACTIONS)}."]


def goal_line(map_rows, position):
    goal_row, goal_col = envs.cells_with(map_rows, "G")[0]
    return f"Goal: {envs.offset_text(goal_row - position[0], goal_col - position[1])}."


def map_lines(map_rows, position):
    """The legend and the grid, you as P and the start as plain ice, as the game draws them."""
    grid = [["P" if (r, c) == tuple(position) else ("F" if tile == "S" else tile)
             for c, tile in enumerate(row)] for r, row in enumerate(map_rows)]
    return ["Map (P = you, F = ice):", envs.grid_text(grid)]


def neighbour_line(map_rows, position):
    return f"Next to you: {envs.neighbour_text(map_rows, position)}."


def move_lines(map_rows, position):
    """'left: edge', 'down: ice', ...: one line per move, in the action list's order."""
    return [f"{move}: {envs.walks_onto(map_rows, position, action)}"
            for action, move in enumerate(envs.FROZEN_LAKE_ACTIONS)]


def steps_line(steps_left):
    return f"Steps left: {steps_left}."


def neighbour_line_first(map_rows, position, steps_left):
    """The neighbour line right after the goal, before the map: far from where the move is
    written."""
    return "\n".join([*header_lines(), goal_line(map_rows, position),
                      neighbour_line(map_rows, position),
                      *map_lines(map_rows, position), steps_line(steps_left)])


def one_line_per_move(map_rows, position, steps_left):
    """Each move next to what it walks onto, as 'move: what' lines at the very end."""
    return "\n".join([*header_lines(), goal_line(map_rows, position),
                      *map_lines(map_rows, position),
                      steps_line(steps_left), *move_lines(map_rows, position)])


def one_line_per_move_no_map(map_rows, position, steps_left):
    """The same without the grid: the fewest tokens, and nothing to read but the move lines."""
    return "\n".join([*header_lines(), goal_line(map_rows, position), steps_line(steps_left),
                      *move_lines(map_rows, position)])


WORDINGS = {
    "neighbour line first": neighbour_line_first,
    "neighbour line last (the game)": game_wording,
    "one line per move": one_line_per_move,
    "one line per move, no map": one_line_per_move_no_map,
}


def prompt_ids(tokenizer, cfg, state, wording):
    """The trainer's prompt for this state under this wording."""
    observation = WORDINGS[wording](state.map_rows, state.position, state.steps_left)
    return msgrpo.lap_prompt_ids(tokenizer, observation, cfg)


# ---- Scoring: first-token move probabilities on held-out states ---------------------------------


def move_probabilities(model, tokenizer, cfg, states, wording):
    """[len(states), 4]: P(the reply's first token names each move), one forward per state."""
    observations = [WORDINGS[wording](s.map_rows, s.position, s.steps_left) for s in states]
    prompts = [msgrpo.lap_prompt_ids(tokenizer, observation, cfg) for observation in observations]
    return support.move_probabilities(model, tokenizer, prompts, cfg.micro_batch)


def score(model, tokenizer, cfg, states, wording):
    """Accuracy of the most likely move against the rule, overall and split by whether down is
    blocked; mean P(down); how many states have down blocked."""
    probs = move_probabilities(model, tokenizer, cfg, states, wording)
    answers = np.array(envs.FROZEN_LAKE_ACTIONS)[probs.argmax(axis=1)]
    labels = np.array([state.label for state in states])
    correct = answers == labels
    blocked = labels == "right"
    return {"accuracy": float(correct.mean()),
            "accuracy_blocked": float(correct[blocked].mean()) if blocked.any() else float("nan"),
            "accuracy_open": float(correct[~blocked].mean()) if (~blocked).any() else float("nan"),
            "mean_p_down": float(probs[:, DOWN].mean()),
            "blocked": int(blocked.sum()), "states": len(states)}


# ---- Training: one pass of supervised steps through the trainer's own loss pieces ----------------


def target_ids(tokenizer, label):
    return tokenizer(f"{label}</action>", add_special_tokens=False).input_ids


def check_targets_start_with_the_move(tokenizer):
    """Training raises the target's first token and scoring reads the move tokens: they must
    agree."""
    first_tokens = support.move_token_ids(tokenizer)
    for label in ("down", "right"):
        if (target_ids(tokenizer, label)[0]
                not in first_tokens[envs.FROZEN_LAKE_ACTIONS.index(label)]):
            raise ValueError(f"{label}</action> does not start with a token that scoring counts "
                             f"as {label}")


def train_step(model, optimizer, tokenizer, cfg, states, wording, grad_clip=1.0):
    """One AdamW step on -mean log-prob of the labelled reply tokens."""
    steps = [(prompt_ids(tokenizer, cfg, s, wording), target_ids(tokenizer, s.label), 1.0)
             for s in states]
    return supervised_step(model, optimizer, tokenizer, steps, grad_clip, cfg.cpu_speedups)


def observation_step(model, optimizer, tokenizer, cfg, states, grad_clip=1.0):
    """One AdamW step on -mean log-prob of the labelled replies of states that carry their own
    .observation (the game's text) and .label (the move)."""
    steps = [(msgrpo.lap_prompt_ids(tokenizer, s.observation, cfg), target_ids(tokenizer, s.label),
              1.0) for s in states]
    return supervised_step(model, optimizer, tokenizer, steps, grad_clip, cfg.cpu_speedups)


def supervised_step(model, optimizer, tokenizer, steps, grad_clip=1.0, speedups=False):
    """One AdamW step on -mean log-prob of the target tokens of steps: (prompt ids, target ids,
    1.0), through the trainer's own collate_steps and response_logprobs. speedups
    (cfg.cpu_speedups): cpu_speedups.collate_steps' batch, which reads the prompt prefix every state
    shares once and identical steps as one row: the same loss, a fraction of the tokens."""
    collate = cpu_speedups.collate_steps if speedups else msgrpo.collate_steps
    batch = collate(steps, tokenizer.pad_token_id)
    model.train()
    logp, mask = msgrpo.response_logprobs(model, batch, 1.0)
    loss = -(logp * mask).sum() / mask.sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trainable_parameters(model), grad_clip)
    optimizer.step()
    return loss.item()


def trainable_parameters(model):
    return [p for p in model.parameters() if p.requires_grad]


def lora_snapshot(model):
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def restore_lora(model, snapshot):
    """Back to the adapter's initial weights, so every wording starts from the same LoRA."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in snapshot:
                p.copy_(snapshot[name])


def run_wording(model, tokenizer, cfg, wording, train, heldout, args):
    """Train a fresh adapter on `train` under `wording`; a row of scores before, every
    --eval-every states and after."""
    torch.manual_seed(args.seed)
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=args.lr)
    prompt_tokens = float(np.mean([len(prompt_ids(tokenizer, cfg, s, wording)) for s in heldout]))
    return scored_pass(train, args,
                       lambda: {"wording": wording,
                                **score(model, tokenizer, cfg, heldout, wording),
                                "prompt_tokens": prompt_tokens},
                       lambda batch: train_step(model, optimizer, tokenizer, cfg, batch, wording),
                       table_row, f"yardstick: {wording}")


def scored_pass(train, args, score_now, step, table_row, desc):
    """one_labelled_pass over `train` (args.batch, args.eval_every) with a row each time it
    records: the states seen, score_now() and the seconds since it began, printed by table_row."""
    start, rows = time.time(), []

    def record(seen):
        rows.append({"states_seen": seen, **score_now(), "seconds": time.time() - start})
        print(table_row(rows[-1]), flush=True)

    one_labelled_pass(train, args.batch, args.eval_every, record, desc, step)
    return rows


def save_table(out, command, json_fields, md_lines):
    """out/yardstick.json ({"command", **json_fields}) and out/yardstick.md (md_lines, then the
    command that made them)."""
    out.mkdir(parents=True, exist_ok=True)
    support.save_json(out / "yardstick.json", {"command": command, **json_fields})
    support.save_text(out / "yardstick.md",
                      "\n".join([*md_lines, "", "Made by:", "", f"    {command}"]) + "\n")


def one_labelled_pass(train, batch_size, eval_every, record, desc, step):
    """step(batch) over `train`, batch_size states at a time; record(states seen) before the first
    step, then each time another eval_every states have been seen, and after the last."""
    record(0)
    seen = 0
    for first in tqdm(range(0, len(train), batch_size), desc=desc, unit="batch"):
        batch = train[first:first + batch_size]
        step(batch)
        before, seen = seen, seen + len(batch)
        if seen // eval_every > before // eval_every or seen == len(train):
            record(seen)


# ---- The table -----------------------------------------------------------------------------------

COLUMNS = ("| wording | states seen | accuracy | where blocked (n) | where open | mean P(down) "
           "| prompt tokens | seconds |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")


TABLE_NOTE = ("Scored on held-out maps. Accuracy: the most likely first reply token names the "
              "rule's move. Where blocked: states whose down move walks into a hole or the edge "
              "(the rule says right), n of them; where open: the others, so answering down "
              "everywhere scores 1 - n / states. Seconds: since that wording's training began, "
              "scoring included.")


def table_row(r):
    return (f"| {r['wording']} | {r['states_seen']} | {r['accuracy']:.3f} "
            f"| {r['accuracy_blocked']:.3f} ({r['blocked']}) | {r['accuracy_open']:.3f} "
            f"| {r['mean_p_down']:.3f} | {r['prompt_tokens']:.0f} "
            f"| {r['seconds']:.0f} |")


def merge_rows(old, new):
    """Rows of the wordings in `new` replace their old rows; the others are kept. WORDINGS'
    order."""
    rerun = {r["wording"] for r in new}
    rows = [r for r in old if r["wording"] not in rerun] + new
    order = list(WORDINGS)
    return sorted(rows, key=lambda r: (order.index(r["wording"]) if r["wording"] in order
                                       else len(order)))


def write_outputs(out, rows):
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "yardstick.json"
    old = json.loads(json_path.read_text())["rows"] if json_path.exists() else []
    rows = merge_rows(old, rows)
    json_path.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    commands = list(dict.fromkeys(r["command"] for r in rows))  # in order, once each
    text = "\n".join([COLUMNS, *map(table_row, rows), "", TABLE_NOTE, "", "Made by:", "",
                      *(f"    {command}" for command in commands)])
    (out / "yardstick.md").write_text(text + "\n")
    return rows


def add_training_flags(parser, eval_every):
    """The flags every yardstick shares: when to score, the batch, the rate, the seed, the model,
    and where the tables go."""
    parser.add_argument("--eval-every", type=int, default=eval_every,
                        help="score after this many training states")
    parser.add_argument("--batch", type=int, default=16, help="training states per optimizer step")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=msgrpo.CPU_MODEL)
    parser.add_argument("--out", type=Path, help="folder for yardstick.md and yardstick.json")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wordings", nargs="+", default=list(WORDINGS), choices=list(WORDINGS),
                        metavar="NAME",
                        help="wordings to run, quoted: "
                             + ", ".join(f'"{name}"' for name in WORDINGS))
    parser.add_argument("--states", type=int, default=768,
                        help="training states, half down, half right")
    parser.add_argument("--eval-states", type=int, default=240, help="held-out states, natural mix")
    parser.add_argument("--lora-r", type=int, default=8)
    add_training_flags(parser, eval_every=256)
    args = parser.parse_args(argv)
    command = "python benchmarks/yardstick.py " + shlex.join(argv)

    heldout = heldout_states(args.eval_states)
    train = training_states(args.states, args.seed, {s.map_rows for s in heldout})
    cfg = msgrpo.resolve_defaults(msgrpo.Config(model=args.model, lora_r=args.lora_r,
                                                seed=args.seed, run_dir="unused"))
    torch.manual_seed(args.seed)
    model, tokenizer = msgrpo.load_policy(cfg)
    check_targets_start_with_the_move(tokenizer)
    initial_lora = lora_snapshot(model)
    print(f"held-out: {len(heldout)} states, "
          f"{sum(s.label == 'right' for s in heldout)} with down blocked")
    print(COLUMNS, flush=True)
    rows = []
    for wording in args.wordings:
        restore_lora(model, initial_lora)
        rows += [{**r, "command": command}
                 for r in run_wording(model, tokenizer, cfg, wording, train, heldout, args)]
    if args.out:
        write_outputs(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
