"""What doing shared work once saves, measured side by side in one run on the same rollouts.

    python benchmarks/bench_cpu.py                      # SmolLM2-135M, 2 groups x 8 episodes
    python benchmarks/bench_cpu.py --model tiny --groups 1 --group-size 4

Every Frozen Lake prompt starts with the same system prompt, rules and action list, and the G
episodes of a group start from the same observation. Two ways to run the same work:
    plain    every row read whole; the stop-at-</action> criterion built on every generate call
    once     the shared prefix run once and its keys and values reused by every row (prefix
             caching); in generate, each distinct prompt read once and its cache copied to the rows
             that hold it; identical steps of a minibatch read once; the criterion built once; in
             training, each 4-bit base weight dequantized once and kept, not in every forward and
             every backward
(a) a rollout step: real MS-GRPO rollouts (B groups x G episodes in lockstep), seconds per env step;
(b) a trained step: forward + backward over every step of those rollouts, in the update's
    minibatches and micro-batches, seconds per step.
Each is timed --repeats times (the median is reported). Prints a Markdown table with the
speed-ups; --out writes it to a file too.
"""

import argparse
import contextlib
import functools
import resource
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import msgrpo  # noqa: E402
import support  # noqa: E402


def peak_memory_mb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux reports KiB


def median_seconds_per_item(function, repeats: int) -> float:
    """function() -> how many items (env steps, trained steps) it did; the median seconds per item."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        items = function()
        times.append((time.perf_counter() - start) / items)
    return statistics.median(times)


def rollouts(model, tokenizer, cfg, seeds, once: bool):
    """play_groups, with every prompt read whole and the stop criterion rebuilt per call unless once."""
    torch.manual_seed(0)
    if once:
        return msgrpo.play_groups(model, tokenizer, cfg, seeds)
    original = msgrpo.sample_responses

    def plain(*args, **kwargs):
        support.stop_string_criterion.cache_clear()  # as transformers does when given stop_strings
        return original(*args, **kwargs, share_prefix=False)

    with mock.patch.object(msgrpo, "sample_responses", plain):
        return msgrpo.play_groups(model, tokenizer, cfg, seeds)


def trained_steps(model, tokenizer, cfg, steps, once: bool):
    """Forward + backward over every step, in the update's micro-batches (no optimizer step); returns
    the number of steps."""
    with support.dequantized_4bit_weights(model) if once else contextlib.nullcontext():
        for minibatch in msgrpo.plan_minibatches(steps, cfg, np.random.default_rng(0)):
            model.zero_grad(set_to_none=True)
            for micro in minibatch:
                batch = msgrpo.collate_steps(micro, tokenizer.pad_token_id, read_once=once)
                logp, mask = msgrpo.response_logprobs(model, batch, cfg.temperature)
                msgrpo.clipped_policy_loss(logp, logp.detach(), batch.advantages, mask).backward()
    return len(steps)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-steps", type=int, default=8, help="the game's step limit for these rollouts")
    parser.add_argument("--repeats", type=int, default=2, help="timings per measure (the median is reported)")
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args(argv)

    cfg = msgrpo.resolve_defaults(msgrpo.Config(
        model=args.model, groups=args.groups, group_size=args.group_size,
        env_options={"max_steps": args.max_steps}, run_dir="unused"))
    torch.manual_seed(0)
    model, tokenizer = msgrpo.load_policy(cfg)
    seeds = list(range(101, 101 + args.groups))
    episodes = rollouts(model, tokenizer, cfg, seeds, once=True)  # warm-up, and the steps to train on
    env_steps = sum(len(ep.rewards) for ep in episodes)

    # (a) rollout steps, plain vs once
    def env_steps_played(once):
        return sum(len(ep.rewards) for ep in rollouts(model, tokenizer, cfg, seeds, once))

    rollout = {once: median_seconds_per_item(functools.partial(env_steps_played, once), args.repeats)
               for once in (False, True)}

    # (b) trained steps over every step of the rollouts, advantages +-1 by episode
    advantages = np.where(np.arange(len(episodes)) % 2 == 0, 1.0, -1.0)
    steps = msgrpo.episode_steps(episodes, advantages, range(len(episodes)))
    model.train()
    trained = {once: median_seconds_per_item(functools.partial(trained_steps, model, tokenizer, cfg, steps, once),
                                             args.repeats) for once in (False, True)}
    distinct = len({(tuple(p), tuple(r)) for p, r, _ in steps})
    prompts = [p for p, _, _ in steps]

    rows = [
        ("model, threads", f"{args.model}, {torch.get_num_threads()}"),
        ("rollouts", f"{args.groups} groups x {args.group_size} episodes, step limit {args.max_steps}: "
                     f"{env_steps} env steps ({distinct} distinct), prompt {np.mean([len(p) for p in prompts]):.0f} "
                     f"tokens, {support.shared_prefix_length(prompts)} shared by all"),
        ("(a) rollout step, plain (s per env step)", f"{rollout[False]:.3f}"),
        ("(a) rollout step, once (s per env step)", f"{rollout[True]:.3f}"),
        ("(a) speed-up", f"**{rollout[False] / rollout[True]:.1f}x**"),
        ("(b) trained step, plain (s per step)", f"{trained[False]:.3f}"),
        ("(b) trained step, once (s per step)", f"{trained[True]:.3f}"),
        ("(b) speed-up", f"**{trained[False] / trained[True]:.1f}x**"),
        ("peak memory (MB)", f"{peak_memory_mb():.0f}"),
    ]
    table = "| measure | value |\n| --- | --- |\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
