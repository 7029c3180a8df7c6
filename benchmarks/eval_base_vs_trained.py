"""Greedy held-out evaluation of a run's LoRA adapter and of its base model, on the same seeds.

    python benchmarks/eval_base_vs_trained.py runs/fl-a --episodes 200

One model in memory: the base is the same model with the adapter disabled. Records both in
<run>/eval.json as the trainer does (iteration 0 = the base model), redraws curves.png and prints
the table. For runs trained with --eval-episodes 0, or to re-evaluate on more episodes.
"""

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import msgrpo  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--episodes", type=int, default=200)
    args = parser.parse_args(argv)
    cfg = msgrpo.Config(**msgrpo.load_json(args.run_dir / "config.json"))
    cfg = dataclasses.replace(cfg, eval_episodes=args.episodes)
    model, tokenizer = msgrpo.load_policy(cfg, adapter=args.run_dir / "adapter")
    iteration = msgrpo.load_checkpoint(args.run_dir)["iteration"]
    msgrpo.record_eval(args.run_dir, iteration, msgrpo.evaluate_policy(model, tokenizer, cfg))
    with model.disable_adapter():
        msgrpo.record_eval(args.run_dir, 0, msgrpo.evaluate_policy(model, tokenizer, cfg))
    msgrpo.plot_curves(args.run_dir)
    print(msgrpo.eval_table(msgrpo.load_json(args.run_dir / "eval.json")))


if __name__ == "__main__":
    main()
