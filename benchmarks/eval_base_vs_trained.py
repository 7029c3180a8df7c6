"""Greedy held-out evaluation of a run's LoRA adapter and of its base model, on the same seeds.

    python benchmarks/eval_base_vs_trained.py runs/fl-a --episodes 200 [--sampled]

One model in memory: the base is the same model with the adapter disabled. Records both in
<run>/eval.json as the trainer does (iteration 0 = the base model), redraws curves.png and prints
the table. For runs trained with --eval-episodes 0, or to re-evaluate on more episodes.
"""

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import msgrpo  # noqa: E402
import support  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--sampled", action="store_true",
                        help="also play both sampled at T = 1 (stored under 'sampled', as "
                             "train() does)")
    args = parser.parse_args(argv)
    cfg = support.load_config(args.run_dir, msgrpo.Config, msgrpo.resolve_defaults)
    cfg = dataclasses.replace(cfg, eval_episodes=args.episodes)
    model, tokenizer = msgrpo.load_policy(cfg, adapter=args.run_dir / "adapter")
    iteration = support.read_metrics(args.run_dir)[-1]["iteration"]  # the adapter's last iteration
    for adapter_on, at in [(True, iteration), (False, 0)]:
        with contextlib.nullcontext() if adapter_on else model.disable_adapter():
            evaluate = (msgrpo.evaluate_greedy_and_sampled if args.sampled
                        else msgrpo.evaluate_policy)
            result = evaluate(model, tokenizer, cfg)
        support.record_eval(args.run_dir, at, result)
    support.plot_curves(args.run_dir)
    evals = support.load_json(args.run_dir / "eval.json")
    print(support.eval_table(evals))
    if args.sampled:
        print("sampled at T = 1:")
        print(support.eval_table(support.sampled_evals(evals)))


if __name__ == "__main__":
    main()
