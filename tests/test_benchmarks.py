"""The benchmark scripts: the ablation's runs, evaluations and table; the fixed-route reference;
the supervised yardstick for observation wordings."""

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import ablation  # noqa: E402
import fixed_routes  # noqa: E402
import prompt_probe  # noqa: E402
import snake_deaths  # noqa: E402
import yardstick  # noqa: E402
import msgrpo  # noqa: E402
import support  # noqa: E402
import envs  # noqa: E402


def run_row(sampling, seed, wins, episodes, minutes, tokens):
    result = {"episodes": episodes, "success_rate": wins / episodes,
              "success_ci95": list(envs.wilson_interval(wins, episodes)), "invalid_rate": 0.0}
    return {"sampling": sampling, "seed": seed, "think": False, "iterations": 12,
            "train_minutes": minutes, "env_steps": tokens // 10, "tokens_trained": tokens,
            "train_tokens_per_second": tokens / minutes / 60,
            "greedy": result, "sampled": result}


def test_seeds_pool_their_episodes():
    rows = [run_row("aaw", 0, 30, 100, 10.0, 1000), run_row("aaw", 1, 10, 50, 20.0, 3000),
            run_row("all", 0, 5, 100, 30.0, 9000)]
    text = ablation.table(rows, "sampling", ["aaw", "uniform", "all"])
    lo, hi = envs.wilson_interval(40, 150)
    assert (f"| **aaw, seeds pooled** | 2 | {40 / 150:.3f} [{lo:.3f}, {hi:.3f}]"
            in text)  # not (0.3 + 0.2) / 2
    # means over the seeds: minutes, steps, tokens, tokens/s (1.7, 2.5)
    assert "| 15.0 | 200 | 2,000 | 2 |" in text
    # one seed: no pooled row; none: no row
    assert "all, seeds pooled" not in text and "uniform" not in text
    assert text.count("\n") == 2 + 3 + 1 - 1


def test_a_fixed_route_wins_the_maps_where_it_is_hole_free():
    assert fixed_routes.route_cells("RRRDDD") == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 3), (2, 3),
                                                  (3, 3)]
    clear = ["SFFF", "HHHF", "FFFF", "FFFG"]  # the top row and right column are ice
    blocked = ["SFFH", "FFFF", "FFFF", "FFFG"]
    assert fixed_routes.clear_fraction("RRRDDD", [clear, blocked]) == 0.5
    # DDDRRR: (1, 0) is a hole in `clear`; the hole of `blocked` is off its route.
    assert fixed_routes.clear_fraction("DDDRRR", [clear, blocked]) == 0.5
    assert fixed_routes.clear_fraction("DDDRRR", [clear]) == 0.0


def test_the_neighbour_rule_steps_around_holes_a_fixed_route_falls_into():
    detour = ["SFFF", "FFFF", "HFFF", "FFFG"]  # down, then the hole below: right, then down again
    assert fixed_routes.clear_fraction("DDDRRR", [detour]) == 0.0
    assert fixed_routes.neighbour_rule_wins(detour, "down", "right")
    trapped = ["SFFF", "HFFF", "FFFF", "FFFG"]  # a hole below the start: one step right, then down
    assert fixed_routes.neighbour_rule_wins(trapped, "down", "right")
    cornered = ["SH", "HG"]  # both moves are holes: it takes the second, right, into the hole
    assert not fixed_routes.neighbour_rule_wins(cornered, "down", "right")
    stuck = ["SFH", "FHF", "HFG"]  # right to (0, 1), where right and down are both holes
    assert not fixed_routes.neighbour_rule_wins(stuck, "right", "down")


class NeighbourRuleAgent:
    def act(self, observation, info):
        return envs.FROZEN_LAKE_ACTIONS[envs.rule_move(info["map"], info["position"])]


def test_played_as_an_agent_the_neighbour_rule_wins_its_own_maps_and_no_others(tmp_path):
    seeds = envs.heldout_seeds(40)
    result = envs.evaluate(NeighbourRuleAgent(), "frozen_lake", seeds)
    assert result["won_seeds"] == [seed for seed in seeds if fixed_routes.neighbour_rule_wins(
        envs.make("frozen_lake").reset(seed=int(seed))[1]["map"], "down", "right")]
    table = fixed_routes.against_the_rule(result["won_seeds"], seeds)
    assert table["policy_wins_those"] == table["policy_loses_those"] == 0
    assert (table["rule_wins"] == len(result["won_seeds"])
            and table["rule_loses"] == 40 - table["rule_wins"] > 0)
    everything = fixed_routes.against_the_rule(seeds, seeds)  # a policy that wins every map
    assert everything["policy_wins_those"] == table["rule_loses"]


def test_a_rule_that_reads_only_below_it_still_walks_right_into_holes_on_the_probe():
    # ("down", "right") plays right wherever down is blocked, whatever lies to the right; the rule
    # that falls back to left and up as well never walks into a hole it is shown, if it has another
    # move.
    assert (envs.rule_move(["SH", "FG"], (0, 0), ("down", "right"))
            == envs.FROZEN_LAKE_ACTIONS.index("down"))
    cornered = ["FSH", "FHG"]  # at S both down and right walk into a hole
    assert (envs.rule_move(cornered, (0, 1), ("down", "right"))
            == envs.FROZEN_LAKE_ACTIONS.index("right"))
    assert envs.rule_move(cornered, (0, 1), ("down", "right", "left", "up")) == 0  # left
    down_only, both = (fixed_routes.rule_on_the_probe(rule)
                       for rule in (("down", "right"), fixed_routes.RULES[-1]))
    assert down_only["probe_down_hole"] == 0 and down_only["probe_right_hole"] > 0
    assert both["probe_down_hole"] == both["probe_right_hole"] == 0
    # where right is ice the two agree
    assert down_only["probe_right_ice"] == both["probe_right_ice"]


def test_the_probe_groups_a_moves_probability_by_what_it_walks_onto():
    map_rows = ("SF", "HG")
    down, right = envs.FROZEN_LAKE_ACTIONS.index("down"), envs.FROZEN_LAKE_ACTIONS.index("right")
    probabilities = {
        (map_rows, (0, 0)): (np.array([0.1, 0.2, 0.3, 0.0]), None),  # down: hole, right: ice
        (map_rows, (0, 1)): (np.array([0.0, 0.6, 0.2, 0.1]), None)}  # down: goal, right: edge
    assert prompt_probe.by_neighbour(probabilities, down) == {"hole": (0.2, 1), "goal": (0.6, 1)}
    assert prompt_probe.by_neighbour(probabilities, right) == {"ice": (0.3, 1), "edge": (0.2, 1)}


def test_the_probe_shows_every_move_where_down_is_blocked():
    map_rows = ("SFF", "HFH", "FFG")
    probabilities = {
        (map_rows, (0, 0)): (np.array([0.1, 0.2, 0.3, 0.4]), None),  # down: hole, right: ice
        (map_rows, (1, 1)): (np.array([0.0, 0.5, 0.5, 0.0]), None),  # down: ice, so left out
        (map_rows, (2, 0)): (np.array([0.3, 0.2, 0.5, 0.0]), None),  # down: edge, right: ice
        (map_rows, (2, 1)): (np.array([0.0, 0.0, 1.0, 0.0]), None)}  # down: edge, right: goal
    blocked = prompt_probe.where_down_is_blocked(probabilities)
    assert sorted(blocked) == ["goal", "ice"]
    assert blocked["ice"][1] == 2 and np.allclose(blocked["ice"][0], [0.2, 0.2, 0.4, 0.2])
    assert blocked["goal"][1] == 1 and np.allclose(blocked["goal"][0], [0, 0, 1, 0])


def test_ablation_trains_evaluates_and_reuses_its_runs(tmp_path):
    args = ["algo", "msgrpo", "--seeds", "0", "--model", "tiny", "--iterations", "1",
            "--greedy-episodes", "2", "--sampled-episodes", "3", "--runs", str(tmp_path / "runs"),
            "--out", str(tmp_path / "out")]
    ablation.main(args)
    kept = tmp_path / "out" / "msgrpo-s0"
    evals = json.loads((kept / "eval.json").read_text())
    assert (evals[-1]["iteration"] == 1 and evals[-1]["episodes"] == 2
            and evals[-1]["sampled"]["episodes"] == 3)
    assert len((kept / "metrics.jsonl").read_text().splitlines()) == 1
    assert "| msgrpo | 0 |" in (tmp_path / "out" / "ablation.md").read_text()
    rows = json.loads((tmp_path / "out" / "ablation.json").read_text())
    assert [(r["algo"], r["seed"], r["iterations"]) for r in rows] == [("msgrpo", 0, 1)]
    metrics = support.read_metrics(kept)
    config = json.loads((kept / "config.json").read_text())
    episodes = config["groups"] * config["group_size"]
    assert rows[0]["env_steps"] == round(metrics[0]["mean_steps"] * episodes)

    run_files = sorted((tmp_path / "runs" / "msgrpo-s0").rglob("*"))
    before = {p: p.stat().st_mtime_ns for p in run_files if p.is_file()}
    ablation.main(args)  # trained and evaluated already: nothing is redone
    assert {p: p.stat().st_mtime_ns for p in run_files if p.is_file()} == before

    # A run of another value kept from an earlier command stays in the table, after the values named
    # now.
    other = tmp_path / "out" / "poad-s0"
    shutil.copytree(kept, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "algo": "poad"}))
    ablation.write_table(tmp_path / "out", "algo", ["msgrpo"], think=False)
    rows = json.loads((tmp_path / "out" / "ablation.json").read_text())
    assert [(r["algo"], r["seed"]) for r in rows] == [("msgrpo", 0), ("poad", 0)]


def test_think_runs_get_their_own_folder_and_long_replies(tmp_path, monkeypatch):
    trained_configs = []
    monkeypatch.setattr(ablation.baselines, "train_poad",
                        lambda cfg, resume: trained_configs.append(cfg))
    args = argparse.Namespace(model="tiny", iterations=1, think=True)
    run_dir = ablation.train_run("algo", "poad", 3, tmp_path, args)
    assert run_dir == tmp_path / "poad-think-s3"
    [cfg] = trained_configs
    assert ((cfg.algo, cfg.seed, cfg.think, cfg.max_new_tokens, cfg.run_dir)
            == ("poad", 3, True, 256, str(run_dir)))


def test_ablation_runs_take_the_settings_given_and_msgrpos_defaults_otherwise(tmp_path,
                                                                               monkeypatch):
    trained_configs = []
    monkeypatch.setattr(ablation.msgrpo, "train", lambda cfg, resume: trained_configs.append(cfg))
    args = argparse.Namespace(model="tiny", iterations=12, think=False, groups=2, minibatch=32,
                              lr=3e-4)
    ablation.train_run("sampling", "uniform", 1, tmp_path, args)
    args.groups = args.minibatch = args.lr = None
    ablation.train_run("sampling", "all", 1, tmp_path, args)
    given, defaults = trained_configs
    assert (given.sampling, given.groups, given.minibatch, given.lr) == ("uniform", 2, 32, 3e-4)
    plain = msgrpo.resolve_defaults(msgrpo.Config(model="tiny"))
    assert ((defaults.sampling, defaults.groups, defaults.minibatch, defaults.lr)
            == ("all", plain.groups, plain.minibatch, plain.lr))


class AlwaysSays:
    def __init__(self, reply):
        self.reply = reply

    def act_batch(self, observations, infos):
        return [self.reply] * len(observations)


def test_snake_deaths_tell_a_blunder_into_the_wall_from_a_trap():
    # The standard 6x6 start: head (4, 3) heading right. Going up, the head reaches row 0 after
    # four steps and dies on the fifth, into the wall, with left and right still open.
    deaths = snake_deaths.play(AlwaysSays("<action>up</action>"), [7], size=6, max_steps=30,
                               apples=0)
    assert deaths == [{"seed": 7, "step": 5, "invalid": False, "into": "wall",
                       "moves_that_lived": 2}]
    # A snake of five coiled with its head at (1, 1) heading down: turning right hits its body.
    info = {"size": 6, "snake": [(1, 1), (0, 1), (0, 2), (1, 2), (2, 2)], "direction": "down",
            "apples": [], "bananas": [], "opponent": None}
    assert snake_deaths.death_of(info, envs.SNAKE_ACTIONS.index("right")) == {
        "into": "body", "moves_that_lived": 2}
    # Boxed in a corner: every move but the reversal dies, so none lived.
    info = {"size": 6, "snake": [(0, 0), (1, 0), (1, 1), (0, 1), (0, 2)], "direction": "up",
            "apples": [], "bananas": [], "opponent": None}
    assert snake_deaths.death_of(info, envs.SNAKE_ACTIONS.index("left")) == {
        "into": "wall", "moves_that_lived": 0}
    table = snake_deaths.table(deaths, episodes=1)
    assert "1 deaths in 1 games" in table and "| wall | yes | no | 1 |" in table


def test_yardstick_states_follow_the_neighbour_rule_are_balanced_and_on_unseen_maps():
    heldout = yardstick.heldout_states(60)
    train = yardstick.training_states(40, 0, {s.map_rows for s in heldout})
    assert [s.label for s in train].count("down") == [s.label for s in train].count("right") == 20
    # shuffled, not one label after the other
    assert {s.label for s in train[:20]} == {"down", "right"}
    assert {s.label for s in heldout} == {"down", "right"}
    down = envs.FROZEN_LAKE_ACTIONS.index("down")
    for s in train + heldout:
        assert s.map_rows[s.position[0]][s.position[1]] in "SF"  # never on a hole or the goal
        down_blocked = envs.walks_onto(s.map_rows, s.position, down) in {"hole", "edge"}
        assert s.label == ("right" if down_blocked else "down")
    assert not {s.map_rows for s in train} & {s.map_rows for s in heldout}
    assert yardstick.heldout_states(60) == heldout  # the same held-out states for every run


def test_every_yardstick_wording_says_what_each_move_walks_onto():
    # left ice, down hole, right ice, up edge
    map_rows, position = ("SFFF", "FHFH", "FFFH", "HFFG"), (0, 1)
    game = envs.make("frozen_lake", map=list(map_rows))
    game.reset(seed=0)
    game.position, game.steps = position, 4
    assert (yardstick.WORDINGS["neighbour line last (the game)"](map_rows, position, 12)
            == game.observation())
    game_lines = game.observation().splitlines()
    legend = next(i for i, line in enumerate(game_lines) if line.startswith("Map"))
    map_lines = game_lines[legend:legend + 1 + len(map_rows)]
    shared = [line for line in game_lines
              if not line.startswith("Next to you") and line not in map_lines]
    for name, wording in yardstick.WORDINGS.items():
        text = wording(map_rows, position, 12)
        lines = text.splitlines()
        for move, onto in zip(envs.FROZEN_LAKE_ACTIONS, ["ice", "hole", "ice", "edge"]):
            assert f"{move} {onto}" in text or f"{move}: {onto}" in lines, (name, move)
        assert all(line in lines for line in shared), name  # rules, actions, goal, steps left
        has_map = all(line in lines for line in map_lines)
        assert has_map == (name != "one line per move, no map"), name
        assert "Steps left: 12." in lines
    assert game.observation().endswith("Next to you: left ice, down hole, right ice, up edge.")
    first = yardstick.WORDINGS["neighbour line first"](map_rows, position, 12).splitlines()
    assert (first[3] == "Next to you: left ice, down hole, right ice, up edge."
            and first[-1] == "Steps left: 12.")
    assert yardstick.WORDINGS["one line per move"](map_rows, position, 12).endswith(
        "Steps left: 12.\nleft: ice\ndown: hole\nright: ice\nup: edge")


def test_snake_yardstick_labels_are_safe_balanced_and_straight_unless_deadly():
    import baselines
    import yardstick_snake

    train = yardstick_snake.states(40, yardstick_snake.TRAIN_SEED, 0, balanced=True)
    assert sum(s.straight_deadly for s in train) == 20
    assert {s.straight_deadly for s in train[:20]} == {True, False}  # shuffled
    for s in train:
        label = envs.SNAKE_ACTIONS.index(s.label)
        heading = envs.SNAKE_ACTIONS.index(s.observation.split("You are moving ")[1].split(";")[0])
        assert label in s.safe and (label == heading) != s.straight_deadly
        named = s.observation.split("Next to your head: ")[1].rstrip(".").split(", ")
        deadly = {envs.SNAKE_ACTIONS.index(pair.split(" ")[0]) for pair in named
                  if pair.split(" ", 1)[1] in ("wall", "your body", "your neck (not allowed)")}
        assert deadly == set(range(4)) - s.safe  # the line names exactly the moves the label avoids
    # a hand-made state: heading up on the top row, so straight on is the wall
    game = envs.make("snake", size=6, apples=0, max_steps=5)
    _, info = game.reset(seed=0)
    info = {**info, "snake": [(0, 2), (1, 2), (2, 2)], "direction": "up"}
    assert set(baselines.snake_safe_moves(info)) == {1, 3}


def test_snake_yardstick_trains_and_writes_its_table(tmp_path):
    import yardstick_snake

    rows = yardstick_snake.main(["--model", "tiny", "--states", "32", "--eval-states", "16",
                                 "--eval-every", "16", "--out", tmp_path])
    assert [r["states_seen"] for r in rows] == [0, 16, 32]
    assert all(0 <= r[key] <= 1 for r in rows
               for key in ("safe", "safe_straight_deadly", "safe_straight_open",
                           "unsafe_probability"))
    text = (tmp_path / "yardstick.md").read_text()
    assert "| 32 |" in text and "python benchmarks/yardstick_snake.py --model tiny" in text


def test_yardstick_trains_each_wording_and_rerun_wordings_replace_their_rows(tmp_path):
    yardstick.main(["--model", "tiny", "--states", "32", "--eval-states", "16",
                    "--eval-every", "16",
                    "--wordings", "neighbour line first", "one line per move", "--out", tmp_path])
    rows = json.loads((tmp_path / "yardstick.json").read_text())["rows"]
    assert [(r["wording"], r["states_seen"]) for r in rows] == [
        ("neighbour line first", 0), ("neighbour line first", 16), ("neighbour line first", 32),
        ("one line per move", 0), ("one line per move", 16), ("one line per move", 32)]
    for r in rows:
        assert r["states"] == 16 and 0 < r["blocked"] < 16 and r["prompt_tokens"] > 0
        assert all(0 <= r[key] <= 1
                   for key in ("accuracy", "accuracy_blocked", "accuracy_open", "mean_p_down"))
    text = (tmp_path / "yardstick.md").read_text()
    assert "| neighbour line first | 32 |" in text and "| one line per move | 32 |" in text
    assert "python benchmarks/yardstick.py --model tiny" in text

    rerun = {**rows[0], "accuracy": 0.5,
             "command": "python benchmarks/yardstick.py --wordings 'neighbour line first'"}
    # that wording again: its rows go, the other wording's stay
    yardstick.write_outputs(tmp_path, [rerun])
    rows = json.loads((tmp_path / "yardstick.json").read_text())["rows"]
    assert [(r["wording"], r["states_seen"]) for r in rows] == [
        ("neighbour line first", 0), ("one line per move", 0), ("one line per move", 16),
        ("one line per move", 32)]
    text = (tmp_path / "yardstick.md").read_text()
    assert ("| neighbour line first | 0 | 0.500 |" in text
            and text.count("    python benchmarks/yardstick.py") == 2)


def test_detour_yardstick_labels_start_shortest_paths_and_half_need_a_detour():
    import yardstick_detour

    # SFF / FFF / FHG from (1, 0): the rule goes down, into the pocket (2, 0) whose only way on is
    # the hole; right, right, down is the shortest way. From (0, 1) down is on a shortest path.
    pocket = ("SFF", "FFF", "FHG")
    right, down = (envs.FROZEN_LAKE_ACTIONS.index(move) for move in ("right", "down"))
    assert yardstick_detour.shortest_path_moves(pocket, (1, 0)) == {right}
    assert yardstick_detour.shortest_path_moves(pocket, (0, 1)) == {down, right}
    heldout, heldout_maps = yardstick_detour.states(40, yardstick.HELDOUT_MAP_SEED, 0)
    train, train_maps = yardstick_detour.states(40, yardstick.TRAIN_MAP_SEED, 0, heldout_maps)
    assert sum(s.detour for s in train) == sum(s.detour for s in heldout) == 20
    assert {s.detour for s in train[:10]} == {True, False}  # shuffled
    assert not train_maps & heldout_maps
    for s in train + heldout:
        assert envs.FROZEN_LAKE_ACTIONS.index(s.label) in s.optimal
        assert (s.detour == (s.rule_move not in s.optimal)
                and s.observation.startswith("Frozen Lake"))
    rows = yardstick_detour.main(["--model", "tiny", "--states", "32", "--eval-states", "16",
                                  "--eval-every", "16"])
    assert [r["states_seen"] for r in rows] == [0, 16, 32] and rows[0]["detours"] == 8
    rules = yardstick_detour.rule_scores(heldout)
    assert rules["down unless hole or edge, else right"][0] == 0  # by definition of a detour
    assert rules["down unless hole or edge, else right"][1] == 1
    assert all(0 <= r[key] <= 1 for r in rows
               for key in ("optimal", "optimal_detour", "optimal_beyond_rules",
                           "optimal_elsewhere"))
    assert 0 < rows[0]["beyond_rules"] < rows[0]["detours"]


def test_bench_cpu_times_the_plain_path_and_the_speed_ups_side_by_side(tmp_path):
    import bench_cpu

    out = tmp_path / "bench.md"
    results = bench_cpu.main(["--model", "tiny", "--groups", "1", "--group-size", "4",
                              "--max-steps", "2", "--repeats", "1", "--out", str(out)])
    table = out.read_text()
    assert "| measure | plain | speed-ups |" in table
    measures = ["(a) rollout step", "(b) trained step", "(b) peak memory while training",
                "(c) peak memory, a first iteration's varied steps", "(b) gradient norm"]
    rows = [line for line in table.splitlines() if line.startswith("| (")]
    assert len(rows) == len(measures)
    for row, measure in zip(rows, measures):
        assert row.startswith(f"| {measure}"), (row, measure)
    assert all(row.count(" | ") == 2 for row in rows)  # measure | plain | speed-ups
    assert table.count("x**)") == 4  # plain / speed-ups on the speed-ups column: times and memory
    assert "Each side in a process of its own." in table
    assert set(results) == {"plain", "speed-ups"}
    assert all(r["rollout"] > 0 and r["trained"] > 0 and r["peak_mb"] > 100
               for r in results.values())
    # Each side trained in its own process, the speed-ups on the steps the plain side played.
    plain, fast = results["plain"]["grad_norm"], results["speed-ups"]["grad_norm"]
    assert plain > 0 and abs(plain - fast) <= 1e-3 * plain  # the same steps, the same numbers
    # The system prompt, rules and action list.
    assert int(table.split(" tokens, ")[1].split(" shared")[0]) > 50


def test_gpu_check_runs_one_iteration_of_a_qwen_shaped_model_and_writes_its_table(tmp_path):
    import gpu_check

    out = tmp_path / "gpu.md"
    rows = gpu_check.main(["--layers", "1", "--groups", "1", "--group-size", "2",
                           "--max-steps", "1", "--eval-batch", "2", "--out", str(out)])
    table = out.read_text()
    for phase in ["load", "rollout", "update", "evaluation"]:
        assert f"| {phase} |" in table, phase
        assert rows[phase]["seconds"] > 0 and rows[phase]["peak_gib"] > 0
    assert "(1 steps, " in rows["update"]["rate"]  # half of 1 group x 2 episodes, of 1 step each
    assert rows["prompt_tokens"] > 100  # the real Frozen Lake prompt, not a stub
