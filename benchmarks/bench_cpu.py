"""Where the time goes, measured side by side in one run on the same model and seeds.

    python benchmarks/bench_cpu.py                      # SmolLM2-135M, 16 episodes, 4 steps each
    python benchmarks/bench_cpu.py --model tiny --episodes 8

(a) rollouts: all episodes stepped in lockstep (one batched generate per step) vs one episode at
    a time; env steps per second and the ratio.
(b) the update: training tokens per second of forward+backward, and peak memory.
(c) one MS-GRPO iteration split into rollout, scoring (the no-grad log-prob pass needed when
    several optimizer steps reuse a batch) and update.
Prints a Markdown table; --out writes it to a file too.
"""

import argparse
import dataclasses
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import msgrpo  # noqa: E402


def peak_memory_mb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux reports KiB


def timed(function, *args):
    start = time.perf_counter()
    result = function(*args)
    return result, time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--episodes", type=int, default=16, help="concurrent episodes in the batched rollout")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args(argv)

    cfg = msgrpo.resolve_defaults(msgrpo.Config(
        model=args.model, groups=1, group_size=args.episodes, env_options={"max_steps": args.max_steps},
        run_dir="unused", minibatch=0))
    torch.manual_seed(0)
    model, tokenizer = msgrpo.load_policy(cfg)
    seed = 12345

    # (a) lockstep vs one at a time, same seed, same number of episodes
    torch.manual_seed(1)
    batched, batched_s = timed(msgrpo.play_groups, model, tokenizer, cfg, [seed])
    single_cfg = dataclasses.replace(cfg, group_size=1)
    torch.manual_seed(1)
    singles, single_s = timed(lambda: [ep for _ in range(args.episodes)
                                       for ep in msgrpo.play_groups(model, tokenizer, single_cfg, [seed])])
    batched_steps = sum(len(ep.rewards) for ep in batched)
    single_steps = sum(len(ep.rewards) for ep in singles)
    batched_rate, single_rate = batched_steps / batched_s, single_steps / single_s

    # (b) + (c): score and update on every step of the batched rollout, advantages +-1
    returns = msgrpo.episode_returns([ep.rewards for ep in batched])
    advantages = np.where(np.arange(len(batched)) % 2 == 0, 1.0, -1.0)
    steps = msgrpo.episode_steps(batched, advantages, np.arange(len(batched)))
    tokens = sum(len(p) + len(r) for p, r, _ in steps)
    batches = [msgrpo.collate_steps(chunk, tokenizer.pad_token_id) for chunk in msgrpo.chunks(steps, cfg.micro_batch)]
    model.eval()
    with torch.no_grad(), msgrpo.packed_4bit_weights(model):  # as update_policy's scoring pass
        _, scoring_s = timed(lambda: [msgrpo.response_logprobs(model, b, cfg.temperature) for b in batches])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    _, update_s = timed(msgrpo.update_policy, model, optimizer, tokenizer, steps, cfg, np.random.default_rng(0))

    rows = [
        ("model", args.model),
        ("threads", torch.get_num_threads()),
        ("episodes x max steps", f"{args.episodes} x {args.max_steps} (mean return {returns.mean():+.2f})"),
        ("(a) lockstep rollout", f"{batched_steps} steps in {batched_s:.1f} s = {batched_rate:.2f} steps/s"),
        ("(a) one episode at a time", f"{single_steps} steps in {single_s:.1f} s = {single_rate:.2f} steps/s"),
        ("(a) speed-up, lockstep / one at a time", f"{batched_rate / single_rate:.1f}x"),
        ("(b) update: forward+backward tokens/s", f"{tokens / update_s:.0f} ({tokens} tokens, micro-batch {cfg.micro_batch} steps)"),
        ("(b) peak memory (MB)", f"{peak_memory_mb():.0f}"),
        ("(c) iteration: rollout / scoring / update (s)", f"{batched_s:.1f} / {scoring_s:.1f} / {update_s:.1f}"),
    ]
    table = "| measure | value |\n| --- | --- |\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
