"""A rollout step and a trained step, before and after the latest speed-ups, side by side.

    python benchmarks/bench_cpu.py --out results/bench_cpu.md   # SmolLM2-135M, the trained adapter
    python benchmarks/bench_cpu.py --model tiny --groups 1 --group-size 4

The steps are real MS-GRPO rollouts (B groups x G episodes in lockstep) of a trained policy
(--adapter; the committed Frozen Lake adapter by default), whose groups repeat themselves as a
trained policy's do. Two ways to run them:
    before   rollouts sampled by transformers' generate (generate_sampling.py) on bitsandbytes'
             packed CPU 4-bit layout; training in micro-batches of --micro-batch steps, the
             identical steps inside one read once, each 4-bit base weight dequantized once, each
             row's tokens after the shared prefix read whole; in both, the prefix that every
             prompt shares read once (prefix caching)
    after    rollouts by support.sample_replies: keys and values kept in place rather than copied
             as they grow, one uniform draw per token rather than one per vocabulary entry, on the
             dequantized weights the update trains (so no longer rounded differently from them),
             the rules' keys and values kept from one lockstep call to the next (kept_prefixes);
             training in micro-batches of --micro-batch distinct steps (identical steps are one
             row however often they repeat: fewer forwards) and the prefix tree
             (support.read_heads_once: a prompt that several steps share is read once, their
             replies after it); in both, the base weights' matmuls through oneDNN where that
             kernel times faster for the shape and row count (support.onednn_is_faster); and
             attention over the 3 key/value heads as they are rather than copied to the 9 query
             heads (support.grouped_query_attention). The same numbers as the plain path, within
             float rounding (tests/test_msgrpo.py checks 1e-4)
(a) a rollout step: seconds per env step of the rollouts;
(b) a trained step: forward + backward over every step of those rollouts, in the update's
    micro-batches, seconds per step; and the peak resident memory while it runs (sampled from
    /proc every 5 ms; the process's model copies included);
(c) the peak resident memory of the update on a first iteration's varied steps (the base model's
    at T = 1), whose micro-batches hold --micro-batch distinct steps each: the update's true peak.
The memory allocator is a process's, so it cannot be switched side by side: the command runs
under jemalloc as msgrpo.py does where the system has it (results/NOTES.md compares the two).
Each is timed --repeats times (the median is reported). Prints a Markdown table with the
speed-up of "after"; --out writes it to a file too.
"""

import argparse
import contextlib
import dataclasses
import functools
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import generate_sampling  # noqa: E402
import msgrpo  # noqa: E402
import support  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ADAPTER = ROOT / "results" / "frozen_lake_cpu" / "adapter"


def allocator() -> str:
    """jemalloc where this process runs under it (support.run_under_jemalloc), else libc's."""
    return "jemalloc" if "jemalloc" in os.environ.get("LD_PRELOAD", "") else "libc's malloc"


def resident_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


@contextlib.contextmanager
def peak_resident_mb(peak: list):
    """Append the peak resident memory (MB) while the block runs, sampled every 5 ms."""
    done, samples = threading.Event(), [resident_mb()]

    def sample():
        while not done.wait(0.005):
            samples.append(resident_mb())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        peak.append(max(samples + [resident_mb()]))


def median_seconds_per_item(function, repeats: int) -> float:
    """function() -> how many items (env steps, trained steps) it did; median seconds per item."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        items = function()
        times.append((time.perf_counter() - start) / items)
    return statistics.median(times)


@contextlib.contextmanager
def levers(on: bool):
    """The sampling loop, micro-batches of distinct steps, the prefix tree, the oneDNN kernel and
    attention over grouped heads on (as the trainer runs) or off (the code before)."""
    if on:
        yield
        return
    with mock.patch.object(support, "READ_HEADS_ONCE", False), \
            mock.patch.object(support, "onednn_is_faster", lambda shape, rows: False), \
            mock.patch.object(msgrpo, "sample_responses", generate_sampling.sample_responses), \
            mock.patch.object(support, "distinct_chunks", steps_chunks), \
            mock.patch.object(support, "grouped_query_attention", copied_heads):
        yield


def copied_heads():
    """Attention as transformers runs it given a mask: each key/value head copied per query head
    (the code before)."""
    return contextlib.nullcontext()


def steps_chunks(items: list, size: int, key) -> list[list]:
    """Micro-batches of `size` steps, identical ones counted each time (the code before)."""
    return list(support.chunks(items, size))


def first_iteration_steps(model, tokenizer, cfg, seeds) -> list:
    """Steps as varied as a first iteration's: the base model (the adapter switched off) plays at
    T = 1, so every micro-batch holds --micro-batch distinct steps, the update's memory peak."""
    torch.manual_seed(0)
    with model.disable_adapter():
        episodes = msgrpo.play_groups(model, tokenizer, dataclasses.replace(cfg, temperature=1.0),
                                      seeds)
    return steps_of(episodes)


def steps_of(episodes) -> list:
    """Every step of every episode, with advantages +1 and -1 in turn (an update's arithmetic does
    not depend on their values)."""
    advantages = np.where(np.arange(len(episodes)) % 2 == 0, 1.0, -1.0)
    return msgrpo.episode_steps(episodes, advantages, range(len(episodes)))


def env_steps_played(model, tokenizer, cfg, seeds) -> int:
    torch.manual_seed(0)
    return sum(len(ep.rewards) for ep in msgrpo.play_groups(model, tokenizer, cfg, seeds))


def trained_steps(model, tokenizer, cfg, steps) -> int:
    """Forward + backward over every step, in the update's micro-batches (no optimizer step);
    returns the number of steps."""
    model.train()
    with support.dequantized_4bit_weights(model):
        for minibatch in msgrpo.plan_minibatches(steps, cfg, np.random.default_rng(0)):
            model.zero_grad(set_to_none=True)
            for micro in minibatch:
                batch = msgrpo.collate_steps(micro, tokenizer.pad_token_id, read_once=True)
                logp, mask = msgrpo.response_logprobs(model, batch, cfg.temperature)
                msgrpo.clipped_policy_loss(logp, logp.detach(), batch.advantages, mask).backward()
    return len(steps)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--adapter", type=Path,
                        help="the policy that plays (default: the committed "
                        "Frozen Lake adapter with smollm2-135m, a new one otherwise)")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.5,
                        help="rollout temperature: the late phase's, where most iterations run; at "
                             "T = 1 a trained policy plays a group's episodes alike")
    parser.add_argument("--max-steps", type=int, default=8,
                        help="the game's step limit for these rollouts")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timings per measure (the median is reported)")
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args(argv)
    adapter = args.adapter or (DEFAULT_ADAPTER if args.model == "smollm2-135m" else None)

    cfg = msgrpo.resolve_defaults(msgrpo.Config(
        model=args.model, groups=args.groups, group_size=args.group_size,
        temperature=args.temperature, env_options={"max_steps": args.max_steps}, run_dir="unused"))
    seeds = list(range(101, 101 + args.groups))
    torch.manual_seed(0)
    model, tokenizer = msgrpo.load_policy(cfg, adapter=adapter)
    torch.manual_seed(0)
    episodes = msgrpo.play_groups(model, tokenizer, cfg, seeds)  # warm-up, and the steps to train
    env_steps = sum(len(ep.rewards) for ep in episodes)
    steps = steps_of(episodes)
    varied = first_iteration_steps(model, tokenizer, cfg, seeds)

    def measure(on):
        peak = []
        with levers(on):
            rollout = median_seconds_per_item(
                functools.partial(env_steps_played, model, tokenizer, cfg, seeds), args.repeats)
            with peak_resident_mb(peak):
                trained = median_seconds_per_item(
                    functools.partial(trained_steps, model, tokenizer, cfg, steps), args.repeats)
            with peak_resident_mb(peak):
                trained_steps(model, tokenizer, cfg, varied)
        return {"rollout": rollout, "trained": trained, "peak_mb": peak[0],
                "first_iteration_peak_mb": peak[1]}

    results = {"before": measure(on=False), "after": measure(on=True)}

    prompts = [p for p, _, _ in steps]
    before = results["before"]

    def cells(measure, digits=3, speed_up=True):
        return " | ".join(f"{values[measure]:.{digits}f}"
                          + (f" (**{before[measure] / values[measure]:.2f}x**)"
                             if speed_up and name != "before" else "")
                          for name, values in results.items())

    micro_rows = [len({(tuple(p), tuple(r)) for p, r, _ in micro})
                  for mb in msgrpo.plan_minibatches(steps, cfg, np.random.default_rng(0))
                  for micro in mb]
    policy = adapter.resolve().relative_to(ROOT) if adapter else "a new adapter"
    distinct, tokens = len(set(map(tuple, prompts))), np.mean([len(p) for p in prompts])
    lines = [f"Model {args.model}, {torch.get_num_threads()} threads; the policy: {policy}; "
             f"{args.groups} groups x {args.group_size} episodes at T = {args.temperature}, "
             f"step limit {args.max_steps}: "
             f"{env_steps} env steps, {distinct} distinct prompts of {tokens:.0f} tokens, "
             f"{support.shared_prefix_length(prompts)} shared by all; the update's micro-batches "
             f"hold {', '.join(map(str, micro_rows))} distinct steps (at most {cfg.micro_batch}); "
             f"(c): {len(varied)} steps of the base model at T = 1. Memory allocator: "
             f"{allocator()}.", "",
             "| measure | " + " | ".join(results) + " |", "| --- |" + " ---: |" * len(results),
             f"| (a) rollout step (s per env step) | {cells('rollout')} |",
             f"| (b) trained step (s per step) | {cells('trained')} |",
             f"| (b) peak memory while training (MB) | {cells('peak_mb', 0, speed_up=False)} |",
             f"| (c) peak memory, a first iteration's varied steps (MB) | "
             f"{cells('first_iteration_peak_mb', 0, speed_up=False)} |"]
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return results


if __name__ == "__main__":
    support.run_under_jemalloc(sys.argv)  # as msgrpo.py runs
    main()
