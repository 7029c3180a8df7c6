"""The GPU default's cost, measured: one MS-GRPO iteration and one evaluation batch on a model of
Qwen2.5-3B-Instruct's exact architecture, loaded as `python msgrpo.py` loads its default.

    python benchmarks/gpu_check.py --out results/gpu.md        # on a CUDA machine: the real shape
    python benchmarks/gpu_check.py --layers 2 --groups 1 --group-size 2 --max-steps 2 --eval-batch 2

Nothing is downloaded: the model is built from Qwen2.5-3B's configuration (hidden 2,048,
36 layers, intermediate 11,008, 16 query and 2 key-value heads, vocabulary 151,936, tied
embeddings) with random weights, saved once, and loaded through msgrpo.load_policy (NF4 base,
LoRA r 8, gradient checkpointing on CUDA). Prompts are the Frozen Lake prompts, tokenised by the
bundled SmolLM2 tokenizer (its ids fit Qwen's vocabulary; Qwen's own tokenizer gives prompts of
similar length). Random weights never write "</action>", so every reply runs to max_new_tokens
and every episode to the step limit: the rollout timed here is the longest one the defaults
allow; the update trains as many episodes as the default does. Writes seconds, peak memory and
tokens/s per phase (rollout, update, evaluation).
"""

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import envs  # noqa: E402
import msgrpo  # noqa: E402
import support  # noqa: E402

QWEN25_3B = dict(
    hidden_size=2048, num_hidden_layers=36, intermediate_size=11008, num_attention_heads=16,
    num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
    max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
)


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def peak_memory_gib() -> float:
    """Peak allocated GPU memory since the last reset; on the CPU the process's peak resident
    size."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def reset_peak_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def random_qwen_folder(folder: Path, layers: int) -> Path:
    """Qwen2.5-3B's architecture (first `layers` layers) with random bf16 weights, as a model
    folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    tokenizer = AutoTokenizer.from_pretrained(support.model_path("smollm2-135m"))
    config = Qwen2Config(**{**QWEN25_3B, "num_hidden_layers": layers},
                         bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    # initialise where it is fast; 3 B parameters take minutes on a CPU
    with torch.device(device()):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return folder


def check(cfg: msgrpo.Config, eval_batch: int) -> dict:
    """Load, one training iteration, one evaluation batch; seconds, memory and throughput of
    each."""
    rows = {}
    reset_peak_memory()
    start = time.time()
    model, tokenizer = msgrpo.load_policy(cfg)
    rows["load"] = dict(seconds=time.time() - start, peak_gib=peak_memory_gib())

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    rng = np.random.default_rng(cfg.seed)
    reset_peak_memory()
    metrics = msgrpo.train_iteration(model, optimizer, tokenizer, cfg, rng)
    iteration_peak = peak_memory_gib()  # one reading for rollout and update; see the table's note
    env_steps = metrics["mean_steps"] * cfg.groups * cfg.group_size
    rows["rollout"] = dict(seconds=metrics["rollout_seconds"], peak_gib=iteration_peak,
                           rate=f"{env_steps / metrics['rollout_seconds']:.2f} env steps/s "
                                f"({env_steps:.0f} steps of {cfg.max_new_tokens} new tokens)")
    rows["update"] = dict(seconds=metrics["update_seconds"], peak_gib=iteration_peak,
                          rate=f"{metrics['train_tokens_per_second']:.0f} trained tokens/s "
                               f"({metrics['steps_trained']} steps, "
                               f"{metrics['tokens_trained']} tokens)")

    reset_peak_memory()
    start = time.time()
    agent = msgrpo.LAPAgent(model, tokenizer, cfg, greedy=True)
    result = envs.evaluate(agent, cfg.env, envs.heldout_seeds(eval_batch), batch_size=eval_batch,
                           **msgrpo.env_options(cfg))
    seconds = time.time() - start
    eval_steps = result["mean_steps"] * result["episodes"]
    rows["evaluation"] = dict(seconds=seconds, peak_gib=peak_memory_gib(),
                              rate=f"{eval_steps / seconds:.2f} env steps/s "
                                   f"({eval_batch} episodes in one batch)")
    rows["prompt_tokens"] = len(msgrpo.lap_prompt_ids(tokenizer,
                                                      envs.make(cfg.env).reset(seed=0)[0], cfg))
    return rows


def markdown(rows: dict, cfg: msgrpo.Config, layers: int, eval_batch: int, command: str) -> str:
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    memory = ("peak allocated GPU memory" if torch.cuda.is_available()
              else "peak resident memory of the process")
    lines = [
        f"# Qwen2.5-3B-shaped model ({layers} of 36 layers), NF4 + LoRA r {cfg.lora_r}: "
        f"one MS-GRPO iteration",
        "",
        f"`{command}`",
        "",
        f"Device: {where}; torch {torch.__version__}. Random weights, so every reply runs to "
        f"{cfg.max_new_tokens} new tokens and every episode to its "
        f"{cfg.env_options.get('max_steps', 16)}-step limit: the longest rollout these sizes "
        f"allow. {cfg.groups} groups x {cfg.group_size} episodes, micro-batch {cfg.micro_batch}, "
        f"gradient checkpointing {'on' if cfg.gradient_checkpointing else 'off'}; prompts of "
        f"~{rows['prompt_tokens']} tokens. Memory: {memory}; rollout and update share one "
        f"reading (the peak of the whole iteration).",
        "",
        "| phase | seconds | peak memory (GiB) | throughput |",
        "| --- | --- | --- | --- |",
    ]
    for phase in ("load", "rollout", "update", "evaluation"):
        row = rows[phase]
        lines.append(f"| {phase} | {row['seconds']:.1f} | {row['peak_gib']:.2f} "
                     f"| {row.get('rate', '')} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=36,
                   help="decoder layers to build (36 = Qwen2.5-3B)")
    p.add_argument("--groups", type=int, default=msgrpo.Config.groups)
    p.add_argument("--group-size", type=int, default=msgrpo.Config.group_size)
    p.add_argument("--max-steps", type=int, default=16,
                   help="Frozen Lake step limit (default 16, the game's)")
    p.add_argument("--eval-batch", type=int, default=64, help="episodes in the evaluation batch")
    p.add_argument("--out", type=Path, help="also write the table here")
    args = p.parse_args(argv)
    for name in ("layers", "groups", "group_size", "max_steps", "eval_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")

    with tempfile.TemporaryDirectory() as tmp:
        folder = random_qwen_folder(Path(tmp) / "qwen2.5-3b-shaped", args.layers)
        cfg = msgrpo.resolve_defaults(msgrpo.Config(
            model=str(folder), groups=args.groups, group_size=args.group_size, iterations=1,
            env_options={"max_steps": args.max_steps},
            gradient_checkpointing=torch.cuda.is_available(),
            # Random weights give every episode the same return, so AAW would draw none; uniform
            # draws as many episodes (sample_frac of them) as AAW does once returns differ.
            sampling="uniform",
            run_dir=str(Path(tmp) / "run")))
        rows = check(cfg, args.eval_batch)
    command = ("python benchmarks/gpu_check.py "
               + " ".join(argv if argv is not None else sys.argv[1:]))
    table = markdown(rows, cfg, args.layers, args.eval_batch, command.strip())
    print(table)
    if args.out:
        args.out.write_text(table)
    return rows


if __name__ == "__main__":
    main()
