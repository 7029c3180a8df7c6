"""One setting varied, the rest msgrpo.py's defaults or as given, over training seeds; the table.

    python benchmarks/ablation.py sampling aaw uniform all --seeds 0 1 --iterations 12 \\
        --groups 2 --minibatch 32 --lr 3e-4 --out results/ablation_sampling
    python benchmarks/ablation.py algo msgrpo poad ntpo --seeds 0 --iterations 12 --groups 2 \\
        --minibatch 32 --lr 3e-4 --out results/algo_comparison
    python benchmarks/ablation.py algo msgrpo poad ntpo --seeds 0 --think \\
        --out results/algo_comparison_think

Each (value, seed) trains `python msgrpo.py --<setting> <value> --seed <seed>` (algo poad or ntpo:
`python baselines.py <value> --seed <seed>`) into runs/ablation/<value>-s<seed> (equal iterations,
so equal episodes; the table counts their steps), then plays the trained adapter on held-out maps,
greedy and sampled at the training temperature. A run already trained is only evaluated again; an
interrupted one resumes. Writes <out>/ablation.md (the table) and <out>/ablation.json, and copies
each run's config.json, metrics.jsonl and eval.json (not the adapter) to <out>/<value>-s<seed>/.
"""

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import baselines  # noqa: E402
import envs  # noqa: E402
import msgrpo  # noqa: E402
import support  # noqa: E402


def trained(run_dir: Path, iterations: int) -> bool:
    return (run_dir / "adapter").exists() and len(support.read_metrics(run_dir)) >= iterations


def config_and_trainer(setting: str, value: str, **settings):
    """msgrpo.py's Config and train, or for algo poad / ntpo baselines.py's (the critic's
    settings)."""
    if setting == "algo" and value != "msgrpo":
        return baselines.POADConfig(algo=value, **settings), baselines.train_poad
    return (msgrpo.Config(**({} if setting == "algo" else {setting: value}), **settings),
            msgrpo.train)


def algo_of(saved: dict) -> str:
    return saved.get("algo", "msgrpo")  # only baselines.py's runs record one


def train_run(setting: str, value: str, seed: int, runs: Path, args) -> Path:
    run_dir = runs / f"{value}{'-think' if args.think else ''}-s{seed}"
    given = {name: getattr(args, name, None) for name in ("groups", "minibatch", "lr")}
    cfg, train = config_and_trainer(setting, value, seed=seed, eval_episodes=0, model=args.model,
                                     iterations=args.iterations, think=args.think,
                                     run_dir=str(run_dir),
                                     **{name: v for name, v in given.items() if v is not None})
    cfg = msgrpo.resolve_defaults(cfg)
    if not trained(run_dir, cfg.iterations):
        train(cfg, resume=(run_dir / "checkpoint.pt").exists())
    return run_dir


def evaluate_run(run_dir: Path, greedy_episodes: int, sampled_episodes: int) -> dict:
    cfg = support.load_config(run_dir, msgrpo.Config, msgrpo.resolve_defaults)
    model, tokenizer = msgrpo.load_policy(cfg, adapter=run_dir / "adapter")
    greedy_cfg = dataclasses.replace(cfg, eval_episodes=greedy_episodes)
    result = msgrpo.evaluate_greedy_and_sampled(model, tokenizer, greedy_cfg, sampled_episodes)
    support.record_eval(run_dir, cfg.iterations, result)
    return result


def summary(run_dir: Path, setting: str) -> dict:
    saved = support.load_json(run_dir / "config.json")
    cfg = {**dataclasses.asdict(support.load_config(run_dir, msgrpo.Config,
                                                    msgrpo.resolve_defaults)),
           "algo": algo_of(saved)}
    metrics = support.read_metrics(run_dir)
    final = support.load_json(run_dir / "eval.json")[-1]
    return {setting: cfg[setting], "seed": cfg["seed"], "think": cfg["think"],
            "iterations": len(metrics),
            "train_minutes": sum(m["seconds"] for m in metrics) / 60,
            "env_steps": round(sum(m["mean_steps"] for m in metrics) * cfg["groups"]
                               * cfg["group_size"]),
            "tokens_trained": sum(m["tokens_trained"] for m in metrics),
            # Shows the machine's speed: wall times from different days compare only through it.
            "train_tokens_per_second": float(np.mean([m["train_tokens_per_second"]
                                                      for m in metrics])),
            "greedy": {k: final[k]
                       for k in ("episodes", "success_rate", "success_ci95", "invalid_rate")},
            "sampled": {k: final["sampled"][k]
                        for k in ("episodes", "success_rate", "success_ci95", "invalid_rate")}}


def pooled(rows: list[dict], kind: str) -> str:
    """Success over all seeds' episodes together, with its Wilson interval."""
    wins = sum(round(r[kind]["success_rate"] * r[kind]["episodes"]) for r in rows)
    n = sum(r[kind]["episodes"] for r in rows)
    lo, hi = envs.wilson_interval(wins, n)
    return f"{wins / n:.3f} [{lo:.3f}, {hi:.3f}]"


def table(rows: list[dict], setting: str, values: list[str]) -> str:
    def cell(r, kind):
        lo, hi = r[kind]["success_ci95"]
        return f"{r[kind]['success_rate']:.3f} [{lo:.3f}, {hi:.3f}]"

    lines = [f"| {setting} | seed | held-out success, sampled T=1 | greedy | invalid (sampled) "
             "| training minutes | environment steps | training tokens | update tokens/s |",
             "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r[setting]} | {r['seed']} | {cell(r, 'sampled')} | {cell(r, 'greedy')} "
                     f"| {r['sampled']['invalid_rate']:.3f} | {r['train_minutes']:.1f} "
                     f"| {r['env_steps']:,} "
                     f"| {r['tokens_trained']:,} | {r['train_tokens_per_second']:.0f} |")
    for value in values:
        mine = [r for r in rows if r[setting] == value]
        if len(mine) > 1:
            lines.append(f"| **{value}, seeds pooled** | {len(mine)} | {pooled(mine, 'sampled')} "
                         f"| {pooled(mine, 'greedy')} "
                         f"| {np.mean([r['sampled']['invalid_rate'] for r in mine]):.3f} "
                         f"| {np.mean([r['train_minutes'] for r in mine]):.1f} "
                         f"| {np.mean([r['env_steps'] for r in mine]):,.0f} "
                         f"| {np.mean([r['tokens_trained'] for r in mine]):,.0f} "
                         f"| {np.mean([r['train_tokens_per_second'] for r in mine]):.0f} |")
    return "\n".join(lines)


def write_table(out: Path, setting: str, values: list[str], think: bool) -> str:
    """The table of every run kept in out, so seeds and values run on different days add up; the
    values named on this command line come first."""
    rows = [summary(kept, setting) for kept in out.glob("*-s*") if kept.is_dir()]
    rows = [r for r in rows if r["think"] == think]
    order = values + sorted({r[setting] for r in rows} - set(values))
    rows.sort(key=lambda r: (order.index(r[setting]), r["seed"]))
    text = table(rows, setting, order)
    (out / "ablation.json").write_text(json.dumps(rows, indent=2))
    (out / "ablation.md").write_text(text + "\n")
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("setting", choices=["sampling", "algo"], help="the Config field to vary")
    parser.add_argument("values", nargs="+")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--iterations", type=int, default=0, help="0: msgrpo's default")
    parser.add_argument("--model", default="", help="msgrpo's default, or tiny for a quick check")
    for name, kind in (("groups", int), ("minibatch", int), ("lr", float)):  # msgrpo's if not given
        parser.add_argument(f"--{name}", type=kind, help=f"msgrpo.py's --{name}")
    parser.add_argument("--greedy-episodes", type=int, default=100)
    parser.add_argument("--sampled-episodes", type=int, default=200)
    parser.add_argument("--think", action="store_true",
                        help="train with --think (replies of up to 256 tokens); runs are named "
                             "<value>-think-s<seed>")
    parser.add_argument("--runs", type=Path, default=Path("runs/ablation"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    for seed in args.seeds:
        for value in args.values:
            run_dir = train_run(args.setting, value, seed, args.runs, args)
            final = (support.load_json(run_dir / "eval.json") or [{}])[-1]
            if (final.get("episodes") != args.greedy_episodes
                    or final.get("sampled", {}).get("episodes") != args.sampled_episodes):
                evaluate_run(run_dir, args.greedy_episodes, args.sampled_episodes)
            keep = args.out / run_dir.name
            keep.mkdir(parents=True, exist_ok=True)
            for name in ("config.json", "metrics.jsonl", "eval.json"):
                shutil.copy(run_dir / name, keep / name)
            print(write_table(args.out, args.setting, args.values, args.think), flush=True)


if __name__ == "__main__":
    main()
