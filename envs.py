"""The text games: Frozen Lake, Snake and Snake Poison Apple, and the one evaluation harness.

Each game is a text-mediated stochastic game: the agent sees the state only
through the observation text (`observation()`, the renderer) and acts only through text
(`parse_action`, the parser). Both follow Gymnasium's API:

    env = envs.make("frozen_lake", slippery=True)
    obs_text, info = env.reset(seed=0)
    action = env.parse_action("<action>down</action>")  # an index into env.actions, or None
    obs_text, reward, terminated, truncated, info = env.step(action)

`step(None)` is an invalid action: the game applies its default action (Frozen Lake: stay put;
Snake: keep going), adds `invalid_penalty` to the reward and sets `info["invalid"] = True`.
`info` also carries the symbolic state, for agents that do not read text.

The games are Gymnasium environments, registered on import under GYMNASIUM_IDS:

    env = gymnasium.make(envs.GYMNASIUM_IDS["frozen_lake"], slippery=True)  # "msgrpo/FrozenLake-v0"

The observation space is Text, the action space Discrete(len(actions)).

Seeds: training uses seeds below HELDOUT_SEED_START (1,000,000); evaluation uses
`heldout_seeds(n)`, seeds 1,000,000 .. 1,000,000 + n - 1, so no evaluation game is ever trained on.
"""

import math
import re
import string
from collections import deque

import gymnasium
import numpy as np
from gymnasium.envs.toy_text.frozen_lake import MAPS, generate_random_map
from gymnasium.vector.utils import create_shared_memory
from tqdm import tqdm

HELDOUT_SEED_START = 1_000_000


def heldout_seeds(n):
    """Evaluation seeds: 1,000,000 .. 1,000,000 + n - 1. Training draws its seeds below these."""
    return list(range(HELDOUT_SEED_START, HELDOUT_SEED_START + n))


# ---- The parser: response text -> action index, or None for an invalid response ----

# An unclosed <think> runs to the end of the text.
THINK_BLOCK = re.compile(r"<think>.*?(?:</think>|\Z)", re.IGNORECASE | re.DOTALL)
CLOSE_THINK = re.compile(r"</think>", re.IGNORECASE)
# "(?:/\s*)?" rather than "/?\s*": two adjacent \s* would make "<" and a long run of spaces
# quadratic.
ANY_ACTION_TAG = re.compile(r"<\s*(?:/\s*)?action\s*>", re.IGNORECASE)
WORD = re.compile(r"[^\W\d_]+")  # a run of letters, in any alphabet
LONE_WORD = re.compile(r"[\W_]*([^\W\d_]+)[\W_]*")  # one word, maybe wrapped in spaces/punctuation


def strip_thinking(text):
    """Drop <think>...</think> blocks: a move that is only thought about is not played."""
    text = THINK_BLOCK.sub(" ", text)
    # A chat template may open <think> inside the prompt, leaving only the closing tag here.
    return CLOSE_THINK.split(text)[-1]


def action_named_in(text, actions):
    """The one action word in `text` (whole words, any case); None if there is none or several.
    Whole words only, so "leftover" and "upward" name nothing."""
    named = {actions.index(word) for word in WORD.findall(text.lower()) if word in actions}
    return named.pop() if len(named) == 1 else None


def action_tags(text):
    """(contents of the last complete <action>...</action> tag, text after the last opening tag),
    each None if there is none.

    One pass over the tags, in linear time: a reply has no length limit, and a regex search for
    complete tags restarts at every unclosed one. Tags pair up as that search pairs them: an
    opening tag inside an open one is content, a closing tag outside one is ignored.
    """
    complete = opened = last_opening = None
    for tag in ANY_ACTION_TAG.finditer(text):
        if "/" not in tag.group():
            last_opening = tag.end()
            if opened is None:
                opened = tag.end()
        elif opened is not None:
            complete, opened = text[opened:tag.start()], None
    return complete, None if last_opening is None else text[last_opening:]


def parse_action(text, actions):
    """Response text -> index into `actions`, or None when the response names no single move.

    1. Thinking is ignored.
    2. The last complete <action>...</action> tag decides ("<action> Move RIGHT. </action>" is
       right).
    3. Else the first line after an unclosed final "<action>": the response may be cut off at
       the token limit, and the prompt may pre-fill "<action>" ("<action>right\nbecause...").
    4. Else a lone action word as the whole response ("Right.", " up\\n").
    """
    if not isinstance(text, str):
        return None
    text = strip_thinking(text)
    complete, after_last_opening = action_tags(text)
    if complete is not None:
        return action_named_in(complete, actions)
    if after_last_opening is not None:
        return action_named_in(after_last_opening.strip().split("\n")[0], actions)
    lone = LONE_WORD.fullmatch(ANY_ACTION_TAG.sub(" ", text))  # "right</action>" is still right
    return action_named_in(lone.group(1), actions) if lone else None


# ---- What every game shares: options, the invalid-action rule, the step limit ----


def cell_list(cells):
    return ", ".join(f"({row},{col})" for row, col in cells) or "none"


def grid_text(rows):
    """Cells separated by spaces, so a tokenizer sees one cell per token."""
    return "\n".join(" ".join(row) for row in rows)


# Every character a game writes is printable ASCII: letters, digits, punctuation, spaces, newlines.
TEXT_CHARSET = string.ascii_letters + string.digits + string.punctuation + " \n"
# Room for the observation's lines other than the rules and the grid (actions, heading, offsets,
# neighbours, steps left): at most about 450 characters, in Snake with bananas and an opponent.
TEXT_BEYOND_RULES_AND_GRID = 1000


class TextObservations(gymnasium.spaces.Text):
    """Gymnasium's Text space, which AsyncVectorEnv may not keep in shared memory (below)."""


@create_shared_memory.register(TextObservations)
def refuse_shared_memory(space, n=1, ctx=None):
    """AsyncVectorEnv reads a Text space's shared memory once, when it is made, into a tuple of
    strings that later steps never update: every observation would be the same string of a's.
    Without shared memory each observation is sent from the worker whole, and is right."""
    raise ValueError("the text games' observations are text, which AsyncVectorEnv cannot keep in "
                     "shared memory: pass shared_memory=False")


class TextGame(gymnasium.Env):
    """Shared by the games. A game defines `new_game`, `is_legal`, `move`, `state_text` and
    `state_info`, and calls `declare_spaces` once its rules are written; this class handles
    options, seeds, invalid actions, the step limit and the text."""

    name = ""
    actions = []
    defaults = {}

    def __init__(self, **options):
        unknown = sorted(set(options) - set(self.defaults))
        if unknown:
            raise ValueError(f"{self.name}: unknown option(s) {unknown}; "
                             f"valid options: {', '.join(sorted(self.defaults))}")
        self.options = {**self.defaults, **options}
        self.max_steps = positive_int("max_steps", self.options["max_steps"])
        self.invalid_penalty = finite_float("invalid_penalty", self.options["invalid_penalty"])
        self.steps = 0
        self.done = True  # no episode until reset()

    def parse_action(self, text):
        return parse_action(text, self.actions)

    def declare_spaces(self, grid_cells):
        """Gymnasium's spaces: a move index, and text as long as the rules, a grid of `grid_cells`
        (a cell and a space or newline each) and the other lines can make it."""
        self.action_space = gymnasium.spaces.Discrete(len(self.actions))
        longest = len(self.rules) + 2 * grid_cells + TEXT_BEYOND_RULES_AND_GRID
        self.observation_space = TextObservations(longest, charset=TEXT_CHARSET)

    def reset(self, seed=None, options=None):
        """Start a game. The same seed gives the same game (map, apples, slips, opponent).

        Without a seed, the game's seed is drawn from Gymnasium's `np_random`, as Gymnasium's
        convention asks: reset(seed=s) then reset() plays the same games each time.
        """
        if options:
            raise ValueError(f"{self.name}: reset takes no options; set {sorted(options)} when "
                             f"the game is made: envs.make or gymnasium.make(id, **options)")
        seed = game_seed(seed)
        super().reset(seed=seed)  # seeds Gymnasium's np_random, which only draws unseeded games
        if seed is None:
            seed = int(self.np_random.integers(HELDOUT_SEED_START))  # a training seed
        # The game draws from its own generator, seeded as it always was: a seed plays the game it
        # always played.
        self.rng = np.random.default_rng(seed)
        self.steps = 0
        self.done = False
        self.new_game(seed)
        return self.observation(), self.info(invalid=False)

    def step(self, action):
        """`action`: an index into `self.actions`, or None for an invalid response."""
        if self.done:
            raise RuntimeError(f"{self.name}: the episode is over (or never started); call reset()")
        if action is not None and (isinstance(action, bool)
                                   or not isinstance(action, (int, np.integer))
                                   or not 0 <= action < len(self.actions)):
            raise ValueError(f"action must be None or an index 0..{len(self.actions) - 1} into "
                             f"{self.actions}, got {action!r}")
        if action is not None and not self.is_legal(action):
            action = None  # an illegal move counts as an invalid response
        invalid = action is None
        reward, terminated = self.move(action)  # move(None) plays the game's default action
        if invalid:
            reward += self.invalid_penalty
        self.steps += 1
        truncated = not terminated and self.steps >= self.max_steps
        self.done = terminated or truncated
        return self.observation(), float(reward), terminated, truncated, self.info(invalid)

    def observation(self):
        """The prompt text: rules, actions, the state. The response format is the agent's
        business."""
        return (f"{self.rules}\nActions: {', '.join(self.actions)}.\n{self.state_text()}\n"
                f"Steps left: {self.max_steps - self.steps}.")

    def info(self, invalid):
        return {**self.state_info(), "invalid": invalid, "steps": self.steps}


def game_seed(seed):
    """None or a non-negative integer, as a Python int: numpy integers are seeds like any other."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be None or an integer >= 0, got {seed!r}")
    return int(seed)


def positive_int(name, value, minimum=1, maximum=None):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum \
            or (maximum is not None and value > maximum):
        allowed = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise ValueError(f"option {name} must be an int {allowed}, got {value!r}")
    return int(value)


# The largest board side: the observation draws every cell, so a board of side n costs ~n^2
# characters of prompt per step (a 3000 x 3000 Snake board: 18 million, and 14 s per reset).
MAX_BOARD_SIZE = 32


def finite_float(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value):
        raise ValueError(f"option {name} must be a finite number, got {value!r}")
    return float(value)


def boolean(name, value):
    """True or False only: bool("False") is True, so a string here is a mistake, not a setting."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"option {name} must be true or false, got {value!r}")
    return bool(value)


# ---- Options written as text (command lines), typed by the game's own defaults ----

BOOLEAN_WORDS = {"true": True, "on": True, "yes": True, "1": True,
                 "false": False, "off": False, "no": False, "0": False}


def option_from_text(env_name, key, text):
    """One game option from its text, typed by the option's default: a boolean from BOOLEAN_WORDS,
    an int, a finite float, a word (Frozen Lake's start), or Frozen Lake's map ("classic",
    "random", or rows "SFF,FHF,FFG").
    Raises ValueError naming the option and what it accepts. Ranges are checked by the game."""
    game = GAMES.get(env_name)
    if game is None:
        raise ValueError(f"unknown env {env_name!r}; valid envs: {', '.join(ENV_NAMES)}")
    if key not in game.defaults:
        raise ValueError(f"{env_name} has no option {key!r}; valid options: "
                         f"{', '.join(sorted(game.defaults))}")
    default, word = game.defaults[key], text.strip().lower()
    if isinstance(default, bool):
        if word not in BOOLEAN_WORDS:
            raise ValueError(f"option {key} must be a boolean ({', '.join(BOOLEAN_WORDS)}), "
                             f"got {text!r}")
        return BOOLEAN_WORDS[word]
    if isinstance(default, str):
        return text.strip()  # the game checks it against its choices
    if key == "map":
        if word in ("classic", "random", "none"):
            return {"classic": "classic"}.get(word)
        return [row.strip()
                for row in text.strip(" []").replace('"', "").replace("'", "").split(",")]
    try:
        value = int(word) if isinstance(default, int) else float(word)
    except ValueError:
        raise ValueError(f"option {key} must be "
                         f"{'an int' if isinstance(default, int) else 'a number'}, "
                         f"got {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"option {key} must be a finite number, got {text!r}")
    return value


def options_from_text(env_name, pairs):
    """[(key, text), ...] -> {key: typed value}; the last of a repeated key wins."""
    return {key: option_from_text(env_name, key, text) for key, text in pairs}


def pointless_options_warning(game):
    """A message when legal options make every episode fail, else "": a Frozen Lake goal more moves
    away than max_steps (size=20 with the default 16 steps) cannot be reached, so nothing is
    learned."""
    if not isinstance(game, FrozenLake):
        return ""
    if game.fixed_map:
        (start_row, start_col), (goal_row, goal_col) = (cells_with(game.fixed_map, tile)[0]
                                                        for tile in "SG")
        distance = abs(goal_row - start_row) + abs(goal_col - start_col)
    else:
        # random maps start at the top left, the goal at the bottom right
        distance = 2 * (game.size - 1)
    if distance <= game.max_steps:
        return ""
    return (f"warning: the goal is {distance} moves from the start but max_steps is "
            f"{game.max_steps}: no episode can reach it")


# ---- Frozen Lake: Gymnasium's FrozenLake-v1 dynamics, written out ----

FROZEN_LAKE_ACTIONS = ["left", "down", "right", "up"]  # Gymnasium's action indices 0..3
FROZEN_LAKE_STEPS = [(0, -1), (1, 0), (0, 1), (-1, 0)]  # (row, col) change of each action


def frozen_lake_slide(map_rows, position, direction):
    """One cell in `direction`; walking into the edge leaves you where you are."""
    d_row, d_col = FROZEN_LAKE_STEPS[direction]
    row = min(max(position[0] + d_row, 0), len(map_rows) - 1)
    col = min(max(position[1] + d_col, 0), len(map_rows[0]) - 1)
    return (row, col)


def frozen_lake_transitions(map_rows, position, action, slippery):
    """[(probability, next_position)] of one action, as Gymnasium builds FrozenLake-v1's P.

    Holes and goals are absorbing. On slippery ice you move in the intended direction or in
    either perpendicular one, 1/3 each (Gymnasium lists them as action-1, action, action+1 mod 4).
    """
    row, col = position
    if map_rows[row][col] in "HG":
        return [(1.0, position)]
    directions = [(action - 1) % 4, action, (action + 1) % 4] if slippery else [action]
    return [(1.0 / len(directions), frozen_lake_slide(map_rows, position, d)) for d in directions]


def frozen_lake_transition_tensor(map_rows, slippery):
    """T[s, a, s'] with s = row * ncol + col, for value iteration."""
    nrow, ncol = len(map_rows), len(map_rows[0])
    T = np.zeros((nrow * ncol, 4, nrow * ncol))
    for state in range(nrow * ncol):
        for action in range(4):
            for prob, (r, c) in frozen_lake_transitions(map_rows, divmod(state, ncol), action,
                                                        slippery):
                T[state, action, r * ncol + c] += prob
    return T


def frozen_lake_values(map_rows, slippery, tol=1e-13, max_iterations=1_000_000):
    """Optimal probability of ever reaching the goal from the start, and a policy that achieves it.

    Value iteration, no discount, no step limit: V(goal) = 1, V(hole) = 0 and
    V(s) = max_a sum_s' P(s' | s, a) V(s'). From V = 0 the iterates rise to the reach probability.
    Returns (success_probability, policy) with policy[row, col] an index into FROZEN_LAKE_ACTIONS.

    Why a second pass: without a discount "walk into the wall for ever" keeps V and never
    arrives, so among the actions that keep V (to 1e-9) the policy takes the one that arrives
    soonest, by a discounted value iteration restricted to those actions.
    """
    nrow, ncol = len(map_rows), len(map_rows[0])
    T = frozen_lake_transition_tensor(map_rows, slippery)
    tiles = np.array([tile for row in map_rows for tile in row])
    goal, hole = tiles == "G", tiles == "H"

    def iterate(values, allowed, discount):
        for _ in range(max_iterations):
            q = discount * (T @ values)
            new = np.where(goal, 1.0,
                           np.where(hole, 0.0, np.where(allowed, q, -np.inf).max(axis=1)))
            if np.max(np.abs(new - values)) < tol:
                return new, q
            values = new
        raise RuntimeError("value iteration did not converge")

    reach, q = iterate(goal.astype(float), np.ones((len(tiles), 4), bool), 1.0)
    keeps_value = q >= reach[:, None] - 1e-9
    _, q_soon = iterate(goal.astype(float), keeps_value, 0.95)
    policy = np.where(keeps_value, q_soon, -np.inf).argmax(axis=1).reshape(nrow, ncol)
    start = "".join(map_rows).index("S")
    return float(reach[start]), policy


def resolve_map(map_option):
    """None (a random map per seed), "classic" (Gymnasium's 4x4) or a list of row strings."""
    if map_option is None:
        return None
    rows = MAPS["4x4"] if map_option == "classic" else map_option
    if isinstance(rows, str) or not all(isinstance(row, str) for row in rows):
        raise ValueError(f'option map must be None, "classic" or a list of row strings, '
                         f'got {map_option!r}')
    rows, tiles = [row.upper() for row in rows], "".join(rows).upper()
    well_formed = len({len(row) for row in rows}) == 1 and set(tiles) <= set("SFHG")
    if not well_formed or tiles.count("S") != 1 or "G" not in tiles:
        raise ValueError(f"map rows need equal lengths, only S, F, H, G, one S and a G: {rows}")
    if max(len(rows), len(rows[0])) > MAX_BOARD_SIZE:  # the cap on size, for the same reason
        raise ValueError(f"option map must be at most {MAX_BOARD_SIZE}x{MAX_BOARD_SIZE} cells, "
                         f"got {len(rows)}x{len(rows[0])}")
    return rows


def cells_with(map_rows, tile):
    return [(r, c) for r, row in enumerate(map_rows) for c, t in enumerate(row) if t == tile]


TILE_NAMES = {"S": "ice", "F": "ice", "H": "hole", "G": "goal"}


def walks_onto(map_rows, position, action):
    """What a (firm) move walks onto: 'ice', 'hole', 'goal', or 'edge' where it leaves you in
    place."""
    row, col = frozen_lake_slide(map_rows, position, action)
    return "edge" if (row, col) == tuple(position) else TILE_NAMES[map_rows[row][col]]


def rule_move(map_rows, position, preference=("down", "right")):
    """The neighbour rule's move: the first move of `preference` (move names) that walks onto
    neither a hole nor the edge; the last one if each does. ("down", "right") is the rule a trained
    policy first learns: down unless that is a hole or the edge, else right."""
    moves = [FROZEN_LAKE_ACTIONS.index(name) for name in preference]
    return next((m for m in moves if walks_onto(map_rows, position, m) not in ("hole", "edge")),
                moves[-1])


def rule_walk_wins(map_rows, position, steps, preference=("down", "right")):
    """Whether greedy play of rule_move from `position` reaches the goal within `steps` firm
    moves."""
    for _ in range(steps):
        position = frozen_lake_slide(map_rows, position, rule_move(map_rows, position, preference))
        if map_rows[position[0]][position[1]] in "HG":
            return map_rows[position[0]][position[1]] == "G"
    return False


def goal_distances(map_rows):
    """{cell: the fewest firm moves from it to the goal}, for the cells that can reach it (a
    breadth-first search back from the goal; no path steps on a hole, which would end the game)."""
    goal = cells_with(map_rows, "G")[0]
    distances, frontier = {goal: 0}, deque([goal])
    while frontier:
        cell = frontier.popleft()
        for d_row, d_col in FROZEN_LAKE_STEPS:
            before = (cell[0] - d_row, cell[1] - d_col)  # that move from `before` lands on cell
            inside = 0 <= before[0] < len(map_rows) and 0 <= before[1] < len(map_rows[0])
            if inside and before not in distances and map_rows[before[0]][before[1]] in "SF":
                distances[before] = distances[cell] + 1
                frontier.append(before)
    return distances


def neighbour_text(map_rows, position):
    """What each move would walk onto: 'left edge, down ice, right hole, up edge'."""
    return ", ".join(f"{name} {walks_onto(map_rows, position, action)}"
                     for action, name in enumerate(FROZEN_LAKE_ACTIONS))


def offset_text(d_row, d_col):
    """'3 down, 2 right' (or 'here'): where a cell lies relative to you."""
    parts = [f"{abs(d_row)} {'down' if d_row > 0 else 'up'}"] if d_row else []
    parts += [f"{abs(d_col)} {'right' if d_col > 0 else 'left'}"] if d_col else []
    return ", ".join(parts) or "here"


class FrozenLake(TextGame):
    name = "frozen_lake"
    actions = FROZEN_LAKE_ACTIONS
    defaults = dict(size=4, map=None, slippery=False, max_steps=16, invalid_penalty=-0.1,
                    hole_penalty=0.0, start="S")
    starts = ("S", "ice", "beside_hole", "hole_toward_goal", "rule_loses")  # first: held-out
    training_start = "beside_hole"

    def __init__(self, **options):
        super().__init__(**options)
        # ignored for a given map
        self.size = positive_int("size", self.options["size"], minimum=2, maximum=MAX_BOARD_SIZE)
        self.fixed_map = resolve_map(self.options["map"])
        self.slippery = boolean("slippery", self.options["slippery"])
        # Gymnasium's 0 unless set
        self.hole_penalty = finite_float("hole_penalty", self.options["hole_penalty"])
        self.start = self.options["start"]
        if self.start not in self.starts:
            raise ValueError(f"option start must be one of {', '.join(self.starts)}, "
                             f"got {self.start!r}")
        slip = (" The ice is slippery: you move in the chosen direction only 1/3 of the time,"
                " otherwise to one of its two sides." if self.slippery else "")
        self.rules = ("Frozen Lake: reach the goal G without falling into a hole H."
                      f" Moving off the edge leaves you in place.{slip}")
        grid = self.fixed_map or ["F" * self.size] * self.size  # random maps are size x size
        self.declare_spaces(len(grid) * len(grid[0]))

    def new_game(self, seed):
        self.map = self.fixed_map or generate_random_map(size=self.size, p=0.8, seed=seed)
        self.position = self.start_cell()

    def start_cell(self):
        """S, Gymnasium's start; or, for exploring starts, a cell the seed picks: any ice cell
        ("ice"), an ice cell one move from a hole ("beside_hole"), one where a move toward the goal
        walks into a hole ("hole_toward_goal": the moves a player heading for G makes are the ones
        worth testing), or one from which the neighbour rule (rule_move) falls in or runs out of
        steps although the goal is within reach ("rule_loses": where only a detour wins); any ice
        cell on a map without such a cell."""
        if self.start == "S":
            return cells_with(self.map, "S")[0]
        ice = cells_with(self.map, "S") + cells_with(self.map, "F")
        if self.start == "ice":
            return ice[self.rng.integers(len(ice))]
        if self.start == "rule_loses":
            reachable = goal_distances(self.map)
            cells = [cell for cell in ice
                     if reachable.get(cell, self.max_steps + 1) <= self.max_steps
                     and not rule_walk_wins(self.map, cell, self.max_steps)] or ice
            return cells[self.rng.integers(len(cells))]
        tested = {cell: range(len(self.actions)) if self.start == "beside_hole"
                  else self.moves_toward_goal(cell)
                  for cell in ice}
        cells = [cell for cell in ice
                 if any(walks_onto(self.map, cell, a) == "hole" for a in tested[cell])] or ice
        return cells[self.rng.integers(len(cells))]

    def moves_toward_goal(self, cell):
        """The moves that bring `cell` one step nearer the goal (on a firm map)."""
        goal_row, goal_col = cells_with(self.map, "G")[0]

        def distance(row, col):
            return abs(goal_row - row) + abs(goal_col - col)

        return [action for action in range(len(self.actions))
                if distance(*frozen_lake_slide(self.map, cell, action)) < distance(*cell)]

    def is_legal(self, action):
        return True  # every move is allowed; edges just stop you

    def move(self, action):
        if action is None:
            return 0.0, False  # the default action: stay put
        outcomes = frozen_lake_transitions(self.map, self.position, action, self.slippery)
        pick = (self.rng.choice(len(outcomes), p=[prob for prob, _ in outcomes])
                if len(outcomes) > 1 else 0)
        self.position = outcomes[pick][1]
        tile = self.map[self.position[0]][self.position[1]]
        return {"G": 1.0, "H": self.hole_penalty}.get(tile, 0.0), tile in "HG"

    def state_text(self):
        """The goal's offset, then the grid.

        The offset restates the map from where you stand: a small model reads it far more easily
        than it finds itself in the grid. Coordinates and a list of holes were dropped to keep the
        prompt short (results/NOTES.md).
        """
        row, col = self.position
        goal_row, goal_col = cells_with(self.map, "G")[0]
        grid = [["P" if (r, c) == self.position else ("F" if tile == "S" else tile)
                 for c, tile in enumerate(map_row)] for r, map_row in enumerate(self.map)]
        return (f"Goal: {offset_text(goal_row - row, goal_col - col)}.\n"
                f"Map (P = you, F = ice):\n{grid_text(grid)}")

    def observation(self):
        """The shared text, then what each move walks onto, last: right before the reply.

        With every decision labelled, SmolLM2-135M learned to read this line on unseen maps from
        fewer examples when it came last than when it came before the map
        (benchmarks/yardstick.py, results/yardstick).
        """
        return f"{super().observation()}\nNext to you: {neighbour_text(self.map, self.position)}."

    def state_info(self):
        tile = self.map[self.position[0]][self.position[1]]
        return {"position": self.position, "map": list(self.map), "slippery": self.slippery,
                "success": tile == "G"}


def probe_states(n_maps, first_seed, **options):
    """Fixed states for probing a Frozen Lake policy: (map_rows, position, observation_text) for
    every open cell (not H, not G) of the maps of seeds first_seed .. first_seed + n_maps - 1.

    The observation is what the game shows with you on that cell and the step counter at its
    start value; `options` are the game's (max_steps, size, slippery, ...). The seeds must be
    training seeds, so the held-out maps stay unseen. A map that several seeds share (a fixed
    `map` option) is probed once.
    """
    if first_seed < 0 or first_seed + n_maps > HELDOUT_SEED_START:
        raise ValueError(f"probe seeds must be training seeds, below {HELDOUT_SEED_START}")
    seeded = make("frozen_lake", **options)
    seeds = range(first_seed, first_seed + n_maps)
    # in order, once each
    maps = dict.fromkeys(tuple(seeded.reset(seed=seed)[1]["map"]) for seed in seeds)
    states = []
    for map_rows in maps:
        game = make("frozen_lake", **{**options, "map": list(map_rows)})
        game.reset(seed=0)
        for row, line in enumerate(map_rows):
            for col, tile in enumerate(line):
                if tile not in "HG":
                    game.position = (row, col)
                    states.append((map_rows, (row, col), game.observation()))
    return states


# ---- Snake, optionally with a second snake that moves at random among safe moves ----

SNAKE_ACTIONS = ["up", "right", "down", "left"]  # clockwise, so the reverse of a is (a + 2) % 4
SNAKE_STEPS = [(-1, 0), (0, 1), (1, 0), (0, -1)]


def next_cell(cell, direction):
    return (cell[0] + SNAKE_STEPS[direction][0], cell[1] + SNAKE_STEPS[direction][1])


def on_board(cell, size):
    return 0 <= cell[0] < size and 0 <= cell[1] < size


def snake_dies(head, body, grows, size, others):
    """Does a snake whose head moves to `head` die? A wall, its own body (the tail cell frees up
    this step unless the snake grows), or a cell in `others`."""
    own = body if grows else body[:-1]
    return not on_board(head, size) or head in own or head in others


# The fruits varied_rules may name; the board draws each as its first letter, upper case.
VARIED_FRUITS = ("apple", "banana", "cherry")
# Snake Poison Apple's combination, apples -1 with bananas +1, is never drawn: that game stays
# unseen in training, to test whether an agent reads rules rather than remembering them.
HELD_OUT_WORTHS = {("apple", -1.0), ("banana", 1.0)}


def varied_fruit_worths():
    """Every ((fruit, worth), ...) that varied_rules may draw: one fruit worth +1 or -1, alone or
    with a second fruit worth the opposite; never Snake Poison Apple's combination."""
    alone = [((fruit, worth),) for fruit in VARIED_FRUITS for worth in (1.0, -1.0)]
    pairs = [((fruit, worth), (second, -worth)) for ((fruit, worth),) in alone
             for second in VARIED_FRUITS if second != fruit]
    return tuple(draw for draw in alone + pairs if not HELD_OUT_WORTHS <= set(draw))


VARIED_WORTHS = varied_fruit_worths()


def worths_text(draw):
    """Standard Snake's sentence for each (fruit, worth); worths_text([("apple", 1.0)]) is its."""
    return " ".join(f"Eating {'an' if fruit[0] in 'aeiou' else 'a'} {fruit} gives {worth:+g} and"
                    " makes the snake one cell longer." for fruit, worth in draw)


class Snake(TextGame):
    name = "snake"
    actions = SNAKE_ACTIONS
    defaults = dict(size=10, apples=5, step_reward=0.0, max_steps=100, opponent=False,
                    invalid_penalty=-0.1, start="standard", varied_rules=False)
    # standard: the head at (3n/4, n/2), heading right, as held-out games start. facing_wall: the
    # head on a border cell the seed picks, heading out of the board, so a group's first move
    # decides whether it lives.
    # varied_rules: each game's rules say which fruits are on the board and what each is worth
    # (VARIED_WORTHS: an apple, banana or cherry worth +1 or -1, a second fruit the opposite or
    # absent; `apples` of each), drawn from the seed, so a group shares them; rewards follow them.
    starts = ("standard", "facing_wall")
    training_start = "facing_wall"
    apple_reward, banana_reward, death_reward = 1.0, 1.0, -1.0
    fruit_rules = "Eating an apple gives +1 and makes the snake one cell longer."
    fruit_names = ("apple", "banana")  # what the text calls the fruits of self.apples, self.bananas

    def __init__(self, **options):
        super().__init__(**options)
        # at least 5: room for two snakes
        self.size = positive_int("size", self.options["size"], minimum=5, maximum=MAX_BOARD_SIZE)
        # Each fruit takes a cell no snake starts on; more could never be placed (and billions
        # would keep reset looking for cells).
        snake_cells = 3 * (1 + boolean("opponent", self.options["opponent"]))
        free = self.size * self.size - snake_cells
        self.apple_count = positive_int("apples", self.options["apples"], minimum=0)
        self.banana_count = positive_int("bananas", self.options.get("bananas", 0), minimum=0)
        if self.apple_count + self.banana_count > free:
            fruit = "apples + bananas" if "bananas" in self.defaults else "apples"
            raise ValueError(f"option {fruit} must be at most {free}, the cells free of snakes "
                             f"on a {self.size}x{self.size} board, got "
                             f"{self.apple_count + self.banana_count}")
        self.varied_rules = boolean("varied_rules", self.options.get("varied_rules", False))
        if self.varied_rules and 2 * self.apple_count > free:  # as many of a second fruit may come
            raise ValueError(f"option apples must be at most {free // 2} with varied_rules on a "
                             f"{self.size}x{self.size} board, got {self.apple_count}")
        self.step_reward = finite_float("step_reward", self.options["step_reward"])
        self.has_opponent = boolean("opponent", self.options["opponent"])
        self.start = self.options["start"]
        if self.start not in self.starts:
            raise ValueError(f"option start must be one of {', '.join(self.starts)}, "
                             f"got {self.start!r}")
        self.rules = self.rules_text(self.fruit_rules)
        if self.varied_rules:  # until reset draws them: the longest, which the space must hold
            self.rules = max(map(self.rules_text, map(worths_text, VARIED_WORTHS)), key=len)
        self.declare_spaces(self.size * self.size)

    def rules_text(self, fruit_rules):
        hazards = ("a wall, your own body or the other snake" if self.has_opponent
                   else "a wall or your own body")
        return (f"Snake on a {self.size}x{self.size} board: each step your snake moves one cell in"
                f" the direction you choose. {fruit_rules} Running into {hazards} ends"
                " the game with -1. You cannot turn back into your own neck.")

    def draw_fruit_rules(self):
        """varied_rules: this game's fruits and worths, from its seed; a second fruit lives where
        Poison Apple keeps its bananas."""
        draw = VARIED_WORTHS[self.rng.integers(len(VARIED_WORTHS))]
        # Without a second fruit its slot stays empty, as in standard Snake.
        (first, self.apple_reward), (second, self.banana_reward) = (draw + (("banana", 0.0),))[:2]
        self.fruit_names = (first, second)
        self.banana_count = self.apple_count * (len(draw) - 1)
        self.rules = self.rules_text(worths_text(draw))

    def new_game(self, seed):
        if self.varied_rules:
            self.draw_fruit_rules()
        # The opponent starts in the upper half, heading left; [] once it has been boxed in.
        row, col = self.size // 4, self.size // 2
        self.opponent = [(row, col - 1), (row, col), (row, col + 1)] if self.has_opponent else None
        self.opponent_direction = 3
        self.snake, self.direction = self.start_snake()
        self.apples, self.bananas = [], []
        for _ in range(self.apple_count):
            self.spawn(self.apples)
        for _ in range(self.banana_count):
            self.spawn(self.bananas)
        self.apples_eaten = self.bananas_eaten = 0
        self.died = False

    def start_snake(self):
        """(cells head first, direction) of a new game's snake, three cells long in a straight
        line."""
        if self.start == "standard":
            row, col = self.size * 3 // 4, self.size // 2
            return [(row, col), (row, col - 1), (row, col - 2)], 1
        starts = []  # every border cell, with every direction that leads off the board from it
        for row in range(self.size):
            for col in range(self.size):
                for direction in range(4):
                    if on_board(next_cell((row, col), direction), self.size):
                        continue
                    back = (direction + 2) % 4
                    body = [(row, col), next_cell((row, col), back)]
                    body.append(next_cell(body[1], back))
                    if not set(body) & set(self.opponent or []):
                        starts.append((body, direction))
        return starts[self.rng.integers(len(starts))]

    def spawn(self, fruits):
        """Put one fruit on a random free cell (none if the board is full)."""
        taken = set(self.snake) | set(self.opponent or []) | set(self.apples) | set(self.bananas)
        free = [(r, c) for r in range(self.size) for c in range(self.size) if (r, c) not in taken]
        if free:
            fruits.append(free[self.rng.integers(len(free))])

    def fruit_at(self, cell):
        return "apple" if cell in self.apples else "banana" if cell in self.bananas else None

    def advance(self, body, head):
        """Move a snake's head to `head`; it grows if it eats, and the fruit grows back
        elsewhere."""
        fruit = self.fruit_at(head)
        body.insert(0, head)
        if fruit is None:
            body.pop()
            return None
        fruits = self.apples if fruit == "apple" else self.bananas
        fruits.remove(head)
        self.spawn(fruits)
        return fruit

    def is_legal(self, action):
        return action != (self.direction + 2) % 4

    def move(self, action):
        if action is not None:  # None: the default action, keep going
            self.direction = action
        head = next_cell(self.snake[0], self.direction)
        grows = self.fruit_at(head) is not None
        if snake_dies(head, self.snake, grows, self.size, set(self.opponent or [])):
            self.died = True
            return self.step_reward + self.death_reward, True
        fruit = self.advance(self.snake, head)
        self.apples_eaten += fruit == "apple"
        self.bananas_eaten += fruit == "banana"
        self.move_opponent()
        reward = {"apple": self.apple_reward, "banana": self.banana_reward, None: 0.0}[fruit]
        return self.step_reward + reward, False

    def move_opponent(self):
        """The second player's fixed policy: a uniformly random safe move (it eats fruit too)."""
        if not self.opponent:
            return
        safe = []
        for direction in range(4):
            head = next_cell(self.opponent[0], direction)
            grows = self.fruit_at(head) is not None
            if direction != (self.opponent_direction + 2) % 4 and not snake_dies(
                    head, self.opponent, grows, self.size, set(self.snake)):
                safe.append(direction)
        if not safe:
            self.opponent = []  # boxed in: it leaves the board
            return
        self.opponent_direction = safe[self.rng.integers(len(safe))]
        self.advance(self.opponent, next_cell(self.opponent[0], self.opponent_direction))

    def state_text(self):
        """The heading, where the nearest fruit lies from the head, then the board.

        No coordinate lists: the offset says from the head where the fruit is, as Frozen Lake's
        goal offset does, and the board shows the rest; each list cost about 3 tokens a cell.
        """
        first, second = self.fruit_names
        lines = [f"You are moving {self.actions[self.direction]}; your snake is "
                 f"{len(self.snake)} cells long.",
                 f"Nearest {first}: {nearest_offset(self.snake[0], self.apples)}."]
        if self.banana_count:
            lines.append(f"Nearest {second}: {nearest_offset(self.snake[0], self.bananas)}.")
        grid = [["."] * self.size for _ in range(self.size)]
        for symbol, cells in [(first[0].upper(), self.apples), (second[0].upper(), self.bananas),
                              ("X", self.opponent or []),
                              ("S", self.snake[1:]), ("H", [self.snake[0]])]:
            for r, c in cells:
                grid[r][c] = symbol
        legend = (f"H = your head, S = your body, {first[0].upper()} = {first}"
                  + (f", {second[0].upper()} = {second}" if self.banana_count else "")
                  + (", X = other snake" if self.opponent is not None else ""))
        lines.append(f"Board ({legend}, . = empty):\n{grid_text(grid)}")
        return "\n".join(lines)

    def neighbours(self):
        """What each move's cell holds: wall, your neck (the move not allowed), your body, your tail
        (it moves on this step, so the cell is safe), other snake, apple, banana or empty."""
        names = []
        for direction in range(4):
            cell = next_cell(self.snake[0], direction)
            if not on_board(cell, self.size):
                names.append("wall")
            elif cell == self.snake[1]:
                names.append("your neck (not allowed)")
            elif cell == self.snake[-1]:
                names.append("your tail")
            elif cell in self.snake:
                names.append("your body")
            elif cell in (self.opponent or []):
                names.append("other snake")
            else:
                slot = self.fruit_at(cell)
                names.append(self.fruit_names[slot == "banana"] if slot else "empty")
        return names

    def observation(self):
        """The shared text, then what each move runs into, last: right before the reply, as in
        Frozen Lake, where a small model learned to read such a line from fewer examples there."""
        line = ", ".join(f"{move} {what}" for move, what in zip(self.actions, self.neighbours()))
        return f"{super().observation()}\nNext to your head: {line}."

    def state_info(self):
        return {"snake": list(self.snake), "direction": self.actions[self.direction],
                "apples": list(self.apples), "bananas": list(self.bananas),
                "opponent": None if self.opponent is None else list(self.opponent),
                "size": self.size, "apple_reward": self.apple_reward,
                "banana_reward": self.banana_reward, "fruit_names": list(self.fruit_names),
                "apples_eaten": self.apples_eaten, "bananas_eaten": self.bananas_eaten,
                "died": self.died, "success": self.done and not self.died}


def nearest_offset(head, cells):
    """'2 up, 1 right' to the nearest of `cells` (fewest moves; the first listed on a tie), or
    'none'."""
    if not cells:
        return "none"
    row, col = min(cells, key=lambda cell: abs(cell[0] - head[0]) + abs(cell[1] - head[1]))
    return offset_text(row - head[0], col - head[1])


class SnakePoisonApple(Snake):
    """The same board, but apples cost -1 and the rules say so: does the agent read the rules?"""

    name = "snake_poison_apple"
    defaults = {**{key: value for key, value in Snake.defaults.items() if key != "varied_rules"},
                "bananas": 0}
    apple_reward = -1.0
    fruit_rules = ("The apples are poisoned: eating one gives -1 (the snake still grows)."
                   " Eating a banana gives +1 and makes the snake one cell longer.")


# ---- The factory ----

GAMES = {"frozen_lake": FrozenLake, "snake": Snake, "snake_poison_apple": SnakePoisonApple}
ENV_NAMES = tuple(GAMES)


def make(name, **options):
    """envs.make("frozen_lake", slippery=True): a game by name, with its options."""
    if name not in GAMES:
        raise ValueError(f"unknown env {name!r}; valid envs: {', '.join(ENV_NAMES)}")
    return GAMES[name](**options)


# gymnasium.make(GYMNASIUM_IDS[name], **options) makes the same game as make(name, **options).
GYMNASIUM_IDS = {"frozen_lake": "msgrpo/FrozenLake-v0", "snake": "msgrpo/Snake-v0",
                 "snake_poison_apple": "msgrpo/SnakePoisonApple-v0"}


def register_with_gymnasium():
    """Register every game under its GYMNASIUM_IDS id, once (a reloaded module finds them there).
    No max_episode_steps: a game ends itself at its max_steps option."""
    for name, gymnasium_id in GYMNASIUM_IDS.items():
        if gymnasium_id not in gymnasium.registry:
            gymnasium.register(gymnasium_id, entry_point=f"{__name__}:{GAMES[name].__name__}")


register_with_gymnasium()


# ---- Evaluation: the one harness that plays any agent on any game ----


def wilson_interval(successes, n, z=1.96):
    """95% Wilson score interval of a success rate; sound near 0 and 1, unlike p +- z*se."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, center - half), min(1.0, center + half))


def mean_ci95(values):
    """Mean and normal-approximation 95% interval (mean +- 1.96 standard errors)."""
    values = np.asarray(values, dtype=float)
    mean = float(values.mean())
    se = float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else 0.0
    return mean, [mean - 1.96 * se, mean + 1.96 * se]


def agent_responses(agent, observations, infos):
    """Ask a batched agent once, or a plain agent once per episode."""
    if hasattr(agent, "act_batch"):
        responses = list(agent.act_batch(observations, infos))
        if len(responses) != len(observations):
            raise ValueError(f"act_batch returned {len(responses)} responses for "
                             f"{len(observations)} prompts")
        return responses
    return [agent.act(obs, info) for obs, info in zip(observations, infos)]


def play_batch(agent, env_name, seeds, env_options, bar):
    """Play one episode per seed, all in lockstep: one agent call per step for every live
    episode."""
    games = [make(env_name, **env_options) for _ in seeds]
    observations, infos = zip(*[game.reset(seed=seed) for game, seed in zip(games, seeds)])
    observations, infos = list(observations), list(infos)
    episodes = [{"return": 0.0, "steps": 0, "invalid": 0} for _ in seeds]
    live = list(range(len(seeds)))
    while live:
        responses = agent_responses(agent, [observations[i] for i in live],
                                    [infos[i] for i in live])
        still_live = []
        for i, response in zip(live, responses):
            obs, reward, terminated, truncated, info = games[i].step(
                games[i].parse_action(response))
            observations[i], infos[i] = obs, info
            episodes[i]["return"] += reward
            episodes[i]["steps"] += 1
            episodes[i]["invalid"] += info["invalid"]
            if terminated or truncated:
                episodes[i].update(success=info["success"], apples=info.get("apples_eaten", 0),
                                   died=info.get("died", False))
                bar.update(1)
            else:
                still_live.append(i)
        live = still_live
    return episodes


# The averages `evaluate` reports, each with the key of its 95% interval (apples: Snake only).
INTERVAL_OF = {"success_rate": "success_ci95", "mean_return": "return_ci95",
               "mean_apples": "apples_ci95"}


def score_keys(env_name):
    """What a game is judged by, as (metric, its 95% interval): Frozen Lake's success, Snake's
    return."""
    score = "success_rate" if env_name == "frozen_lake" else "mean_return"
    return score, INTERVAL_OF[score]


def evaluate(agent, env_name, seeds, batch_size=64, progress=False, **env_options):
    """Play `agent` on one episode per seed; return plain-Python metrics (JSON-ready).

    An agent has `act(obs_text, info) -> str` or `act_batch(observations, infos) -> list[str]`
    (preferred: `batch_size` episodes step in lockstep). Responses go through `parse_action`.
    """
    seeds = [int(seed) for seed in seeds]
    if not seeds:
        raise ValueError("evaluate needs at least one seed")
    episodes = []
    with tqdm(total=len(seeds), desc=f"eval {env_name}", disable=not progress) as bar:
        for start in range(0, len(seeds), batch_size):
            episodes += play_batch(agent, env_name, seeds[start:start + batch_size], env_options,
                                   bar)
    n = len(episodes)
    wins = sum(e["success"] for e in episodes)
    mean_return, return_ci = mean_ci95([e["return"] for e in episodes])
    total_steps = sum(e["steps"] for e in episodes)
    result = {
        "env": env_name, "env_options": make(env_name, **env_options).options,
        "seed_min": min(seeds), "seed_max": max(seeds), "episodes": n,
        "success_rate": wins / n, "success_ci95": list(wilson_interval(wins, n)),
        "mean_return": mean_return, "return_ci95": return_ci,
        "invalid_rate": sum(e["invalid"] for e in episodes) / total_steps,
        "mean_steps": total_steps / n,
    }
    if env_name == "frozen_lake":  # which maps were won, to compare policies map by map
        result["won_seeds"] = [seed for seed, e in zip(seeds, episodes) if e["success"]]
    else:
        mean_apples, apples_ci = mean_ci95([e["apples"] for e in episodes])
        deaths = sum(e["died"] for e in episodes)
        result.update(mean_apples=mean_apples, apples_ci95=apples_ci, deaths=deaths,
                      death_rate=deaths / n)
    return result
