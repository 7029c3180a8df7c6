"""Greedy held-out evaluation of a run's LoRA adapter and of its base model, on the same seeds.

    python benchmarks/eval_base_vs_trained.py runs/fl-a --episodes 200

One model in memory: the base is the same model with the adapter disabled. Writes
<run>/eval_base_vs_trained.json and prints both rows.
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
    results = {f"trained_iteration_{iteration}": msgrpo.evaluate_policy(model, tokenizer, cfg)}
    with model.disable_adapter():
        results["base"] = msgrpo.evaluate_policy(model, tokenizer, cfg)
    msgrpo.save_json(args.run_dir / "eval_base_vs_trained.json", results)
    for name, result in results.items():
        lo, hi = result["success_ci95"]
        print(f"{name}: success {result['success_rate']:.3f} [{lo:.3f}, {hi:.3f}] over {result['episodes']} "
              f"held-out episodes, invalid rate {result['invalid_rate']:.3f}")


if __name__ == "__main__":
    main()
