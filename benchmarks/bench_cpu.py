"""The CPU speed-ups against the plain path: a rollout step and a trained step, side by side.

    python benchmarks/bench_cpu.py --out results/bench_cpu.md   # SmolLM2-135M, the trained adapter
    python benchmarks/bench_cpu.py --model tiny --groups 1 --group-size 4   # a quick check

One policy and one set of steps, played and trained both ways (msgrpo.Config.cpu_speedups):
    plain       msgrpo.py as CUDA runs it (cpu_speedups=False; python msgrpo.py --no-cpu-speedups):
                the sampling loop msgrpo.sample_responses reading every prompt whole, on
                bitsandbytes' 4-bit layers, which dequantize each weight in every forward and again
                in every backward; the update in micro-batches of --micro-batch steps
                (msgrpo.chunks, msgrpo.collate_steps), every step a row of its own, read whole;
                attention as transformers runs it given a mask (each key/value head copied per
                query head)
    speed-ups   the same functions with cpu_speedups.py swapped in (cpu_speedups=True, the CPU's
                default): each 4-bit weight dequantized once and kept, multiplied by oneDNN where
                that kernel times faster, attention over the grouped key/value heads
                (dequantized_4bit_weights); the rollouts' first forward reading each distinct prompt
                once and the rules every prompt starts with once a rollout (read_prompts); the
                update in micro-batches of --micro-batch distinct steps, identical steps one row,
                the prefix every step shares read once, then a prefix tree (micro_batches,
                collate_steps, response_logprobs)
The two compute the same numbers up to float rounding (tests/test_cpu_speedups.py); the table's
gradient norm, of the same steps on each side, shows it here.

(a) a rollout step: msgrpo.play_groups of a trained policy (--adapter; the committed Frozen Lake
    adapter by default, whose groups repeat themselves as a trained policy's do), --groups groups x
    --group-size episodes in lockstep at --temperature; seconds per env step;
(b) a trained step: msgrpo.update_policy over every step of the plain side's rollouts, with
    advantages +1 and -1 in turn and AdamW at learning rate 0, so both sides train the same steps
    on the same weights; seconds per step; and the peak resident memory while it runs (sampled
    from /proc every 5 ms; the side's model copies included);
(c) the peak resident memory of msgrpo.update_policy on a first iteration's varied steps (the base
    model's, at T = 1), whose micro-batches hold --micro-batch distinct steps each: the update's
    true peak.
Each side runs in a process of its own, one after the other (the command starts itself again
with --side plain, then --side speed-ups), so neither side's memory, allocator state or model
reaches the other's timings and peaks: run after the plain side in one process, the speed-ups'
rollouts timed several times slower than in a fresh one. The plain side plays the steps both
train and writes them to a file the speed-ups side reads; each loads the same policy, seeded
alike. Within a side, before each memory measure the allocator hands back what was freed
(release_freed_memory), so one measure's leftovers are not counted in the next's peak. (a) and
(b) are timed --repeats times after an untimed run (oneDNN's timings and the kept weights are
made once); the median is reported. The command runs under jemalloc as msgrpo.py does where the
system has it, and so does each side (results/NOTES.md compares the two allocators). Prints a
Markdown table, measure | plain | speed-ups, with plain / speed-ups in bold (how many times
faster, or how many times less memory); --out writes it to a file too.
"""

import argparse
import contextlib
import ctypes
import dataclasses
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cpu_speedups  # noqa: E402
import msgrpo  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ADAPTER = ROOT / "results" / "frozen_lake_cpu" / "adapter"
SIDES = ("plain", "speed-ups")


def allocator() -> str:
    """jemalloc where this process runs under it (cpu_speedups.run_under_jemalloc), else libc's."""
    return "jemalloc" if "jemalloc" in os.environ.get("LD_PRELOAD", "") else "libc's malloc"


def release_freed_memory() -> None:
    """Hand the memory of freed tensors back to the system: both allocators keep some for reuse,
    and the process's resident memory would then carry one measure's peak into the next."""
    gc.collect()
    process = ctypes.CDLL(None)
    if allocator() == "jemalloc":
        mallctl = getattr(process, "mallctl", None)
        if mallctl is not None:  # every arena (MALLCTL_ARENAS_ALL = 4096)
            mallctl(b"arena.4096.purge", None, None, None, ctypes.c_size_t(0))
    elif hasattr(process, "malloc_trim"):
        process.malloc_trim(ctypes.c_size_t(0))


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
    """function() -> how many items (env steps, trained steps) it did; median seconds per item,
    after one untimed call (the first builds what later calls reuse)."""
    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        items = function()
        times.append((time.perf_counter() - start) / items)
    return statistics.median(times)


def steps_of(episodes) -> list:
    """Every step of every episode, with advantages +1 and -1 in turn (an update's arithmetic does
    not depend on their values)."""
    advantages = np.where(np.arange(len(episodes)) % 2 == 0, 1.0, -1.0)
    return msgrpo.episode_steps(episodes, advantages, range(len(episodes)))


def play(model, tokenizer, cfg, seeds) -> list:
    torch.manual_seed(0)
    return msgrpo.play_groups(model, tokenizer, cfg, seeds)


def first_iteration_steps(model, tokenizer, cfg, seeds) -> list:
    """Steps as varied as a first iteration's: the base model (the adapter switched off) plays at
    T = 1, so every micro-batch holds --micro-batch distinct steps, the update's memory peak."""
    with model.disable_adapter():
        return steps_of(play(model, tokenizer, dataclasses.replace(cfg, temperature=1.0), seeds))


def env_steps_played(model, tokenizer, cfg, seeds) -> int:
    return sum(len(ep.rewards) for ep in play(model, tokenizer, cfg, seeds))


def train(model, tokenizer, cfg, steps, grad_norms: list) -> int:
    """msgrpo.update_policy over every step, in the update's micro-batches, with AdamW at learning
    rate 0: the forward, backward and optimizer step of an update, the weights left as they were
    (so each side and each repeat trains the same policy). Returns the number of steps."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)
    stats = msgrpo.update_policy(model, optimizer, tokenizer, steps, cfg, np.random.default_rng(0))
    grad_norms.append(stats["grad_norm"])
    return len(steps)


def micro_batch_rows(steps, cfg) -> list[int]:
    """The rows of each of the update's micro-batches on this side, cut as update_policy cuts them
    (the same shuffle): steps on the plain side, distinct steps with the speed-ups."""
    order = [steps[i] for i in np.random.default_rng(0).permutation(len(steps))]
    split = cpu_speedups.micro_batches if cfg.cpu_speedups else msgrpo.chunks
    return [len({(tuple(p), tuple(r)) for p, r, _ in micro}) if cfg.cpu_speedups else len(micro)
            for minibatch in msgrpo.chunks(order, cfg.minibatch)
            for micro in split(minibatch, cfg.micro_batch)]


def measure(model, tokenizer, cfg, seeds, steps, varied, repeats: int) -> dict:
    """(a), (b) and (c) on one side (cfg.cpu_speedups)."""
    rollout = median_seconds_per_item(
        functools.partial(env_steps_played, model, tokenizer, cfg, seeds), repeats)
    peak, grad_norms = [], []
    release_freed_memory()
    with peak_resident_mb(peak):
        trained = median_seconds_per_item(
            functools.partial(train, model, tokenizer, cfg, steps, grad_norms), repeats)
    release_freed_memory()
    with peak_resident_mb(peak):
        train(model, tokenizer, cfg, varied, [])
    return {"rollout": rollout, "trained": trained, "peak_mb": peak[0],
            "first_iteration_peak_mb": peak[1], "grad_norm": grad_norms[-1]}


def table(results: dict, header: str) -> str:
    plain = results["plain"]

    def cells(name, digits):
        return " | ".join(f"{values[name]:,.{digits}f}"
                          + (f" (**{plain[name] / values[name]:.2f}x**)" if side != "plain" else "")
                          for side, values in results.items())

    return "\n".join([
        header, "",
        "| measure | " + " | ".join(results) + " |", "| --- |" + " ---: |" * len(results),
        f"| (a) rollout step (s per env step) | {cells('rollout', 3)} |",
        f"| (b) trained step (s per step) | {cells('trained', 3)} |",
        f"| (b) peak memory while training (MB) | {cells('peak_mb', 0)} |",
        f"| (c) peak memory, a first iteration's varied steps (MB) | "
        f"{cells('first_iteration_peak_mb', 0)} |",
        "| (b) gradient norm of the same steps (the same numbers) | "
        + " | ".join(f"{values['grad_norm']:.5f}" for values in results.values()) + " |"])


def as_json_steps(steps) -> list:
    return [[[int(t) for t in prompt], [int(t) for t in response], float(advantage)]
            for prompt, response, advantage in steps]


def run_side(args, cfg, adapter) -> dict:
    """One side (--side) in this process: its measures, written to --side-json. The plain side
    plays the steps both sides train and writes them to --steps; the speed-ups side reads them."""
    torch.manual_seed(0)
    model, tokenizer = msgrpo.load_policy(cfg, adapter=adapter)
    seeds = list(range(101, 101 + args.groups))
    if args.side == "plain":
        episodes = play(model, tokenizer, cfg, seeds)
        played = {"steps": as_json_steps(steps_of(episodes)),
                  "varied": as_json_steps(first_iteration_steps(model, tokenizer, cfg, seeds)),
                  "env_steps": sum(len(ep.rewards) for ep in episodes)}
        args.steps.write_text(json.dumps(played))
    played = json.loads(args.steps.read_text())
    steps, varied = ([tuple(step) for step in played[key]] for key in ("steps", "varied"))
    measures = measure(model, tokenizer, cfg, seeds, steps, varied, args.repeats)
    measures.update(threads=torch.get_num_threads(), allocator=allocator())
    args.side_json.write_text(json.dumps(measures))
    return measures


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=msgrpo.CPU_MODEL)
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
    parser.add_argument("--micro-batch", type=int, default=0,
                        help="the update's micro-batch: steps (plain), distinct steps (speed-ups); "
                             "0 = the trainer's default")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timings per measure (the median is reported)")
    parser.add_argument("--out", help="also write the table here")
    parser.add_argument("--side", choices=SIDES,
                        help="measure this side only, in this process (the command runs each so)")
    parser.add_argument("--side-json", type=Path, help="with --side: write its measures here")
    parser.add_argument("--steps", type=Path,
                        help="with --side: the steps both sides train (the plain side writes them)")
    args = parser.parse_args(argv)
    adapter = args.adapter or (DEFAULT_ADAPTER if args.model == msgrpo.CPU_MODEL else None)

    cfg = msgrpo.resolve_defaults(msgrpo.Config(
        model=args.model, groups=args.groups, group_size=args.group_size,
        temperature=args.temperature, env_options={"max_steps": args.max_steps},
        micro_batch=args.micro_batch, run_dir="unused"))
    sides = {side: dataclasses.replace(cfg, cpu_speedups=side == "speed-ups") for side in SIDES}
    if args.side:
        return run_side(args, sides[args.side], adapter)

    # Each side in a fresh process, the plain side first: it plays the steps both sides train.
    with tempfile.TemporaryDirectory() as folder:
        steps_file = Path(folder) / "steps.json"
        results = {}
        for side in SIDES:
            side_json = Path(folder) / f"{side}.json"
            subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv, "--side", side,
                            "--side-json", str(side_json), "--steps", str(steps_file)],
                           check=True)
            results[side] = json.loads(side_json.read_text())
        played = json.loads(steps_file.read_text())
    steps, varied = played["steps"], played["varied"]

    prompts = [p for p, _, _ in steps]
    policy = adapter.resolve().relative_to(ROOT) if adapter else "a new adapter"
    distinct, tokens = len(set(map(tuple, prompts))), np.mean([len(p) for p in prompts])
    rows = {side: micro_batch_rows(steps, side_cfg) for side, side_cfg in sides.items()}
    threads = " / ".join(sorted({str(r.pop("threads")) for r in results.values()}))
    allocators = " / ".join(sorted({r.pop("allocator") for r in results.values()}))
    header = (
        f"Model {args.model}, {threads} threads; the policy: {policy}; "
        f"{args.groups} groups x {args.group_size} episodes at T = {args.temperature}, step limit "
        f"{args.max_steps}: {played['env_steps']} env steps, {distinct} "
        f"distinct prompts of {tokens:.0f} tokens, "
        f"{cpu_speedups.shared_prefix_length(prompts)} shared by all; the update's micro-batches "
        f"(at most {cfg.micro_batch}) hold {', '.join(map(str, rows['plain']))} steps (plain), "
        f"{', '.join(map(str, rows['speed-ups']))} distinct steps (speed-ups); (c): {len(varied)} "
        f"steps of the base model at T = 1. Each side in a process of its own. Memory allocator: "
        f"{allocators}. In bold: plain / speed-ups.")
    text = table(results, header)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return results


if __name__ == "__main__":
    cpu_speedups.run_under_jemalloc(sys.argv)  # as msgrpo.py runs
    main()
