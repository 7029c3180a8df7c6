"""MS-GRPO: multi-step group-relative policy optimisation for language agents, in one file.

A language model plays a text game (envs.py). For each of B start states it plays a group of G
episodes; every step of an episode is credited with the episode's return, normalised within its
group; episodes are drawn in proportion to |advantage| (AAW sampling); a clipped policy loss
updates LoRA weights on a 4-bit base. Paper: Dilkes, Yazdanpanah, Stein, arXiv 2508.10839.

Sections, in the order data flows: 1. config; 2. LAP prompt; 3. model; 4. rollouts (the sampling
loop); 5. returns R_i = sum_t r_it; 6. advantages A_i = R_i - mean_g R, broadcast to every token;
7. AAW sampling, P(i) ~ |A_i|; 8. loss, min(rho A, clip(rho, 1 - eps, 1 + eps) A) (+ beta KL), and
the log-prob forward; 9. the training loop; 10. evaluation; 11. main.

This is the plain path, the one CUDA runs. On the CPU, cpu_speedups.py swaps in the same numbers
faster in three places (the rollouts' first forward, the update's batches, the 4-bit weights),
under `cfg.cpu_speedups`. support.py holds what is not MS-GRPO: models, run folder, probe, plots,
command line. Another algorithm trains in this loop by giving train() its `update`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

import cpu_speedups
import envs
import support
from support import read_metrics  # msgrpo.read_metrics(run_dir): a run's metrics.jsonl, as rows
# What Config leaves to the game and the device ("" / 0 / -1 below): support.py's tables, as data.
from support import CPU_MODEL, GPU_MODEL, resolve_defaults

# 1. Config ---------------------------------------------------------------------------------------
def setting(default, help: str):  # a Config field: its default and its flag's one line of --help
    return field(default=default, metadata={"help": help})

@dataclass
class Config:
    env: str = setting("frozen_lake", "the game: frozen_lake, snake or snake_poison_apple")
    env_options: dict = field(default_factory=dict, metadata={"help": "game options (envs.make), "
                              "repeatable: size=4, slippery=true, max_steps=16, opponent=true ..."})
    model: str = setting("", f'the base model: "" = {GPU_MODEL} on CUDA, {CPU_MODEL} on the CPU; '
                             'or "tiny", a hub id, a path')
    quantize: bool = setting(True, "NF4 4-bit base weights (bitsandbytes), in compute_dtype")
    lora_r: int = setting(8, "LoRA rank")
    iterations: int = setting(0, "training iterations; 0 = 100 on CUDA, 130 on the CPU (Snake 70)")
    groups: int = setting(8, "B: start states per iteration")
    group_size: int = setting(8, "G: episodes per start state")
    late_after: int = setting(-1, "early-phase iterations; 0 = one phase; -1 = the game's")
    temperature: float = setting(1.0, "rollout temperature of the early phase")
    late_temperature: float = setting(1.5, "rollout (and loss) temperature of the late phase")
    lr: float = setting(2e-4, "AdamW learning rate of the early phase")
    late_lr: float = setting(1e-4, "AdamW learning rate of the late phase")
    training_start: str = setting("", "where training games start; \"\" = the game's own")
    think: bool = setting(False, "ask for <think>...</think> before the action")
    prefill: bool = setting(True, 'end the prompt with "<action>" when not thinking')
    max_new_tokens: int = setting(0, "reply tokens; 0 = 6 (Frozen Lake), Snake 1, thinking 256")
    invalid_penalty: float = setting(-0.1, "reward added for an unparseable or illegal reply")
    scale_advantages: bool = setting(False, "also divide A by the group's std (the paper's form)")
    episode_mean: bool = setting(True, "every trained episode weighs the same, whatever its length")
    sampling: str = setting("aaw", "which episodes train: aaw | uniform | all (choose_episodes)")
    sample_frac: float = setting(0.5, "K = ceil(sample_frac * B * G)")
    epochs: int = setting(1, "passes over the sampled steps")
    minibatch: int = setting(-1, "steps per optimizer step; 0 = all (ratio 1); -1 = 0, Snake 16")
    micro_batch: int = setting(0, "distinct steps a forward/backward (memory); 0 = 16 (thinking 4)")
    grad_clip: float = setting(1.0, "max gradient norm")
    beta: float = setting(-1.0, "KL weight to the reference (adapter off); -1 = 0, Snake 0.1")
    eps_clip: float = setting(0.2, "ratio clip")
    gradient_checkpointing: bool = setting(False, "trade compute for memory; on by default on CUDA")
    cpu_speedups: bool = setting(True, "cpu_speedups.py: the same numbers faster (CPU only)")
    eval_every: int = setting(0, "0 = evaluate only before and after training")
    eval_episodes: int = setting(200, "held-out episodes per evaluation")
    eval_batch: int = setting(0, "episodes in lockstep when evaluating; 0 = 64 on CPU, 32 on CUDA")
    probe_every: int = setting(5, "iterations between map-reading probes (Frozen Lake); 0 = off")
    seed: int = setting(0, "random seed")
    run_dir: str = setting("", 'where the run is written; "" = runs/<env>-<time>')

TRAINING_ONLY_OPTIONS = ("varied_rules",)  # Snake's rules drawn per seed: trained on, not scored

def env_options(cfg: Config) -> dict:
    """The options held-out games are played with (evaluation, the probe)."""
    return {"invalid_penalty": cfg.invalid_penalty,
            **{k: v for k, v in cfg.env_options.items() if k not in TRAINING_ONLY_OPTIONS}}

def training_env_options(cfg: Config) -> dict:
    """Training rollouts' game options, starting at cfg.training_start: the games' own (beside_hole,
    facing_wall) make a group's first move decide its return. Evaluation starts as usual."""
    return {"invalid_penalty": cfg.invalid_penalty, **cfg.env_options,
            "start": cfg.training_start}

# 2. LAP prompt: the language-agent policy's two ends (observation -> prompt, response -> action)
SYSTEM_PROMPT = "You are playing a grid game."
# Measured on SmolLM2-135M (results/NOTES.md): naming the action list and showing example answers
# gives far more parseable replies than "<action>MOVE</action>", which it copies verbatim. The
# base model mostly says whichever example it was shown, so the examples are two moves, not one.
FORMAT_PLAIN = ("Answer with exactly one action word from the action list, inside"
                " <action></action>, e.g. <action>down</action> or <action>right</action>.")
FORMAT_THINK = ("Think briefly inside <think></think>, then answer with exactly one action word"
                " from the action list, inside <action></action>.")
ACTION_END = "</action>"

def response_prefix(cfg: Config) -> str:
    """Text pre-filled into the assistant turn; small models then only have to write the move."""
    return "<action>" if cfg.prefill and not cfg.think else ""

def response_text(tokenizer, response_ids: list[int], cfg: Config) -> str:
    """What the parser reads: the pre-filled prefix and the sampled reply together."""
    return response_prefix(cfg) + tokenizer.decode(response_ids, skip_special_tokens=True)

def lap_messages(obs_text: str, cfg: Config) -> list[dict]:
    """The current state only, no history: a short prompt keeps training tokens down."""
    system = f"{SYSTEM_PROMPT} {FORMAT_THINK if cfg.think else FORMAT_PLAIN}"
    return [{"role": "system", "content": system}, {"role": "user", "content": obs_text}]

def lap_prompt_ids(tokenizer, obs_text: str, cfg: Config) -> list[int]:
    """Chat template + the pre-filled start of the reply, as token ids."""
    text = tokenizer.apply_chat_template(lap_messages(obs_text, cfg), tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text + response_prefix(cfg), add_special_tokens=False).input_ids

# 3. Model: 4-bit base + LoRA. The same code runs on CUDA and on the CPU. -------------------------
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

def compute_dtype(device: str) -> torch.dtype:
    """bf16 activations on CUDA (half the memory of fp32, and faster); fp32 on the CPU (faster)."""
    return torch.bfloat16 if device == "cuda" else torch.float32

def load_policy(cfg: Config, adapter: str | Path | None = None):
    """Base model (4-bit if cfg.quantize) with a trainable LoRA adapter, new or loaded from disk.
    Its other weights (embedding, norms) stay in the compute dtype, and so do activations and the KV
    cache; peft's prepare_model_for_kbit_training would cast them to fp32, doubling both."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = compute_dtype(device)
    path = support.model_path(cfg.model)  # a hub id, a folder, or a bundled model
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"  # batched generation appends to the right end of every row
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype) if cfg.quantize else None
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, quantization_config=quantization, device_map={"": device})
    model.requires_grad_(False)  # the base is frozen: only LoRA weights train
    if cfg.quantize and device == "cpu":
        support.keep_4bit_weights_differentiable(model)  # a bitsandbytes fix, not a speed-up
    if cfg.gradient_checkpointing:  # non-reentrant: the reentrant form needs inputs that need grad
        model.activation_checkpointing_enable({"use_reentrant": False})
    if adapter is not None:
        model = support.load_adapter(model, adapter)  # one line if it does not load
    else:
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=2 * cfg.lora_r, lora_dropout=0.0,
                          target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
    # LoRA weights stay fp32 (peft's default): bf16 or fp16 would round small updates away.
    return model, tokenizer

# 4. Rollouts: B groups x G episodes, all live episodes stepped together --------------------------
def end_token_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    return ids | {tokenizer.eos_token_id}

def ends_reply(ids: list[int], end_ids: set[int], tokenizer) -> bool:
    """Whether a reply's last token ends it: an end token, or one completing </action> (asked after
    every token, so that lies in the last len(ACTION_END) tokens, each at least one character)."""
    return ids[-1] in end_ids or ACTION_END in tokenizer.decode(ids[-len(ACTION_END):])

def sample_token(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from softmax(logits / T) (T = 0: the most likely), and its log-prob, by
    inverse transform sampling: one uniform draw a row (torch.multinomial draws one a token)."""
    logits = logits.float()
    if temperature <= 0:
        logprobs = logits.log_softmax(-1)
        token = logits.argmax(-1, keepdim=True)
    else:
        logprobs = (logits / temperature).log_softmax(-1)
        cumulative = logprobs.exp().cumsum(-1)
        if not torch.isfinite(cumulative[:, -1]).all():
            raise FloatingPointError("the policy's next-token probabilities are not finite")
        draw = torch.rand(len(logits), 1, device=logits.device) * cumulative[:, -1:]
        token = torch.searchsorted(cumulative, draw).clamp(max=logits.shape[-1] - 1)
    return token, logprobs.gather(-1, token)

@torch.no_grad()
def sample_responses(
        model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float,
        speedups: dict | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """Every prompt's reply, a token at a time: (sampled ids, their log-probs). softmax(logits / T)
    and nothing else (no top-k, top-p), so the loss recomputes the very distribution sampled; T = 0
    is greedy. Left padding puts every row's next token last; after the prompts' forward each step
    runs only the new token against the kept keys and values (the KV cache). A reply ends at an end
    token or "</action>". speedups: None on this plain path; a dict: cpu_speedups.read_prompts."""
    model.eval()
    device = next(model.parameters()).device
    end_ids = end_token_ids(model, tokenizer)
    weights = nullcontext() if speedups is None else cpu_speedups.dequantized_4bit_weights(model)
    with weights:
        if speedups is None:
            input_ids, attention_mask = support.left_pad(prompts, tokenizer.pad_token_id)
            attention_mask = attention_mask.to(device)
            out = model(input_ids=input_ids.to(device), attention_mask=attention_mask,
                        position_ids=support.left_padded_positions(attention_mask),
                        use_cache=True, logits_to_keep=1)
            logits, cache = out.logits[:, -1], out.cache
        else:
            logits, cache, attention_mask = cpu_speedups.read_prompts(
                model, prompts, tokenizer.pad_token_id, max_new_tokens, speedups)
        position_ids = attention_mask.sum(1, keepdim=True) - 1
        replies, logprobs = [[] for _ in prompts], [[] for _ in prompts]
        ended = [False] * len(prompts)
        for step in range(max_new_tokens):
            token, logprob = sample_token(logits, temperature)
            for row, (new, new_logprob) in enumerate(zip(token[:, 0].tolist(),
                                                         logprob[:, 0].tolist())):
                if not ended[row]:
                    replies[row].append(new)
                    logprobs[row].append(new_logprob)
                    ended[row] = ends_reply(replies[row], end_ids, tokenizer)
            if all(ended) or step == max_new_tokens - 1:
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(token), 1)], 1)
            position_ids = position_ids + 1
            logits = model(input_ids=token, attention_mask=attention_mask,
                           position_ids=position_ids, cache=cache, use_cache=True,
                           logits_to_keep=1).logits[:, -1]
    return replies, logprobs

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

def play_groups(model, tokenizer, cfg: Config, seeds: list[int],
                progress: bool = False) -> list[Episode]:
    """G episodes from each seed's start state, every live episode advanced by one batched call."""
    games = [envs.make(cfg.env, **training_env_options(cfg))
             for _ in seeds for _ in range(cfg.group_size)]
    episodes = [Episode(group=g, seed=s) for g, s in enumerate(seeds)
                for _ in range(cfg.group_size)]
    observations = [game.reset(seed=ep.seed)[0] for game, ep in zip(games, episodes)]
    bar = tqdm(desc="rollout steps", unit="step", disable=not progress, leave=False)
    speedups = {} if cfg.cpu_speedups else None  # the rules' keys and values, read once
    while live := [i for i, ep in enumerate(episodes) if not ep.done]:
        prompts = [lap_prompt_ids(tokenizer, observations[i], cfg) for i in live]
        responses, logprobs = sample_responses(model, tokenizer, prompts, cfg.max_new_tokens,
                                               cfg.temperature, speedups)
        for i, prompt, response, logprob in zip(live, prompts, responses, logprobs):
            episode, game = episodes[i], games[i]
            text = response_text(tokenizer, response, cfg)
            action = game.parse_action(text)
            observations[i], reward, terminated, truncated, info = game.step(action)
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
    when scale is False (the trainer's default). Over the whole batch it would mix start states of
    different difficulty. Equal returns give exactly 0: they say nothing about what is better."""
    returns, group_ids = np.asarray(returns, dtype=float), np.asarray(group_ids)
    advantages = np.zeros_like(returns)
    for g in np.unique(group_ids):
        group = returns[group_ids == g]
        if np.ptp(group) != 0:
            centred = group - group.mean()
            advantages[group_ids == g] = centred / (group.std() + eps) if scale else centred
    return advantages

def zero_variance_groups(returns, group_ids) -> int:
    returns, group_ids = np.asarray(returns), np.asarray(group_ids)  # groups that teach nothing
    return int(sum(np.ptp(returns[group_ids == g]) == 0 for g in np.unique(group_ids)))

def episode_length_weights(episodes: list[Episode], chosen) -> np.ndarray:
    """w_i = mean_j T_j / T_i over the chosen episodes (T = steps): A_i w_i makes the loss's token
    mean a mean over episodes (the clipped objective is linear in a positive scale of A), so an
    episode that survives 8 steps does not outvote one that falls into a hole at its first."""
    lengths = np.array([len(ep.responses) for ep in episodes], dtype=float)
    weights = np.ones(len(episodes))
    if len(chosen):
        weights[chosen] = lengths[chosen].mean() / lengths[chosen]
    return weights

def episode_steps(episodes: list[Episode], advantages: np.ndarray, chosen) -> list[tuple]:
    """The broadcast to steps: (prompt ids, response ids, A_i) per step of each chosen episode."""
    return [(prompt, response, float(advantages[i]))
            for i in chosen for prompt, response in zip(episodes[i].prompts, episodes[i].responses)]

@dataclass
class StepBatch:
    """Steps as one tensor batch: prompt + response, left-padded so every response ends last."""
    input_ids: torch.Tensor  # [N, L]
    attention_mask: torch.Tensor  # [N, L] 1 on prompt and response tokens
    response_mask: torch.Tensor  # [N, L] 1 on response tokens only: the tokens the loss trains
    advantages: torch.Tensor  # [N] each step's episode advantage

    def token_advantages(self) -> torch.Tensor:
        """The broadcast: every response token gets its episode's A_i, prompt and pad get 0."""
        return self.advantages[:, None] * self.response_mask  # [N, L]

    def response_tokens(self) -> int:
        return int(self.response_mask.sum())

def collate_steps(steps: list[tuple[list[int], list[int], float]], pad_id: int) -> StepBatch:
    """steps: (prompt ids, response ids, advantage) -> StepBatch."""
    input_ids, attention_mask = support.left_pad([list(p) + list(r) for p, r, _ in steps], pad_id)
    response_mask = torch.zeros_like(attention_mask)
    for row, (_, response, _) in enumerate(steps):
        if response:
            response_mask[row, -len(response):] = 1
    return StepBatch(input_ids, attention_mask, response_mask,
                     advantages=torch.tensor([a for _, _, a in steps], dtype=torch.float32))

# 7. AAW sampling: which episodes the update trains on --------------------------------------------
def aaw_sample(advantages, k: int, rng: np.random.Generator) -> np.ndarray:
    """k episode indices without replacement, P(i) proportional to |A_i|. Episodes with A_i = 0 are
    never drawn (their loss is 0: they would cost tokens for nothing); fewer than k nonzero: all."""
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
def clipped_policy_loss(logp_new, logp_old, advantages, mask, eps_clip: float = 0.2):
    """L = -mean over masked tokens of min(rho A, clip(rho, 1 - eps, 1 + eps) A), rho = e^(new-old).
    advantages is [N] (one per step, broadcast over its tokens) or [N, T] (one per token)."""
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    ratio = torch.exp(logp_new - logp_old)
    surrogate = torch.minimum(ratio * advantages,
                              ratio.clamp(1 - eps_clip, 1 + eps_clip) * advantages)
    mask = mask.to(surrogate.dtype)
    return -(surrogate * mask).sum() / mask.sum().clamp(min=1)

def kl_to_reference(logp_new, logp_ref, mask) -> torch.Tensor:
    """k3 estimator of KL(new || ref) per token: e^(ref - new) - (ref - new) - 1 >= 0."""
    diff = logp_ref - logp_new
    mask = mask.to(diff.dtype)
    return ((diff.exp() - diff - 1) * mask).sum() / mask.sum().clamp(min=1)

def response_logprobs(model, batch: StepBatch, temperature: float):
    """Log-probs of the sampled response tokens under the current policy at temperature T, as
    (logprobs [N, n], mask [N, n]), n the longest response. Responses end last (left padding), so
    only the last n + 1 positions need the vocabulary (logits_to_keep): position t predicts t + 1.
    Position ids follow the attention mask: a padded row sees the positions it was sampled at."""
    n = int(batch.response_mask.sum(1).max())
    if isinstance(batch, cpu_speedups.SharedSteps):  # the CPU speed-ups' batch: same numbers
        return cpu_speedups.response_logprobs(model, batch, n, temperature, token_logprobs)
    device = next(model.parameters()).device
    logits = model(input_ids=batch.input_ids.to(device),
                   attention_mask=batch.attention_mask.to(device),
                   position_ids=support.left_padded_positions(batch.attention_mask).to(device),
                   logits_to_keep=n + 1).logits
    return (token_logprobs(logits, batch.input_ids[:, -n:], temperature),
            batch.response_mask[:, -n:].to(device))

def token_logprobs(logits, targets, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) at each target token: logits [N, n + 1, V], targets [N, n]."""
    logits = logits[:, :-1].float() / max(temperature, 1e-6)
    targets = targets.to(logits.device)
    return logits.gather(-1, targets[..., None]).squeeze(-1) - logits.logsumexp(-1)

# 9. Training loop: rollouts, then the update (msgrpo_update: sections 5-8), then a checkpoint ----
def chunks(items: list, size: int) -> list[list]:
    """Consecutive slices of `size` items (all of them in one when size is 0)."""
    size = size if size > 0 else len(items)
    return [items[start:start + size] for start in range(0, len(items), size)]

def update_policy(model, optimizer, tokenizer, steps: list, cfg: Config,
                  rng: np.random.Generator) -> dict:
    """epochs x minibatches x micro-batches: a minibatch of cfg.minibatch shuffled steps (all if
    0) is one AdamW step, its gradient summed over micro-batches (memory): L_m, a mean over n_m
    tokens, enters as (n_m / N) L_m. With one AdamW step the ratio is exactly 1 (old = new,
    detached); otherwise a scoring pass first records the sampling policy's log-probs."""
    model.train()
    order = [steps[i] for i in rng.permutation(len(steps))]
    if cfg.cpu_speedups:  # identical steps one row, the shared prefix once (cpu_speedups.py)
        split, collate = cpu_speedups.micro_batches, cpu_speedups.collate_steps
        weights = cpu_speedups.dequantized_4bit_weights(model)
    else:
        split, collate, weights = chunks, collate_steps, nullcontext()
    minibatches = [[collate(micro, tokenizer.pad_token_id) for micro in split(mb, cfg.micro_batch)]
                   for mb in chunks(order, cfg.minibatch)]
    stats = {"loss": [], "kl": [], "clip_frac": [], "grad_norm": []}
    with weights:
        old_logprobs = [[None] * len(mb) for mb in minibatches]  # None: the ratio is exactly 1
        if cfg.epochs > 1 or len(minibatches) > 1:
            with torch.no_grad():
                old_logprobs = [[response_logprobs(model, batch, cfg.temperature)[0]
                                 for batch in mb] for mb in minibatches]
        bar = tqdm(total=cfg.epochs * len(minibatches), desc="optimizer steps", leave=False)
        for _ in range(cfg.epochs):
            for minibatch, old in zip(minibatches, old_logprobs):
                optimizer.zero_grad(set_to_none=True)
                total_tokens = sum(batch.response_tokens() for batch in minibatch)
                logged = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0}
                for batch, logp_old in zip(minibatch, old):
                    loss, kl, clipped, tokens = micro_batch_loss(model, batch, logp_old, cfg)
                    weight = tokens / total_tokens  # n_m / N
                    (loss * weight).backward()
                    for name, value in (("loss", loss.item() * weight), ("kl", kl.item() * weight),
                                        ("clip_frac", clipped / total_tokens)):
                        logged[name] += value
                params = [p for p in model.parameters() if p.requires_grad]
                logged["grad_norm"] = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip).item()
                optimizer.step()
                bar.update()
                for name, value in logged.items():
                    stats[name].append(value)
        bar.close()
    return {name: float(np.mean(values)) for name, values in stats.items()}

def micro_batch_loss(model, batch: StepBatch, logp_old, cfg: Config):
    """One micro-batch's clipped loss (+ beta KL), a mean over its response tokens: (loss, kl,
    tokens with rho = e^(logp - logp_old) outside 1 -/+ eps, tokens). logp_old None: rho is 1."""
    logp, mask = response_logprobs(model, batch, cfg.temperature)
    logp_old = logp.detach() if logp_old is None else logp_old
    loss = clipped_policy_loss(logp, logp_old, batch.advantages.to(logp.device), mask, cfg.eps_clip)
    kl = torch.zeros((), device=logp.device)
    if cfg.beta > 0:
        with torch.no_grad(), model.disable_adapter():
            logp_ref, _ = response_logprobs(model, batch, cfg.temperature)
        kl = kl_to_reference(logp, logp_ref, mask)
        loss = loss + cfg.beta * kl
    if not torch.isfinite(loss):
        raise FloatingPointError(f"non-finite loss {loss.item()}")
    clipped = ((torch.exp(logp.detach() - logp_old) - 1).abs() > cfg.eps_clip) & mask.bool()
    return loss, kl, int(clipped.sum()), int(mask.sum())

def msgrpo_update(model, optimizer, tokenizer, episodes: list[Episode], cfg: Config,
                  rng: np.random.Generator) -> dict:
    """Sections 5-8: returns, group advantages broadcast to steps, AAW sampling, clipped loss."""
    returns = episode_returns([ep.rewards for ep in episodes])
    advantages = group_advantages(returns, [ep.group for ep in episodes],
                                  scale=cfg.scale_advantages)
    chosen = choose_episodes(advantages, cfg, rng)
    weights = episode_length_weights(episodes, chosen) if cfg.episode_mean else 1.0
    steps = episode_steps(episodes, advantages * weights, chosen)
    stats = update_policy(model, optimizer, tokenizer, steps, cfg, rng) if steps else {}
    return {"episodes_trained": len(chosen), "steps_trained": len(steps),
            "tokens_trained": sum(len(p) + len(r) for p, r, _ in steps), **stats}

def train_iteration(model, optimizer, tokenizer, cfg: Config, rng: np.random.Generator,
                    update=msgrpo_update) -> dict:
    """One iteration: rollouts, update(model, optimizer, tokenizer, episodes, cfg, rng); metrics."""
    start = time.time()
    seeds = [int(s) for s in rng.integers(0, envs.HELDOUT_SEED_START, size=cfg.groups)]
    episodes = play_groups(model, tokenizer, cfg, seeds, progress=True)
    rollout_seconds = time.time() - start
    start = time.time()
    trained = update(model, optimizer, tokenizer, episodes, cfg, rng)
    update_seconds = time.time() - start
    returns = episode_returns([ep.rewards for ep in episodes])
    zero_variance = zero_variance_groups(returns, [ep.group for ep in episodes])
    snake = issubclass(envs.GAMES[cfg.env], envs.Snake)
    return support.iteration_metrics(episodes, returns, zero_variance, trained, snake,
                                     rollout_seconds, update_seconds)

def phase_settings(cfg: Config, iteration: int) -> tuple[float, float]:
    """(lr, temperature) for the first cfg.late_after iterations (all if 0), then (late_lr,
    late_temperature): a policy sure of its first move makes it in all G episodes at T = 1."""
    late = cfg.late_after and iteration > cfg.late_after
    return (cfg.late_lr, cfg.late_temperature) if late else (cfg.lr, cfg.temperature)

def train(cfg: Config, resume: bool = False, update=msgrpo_update, extra_modules=None) -> Path:
    """Train cfg.iterations iterations into cfg.run_dir (owned by this process until it returns),
    or go on with it (resume). update: an iteration's credit assignment (msgrpo_update's signature).
    extra_modules(model) -> {name: module}: what the update trains beside the policy (a critic), set
    as model.<name>, trained by the optimizer and kept in checkpoint.pt, out of the adapter."""
    with support.owned_run_folder(cfg.run_dir):
        checkpoint = support.checkpoint_to_resume(cfg.run_dir) if resume else None
        torch.manual_seed(cfg.seed)
        rng = np.random.default_rng(cfg.seed)
        model, tokenizer = load_policy(cfg, adapter=support.older_adapter(cfg.run_dir, checkpoint))
        print(support.describe_run(cfg, model, compute_dtype, GPU_MODEL, CPU_MODEL))
        extra = extra_modules(model) if extra_modules else {}
        for name, module in extra.items():
            setattr(model, name, module)  # a submodule now: model.parameters() includes it
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
        run = support.Run(cfg, checkpoint, model, optimizer, rng, extra)  # resumed, or a new folder
        probe_states = support.probe_states(cfg, env_options(cfg))  # none unless Frozen Lake
        prompt_ids = functools.partial(lap_prompt_ids, tokenizer, cfg=cfg)
        with run.interruptible():
            run.evaluate_when_due(run.saved, lambda: evaluate_policy(model, tokenizer, cfg))
            for iteration in run.iterations():
                with run.stopped_on_failure(iteration):
                    start = time.time()
                    # Before the update, like its line's rollout metrics: the policy that plays.
                    probe = (support.map_reading_probe(model, tokenizer, cfg, probe_states,
                             prompt_ids) if support.probe_due(cfg, iteration) else {})
                    lr, temperature = phase_settings(cfg, iteration)
                    for group in optimizer.param_groups:  # each time: a resumed one has its rate
                        group["lr"] = lr
                    phase = dataclasses.replace(cfg, temperature=temperature)
                    metrics = train_iteration(model, optimizer, tokenizer, phase, rng, update)
                    run.save({"iteration": iteration, **metrics, **probe, "lr": lr,
                              "temperature": temperature, "seconds": time.time() - start})
                run.evaluate_when_due(iteration, lambda: evaluate_policy(model, tokenizer, cfg))
            run.evaluate_final(lambda: evaluate_greedy_and_sampled(model, tokenizer, cfg))
        return run.finish()

# 10. Evaluation: the LAP policy as an agent for envs.evaluate, on held-out seeds -----------------
class LAPAgent:
    """A language-agent policy: act_batch(observations, infos) -> response texts."""

    def __init__(self, model, tokenizer, cfg: Config, greedy: bool = True):
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.temperature = 0.0 if greedy else cfg.temperature
        self.speedups = {} if cfg.cpu_speedups else None  # for this agent's weights

    def act_batch(self, observations: list[str], infos: list[dict]) -> list[str]:
        prompts = [lap_prompt_ids(self.tokenizer, obs, self.cfg) for obs in observations]
        replies, _ = sample_responses(self.model, self.tokenizer, prompts, self.cfg.max_new_tokens,
                                      self.temperature, self.speedups)
        return [response_text(self.tokenizer, r, self.cfg) for r in replies]

    def act(self, observation: str, info: dict) -> str:
        return self.act_batch([observation], [info])[0]

def evaluate_policy(model, tokenizer, cfg: Config, greedy: bool = True) -> dict:
    """Held-out seeds only (envs.heldout_seeds). Sampling here must not move the training RNG."""
    if cfg.eval_episodes <= 0:
        return {}
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):  # CPU and every GPU
        torch.manual_seed(cfg.seed)
        return envs.evaluate(LAPAgent(model, tokenizer, cfg, greedy), cfg.env,
                             envs.heldout_seeds(cfg.eval_episodes), batch_size=cfg.eval_batch,
                             progress=True, **env_options(cfg))

def evaluate_greedy_and_sampled(model, tokenizer, cfg: Config, sampled_episodes: int = 0) -> dict:
    """Greedy, and under "sampled" at T = 1 (the policy's own distribution, whatever its rollouts'
    temperature), sampled_episodes of them (0: as many as greedy)."""
    result = evaluate_policy(model, tokenizer, cfg)
    sampled_cfg = dataclasses.replace(cfg, eval_episodes=sampled_episodes or cfg.eval_episodes,
                                      temperature=1.0)
    result["sampled"] = evaluate_policy(model, tokenizer, sampled_cfg, greedy=False)
    return result

# 11. main: the command line (support.py: the flags, and the checks before the model loads) ------
def build_parser():
    """python msgrpo.py --help: a flag for every setting of Config, its help and default."""
    return support.build_parser(Config, __doc__.split("\n\n")[0])

def main(argv: list[str] | None = None) -> Path:
    args = build_parser().parse_args(argv)
    cfg, resume = support.config_from_args(args, Config, resolve_defaults, env_options)
    return train(cfg, resume=resume)

if __name__ == "__main__":
    cpu_speedups.run_under_jemalloc(sys.argv)
    main(sys.argv[1:])
