"""The text games on TRL's GRPOTrainer, with MS-GRPO's credit assignment: for more than one GPU.

msgrpo.py trains on one device in its own loop. Here the same games (envs.py), LAP prompt and
parser (msgrpo.lap_prompt_ids, msgrpo.response_text, env.parse_action) and LoRA policy
(msgrpo.load_policy) train under TRL's GRPOTrainer, which spreads rollouts and updates over
several GPUs (accelerate launch) and can sample with vLLM. In the order data flows:

    dataset       one row per training start seed, its prompt "seed 123"; TRL repeats each row G
                  times (num_generations), one row an episode: the G rows of a seed are a group
    rollout_func  play_rollouts: every row plays one episode from its seed's start state, all
                  rows in lockstep. An episode is one sequence: the first LAP prompt, then the
                  model's replies with the game's next observation between them in the chat
                  template; env_mask is 0 on the game's text, so only the replies carry loss
    reward        episode_returns: the episode's return, summed as envs.evaluate sums it
    advantage     TRL's group-relative A_i = R_i - mean_g R over the G episodes of a seed, spread
                  over every reply token of the episode: MS-GRPO's credit assignment

    python trl_bridge.py --env frozen_lake --max_steps 100 --output_dir trl-frozen_lake

Every GRPOConfig setting is a flag (--num_generations, --use_vllm, ...); the game's are GameArgs.
They are checked as msgrpo.py checks its own, before any model loads; --output_dir must be new,
empty or an earlier output of this command, never an msgrpo.py run or a model's folder.
What differs from msgrpo.py, and the multi-GPU commands: README.md, "TRL's GRPOTrainer".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import envs
import msgrpo
import support


# ---- Prompts: a row is a start seed ---------------------------------------------------------
# rollout_func receives only the dataset's "prompt" column, so the seed travels inside it.
SEED_PROMPT = "seed "


def seed_prompt(seed: int) -> str:
    return f"{SEED_PROMPT}{seed}"


def seed_of(prompt: str) -> int:
    if not isinstance(prompt, str) or not prompt.startswith(SEED_PROMPT):
        raise ValueError(f"a prompt here is {SEED_PROMPT!r} and a start seed, got {prompt!r}")
    return int(prompt.removeprefix(SEED_PROMPT))


def seed_dataset(n_seeds: int, seed: int):
    """n_seeds training start seeds, drawn below the held-out ones as msgrpo's iterations draw
    theirs; TRL shuffles them and repeats each G times."""
    from datasets import Dataset
    seeds = np.random.default_rng(seed).integers(0, envs.HELDOUT_SEED_START, size=n_seeds)
    return Dataset.from_dict({"prompt": [seed_prompt(int(s)) for s in seeds]})


# ---- An episode as one sequence: replies trained, the game's text between them masked --------
@dataclass
class EpisodeSequence:
    game: envs.TextGame
    seed: int
    prompt_ids: list  # the first observation's LAP prompt, as msgrpo plays it
    completion_ids: list = field(default_factory=list)  # replies and the game's text between them
    env_mask: list = field(default_factory=list)  # per completion token: 1 sampled, 0 game text
    logprobs: list = field(default_factory=list)  # sampled tokens' log-probs; 0.0 on game text
    episode_return: float = 0.0
    steps: int = 0
    invalid: int = 0
    success: bool = False
    done: bool = False

    def ids(self) -> list[int]:
        """What the model reads before its next reply: the whole episode so far."""
        return self.prompt_ids + self.completion_ids

    def append(self, ids: list[int], logprobs: list[float], sampled: bool) -> None:
        self.completion_ids += ids
        self.env_mask += [int(sampled)] * len(ids)
        self.logprobs += logprobs if sampled else [0.0] * len(ids)


def start_episode(seed: int, tokenizer, cfg: msgrpo.Config, env_options: dict) -> EpisodeSequence:
    game = envs.make(cfg.env, **env_options)
    observation, _ = game.reset(seed=seed)
    return EpisodeSequence(game, seed, msgrpo.lap_prompt_ids(tokenizer, observation, cfg))


REPLY_STAND_IN = "REPLY-STAND-IN"


def next_turn_text(tokenizer, observation: str, cfg: msgrpo.Config) -> str:
    """The chat template's text between one reply and the next: the end of the assistant's turn,
    a user turn with the game's next observation (msgrpo.lap_messages's), the start of the next
    assistant turn and the pre-filled reply prefix. Read off the template around a stand-in reply,
    so that any chat template writes its own turn markers."""
    messages = msgrpo.lap_messages(observation, cfg)
    reply = {"role": "assistant", "content": msgrpo.response_prefix(cfg) + REPLY_STAND_IN}
    text = tokenizer.apply_chat_template(messages + [reply, messages[-1]], tokenize=False,
                                         add_generation_prompt=True)
    return text[text.index(REPLY_STAND_IN) + len(REPLY_STAND_IN):] + msgrpo.response_prefix(cfg)


def game_text_ids(tokenizer, reply_ids: list[int], observation: str, cfg: msgrpo.Config,
                  end_ids: set[int]) -> list[int]:
    """next_turn_text as token ids. A reply that ended its turn itself (an end token the template
    also writes, e.g. <|im_end|>) keeps that token, and the template's copy is left out."""
    text = next_turn_text(tokenizer, observation, cfg)
    if reply_ids and reply_ids[-1] in end_ids:
        text = text.removeprefix(tokenizer.decode(reply_ids[-1:]))
    return tokenizer(text, add_special_tokens=False).input_ids


def take_turn(episode: EpisodeSequence, reply_ids: list[int], reply_logprobs: list[float],
              tokenizer, cfg: msgrpo.Config, end_ids: set[int]) -> None:
    """One step: the reply goes through the game's parser, its reward adds to the return as
    envs.evaluate adds it, and a game that goes on writes its next observation after the reply."""
    action = episode.game.parse_action(msgrpo.response_text(tokenizer, reply_ids, cfg))
    observation, reward, terminated, truncated, info = episode.game.step(action)
    episode.append(reply_ids, reply_logprobs, sampled=True)
    episode.episode_return += reward
    episode.steps += 1
    episode.invalid += int(info["invalid"])
    episode.success = bool(info.get("success", False))
    episode.done = terminated or truncated
    if not episode.done:
        episode.append(game_text_ids(tokenizer, reply_ids, observation, cfg, end_ids), [],
                       sampled=False)


def play_in_lockstep(episodes: list[EpisodeSequence], replies_for, tokenizer, cfg: msgrpo.Config,
                     end_ids: set[int], anyone_playing=lambda live: live > 0) -> None:
    """Every live episode takes a turn per round, as msgrpo.play_groups steps its episodes.
    replies_for(episodes) -> (reply ids, their log-probs) of the live episodes, in order.
    anyone_playing(live here) says whether any process still plays (a collective, across GPUs)."""
    while anyone_playing(sum(not ep.done for ep in episodes)):
        live = [ep for ep in episodes if not ep.done]
        replies, logprobs = replies_for(episodes)
        for episode, reply, logprob in zip(live, replies, logprobs, strict=True):
            take_turn(episode, list(reply), list(logprob), tokenizer, cfg, end_ids)


# ---- Where replies come from: the training model itself, or TRL's vLLM ------------------------
def transformers_replies(model, tokenizer, cfg: msgrpo.Config, temperature: float):
    """msgrpo's sampler (softmax(logits / T) only, stopped at </action>, prefix caching), on each
    live episode's whole sequence."""
    def replies_for(episodes):
        sequences = [ep.ids() for ep in episodes if not ep.done]
        if not sequences:  # this process is done; others still play
            return [], []
        return msgrpo.sample_responses(model, tokenizer, sequences, cfg.max_new_tokens, temperature)
    return replies_for


def vllm_replies(trainer):
    """TRL's vLLM generation (server or colocate), its weights synced by TRL before each rollout.
    In server mode the call is collective and hands each process back the rows at its index times
    its own row count, so every process sends one row per episode, a finished one as a one-token
    stand-in whose reply is dropped."""
    def replies_for(episodes):
        rows = [ep.prompt_ids[:1] if ep.done else ep.ids() for ep in episodes]
        _, ids, logprobs, _ = trainer.vllm_generation.generate(prompts=rows, images=None,
                                                               num_generations=1)
        live = [i for i, ep in enumerate(episodes) if not ep.done]
        # vLLM gives per-token top-k log-probs, the sampled token's first (TRL keeps the same)
        return [ids[i] for i in live], [[lp[0] for lp in logprobs[i]] for i in live]
    return replies_for


def anyone_playing_anywhere(trainer):
    """Whether any process has a live episode: all take the same number of rounds, which TRL's
    collective vLLM calls in server mode need."""
    def anyone_playing(live_here: int) -> bool:
        live = torch.tensor([live_here], device=trainer.accelerator.device)
        return trainer.accelerator.gather(live).sum().item() > 0
    return anyone_playing


# ---- rollout_func and the reward: what GRPOTrainer calls --------------------------------------
def rollout_func(cfg: msgrpo.Config):
    """GRPOTrainer's rollout_func: prompts (this process's rows, each seed's G copies in a row) ->
    one episode per row. Training games start where msgrpo's do (msgrpo.training_env_options)."""
    def play_rollouts(prompts: list[str], trainer) -> dict:
        from trl.models.utils import unwrap_model_for_generation
        tokenizer = trainer.processing_class
        end_ids = msgrpo.end_token_ids(trainer.accelerator.unwrap_model(trainer.model), tokenizer)
        options = msgrpo.training_env_options(cfg)
        episodes = [start_episode(seed_of(p), tokenizer, cfg, options) for p in prompts]
        anyone_playing = anyone_playing_anywhere(trainer)
        if trainer.use_vllm:
            play_in_lockstep(episodes, vllm_replies(trainer), tokenizer, cfg, end_ids,
                             anyone_playing)
            return rollout_output(episodes)
        args = trainer.args
        with unwrap_model_for_generation(
                trainer.model_wrapped, trainer.accelerator,
                gather_deepspeed3_params=args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs) as model:
            training = model.training  # sample_responses switches to eval mode; the loss is next
            replies_for = transformers_replies(model, tokenizer, cfg, trainer.temperature)
            play_in_lockstep(episodes, replies_for, tokenizer, cfg, end_ids, anyone_playing)
            model.train(training)
        return rollout_output(episodes)
    return play_rollouts


def rollout_output(episodes: list[EpisodeSequence]) -> dict:
    """rollout_func's answer. TRL trains on prompt_ids + completion_ids under env_mask; every other
    key reaches the reward functions, one value per row."""
    return {"prompt_ids": [ep.prompt_ids for ep in episodes],
            "completion_ids": [ep.completion_ids for ep in episodes],
            "logprobs": [ep.logprobs for ep in episodes],
            "env_mask": [ep.env_mask for ep in episodes],
            "episode_return": [ep.episode_return for ep in episodes],
            "seed": [ep.seed for ep in episodes], "steps": [ep.steps for ep in episodes],
            "invalid": [ep.invalid for ep in episodes],
            "success": [ep.success for ep in episodes]}


def episode_returns(completions, episode_return, steps, invalid, success, log_metric=None,
                    **_) -> list[float]:
    """The one reward: each episode's return (its rewards summed, the invalid penalty included),
    so TRL's group advantage is MS-GRPO's. Also logs the episodes' success and invalid rates."""
    if log_metric is not None:
        log_metric("episodes/success_rate", float(np.mean(success)))
        log_metric("episodes/invalid_rate", sum(invalid) / max(sum(steps), 1))
        log_metric("episodes/mean_steps", float(np.mean(steps)))
    return [float(r) for r in episode_return]


# ---- The trainer ------------------------------------------------------------------------------
def keep_lora_in_fp32(model) -> None:
    """TRL casts a quantized model's LoRA weights to bf16 (QLoRA's recipe); msgrpo keeps them fp32,
    where small updates are not rounded away. Done before train() builds the optimizer."""
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.float()


def make_trainer(cfg: msgrpo.Config, args, train_dataset):
    """GRPOTrainer on msgrpo's policy (4-bit base + LoRA), with the games as its rollouts."""
    from trl import GRPOTrainer
    if args.mask_truncated_completions:
        raise ValueError("mask_truncated_completions would drop most episodes: TRL counts a "
                         "completion as truncated unless it ends in an end token, and an "
                         "episode ends with its last reply, most often stopped at </action>")
    # The distributed state first: it sets this process's GPU, the "cuda" load_policy loads onto.
    _ = args.device
    model, tokenizer = msgrpo.load_policy(cfg)
    trainer = GRPOTrainer(model=model, reward_funcs=[episode_returns], args=args,
                          train_dataset=train_dataset, processing_class=tokenizer,
                          rollout_func=rollout_func(cfg))
    keep_lora_in_fp32(trainer.model)
    return trainer


# ---- Evaluation: with the history the policy trained with, and as msgrpo plays it -------------
def evaluate_with_history(model, tokenizer, cfg: msgrpo.Config, episodes: int) -> dict:
    """Greedy, on held-out seeds from the usual start: each reply sees the episode so far, as in
    training. Returns and success are counted as envs.evaluate counts them."""
    seeds = envs.heldout_seeds(episodes)
    played = [start_episode(seed, tokenizer, cfg, msgrpo.env_options(cfg)) for seed in seeds]
    end_ids = msgrpo.end_token_ids(model, tokenizer)
    replies_for = transformers_replies(model, tokenizer, cfg, temperature=0.0)
    for start in range(0, len(played), cfg.eval_batch):
        play_in_lockstep(played[start:start + cfg.eval_batch], replies_for, tokenizer, cfg, end_ids)
    steps = sum(ep.steps for ep in played)
    return {"episodes": len(played),
            "success_rate": float(np.mean([ep.success for ep in played])),
            "mean_return": float(np.mean([ep.episode_return for ep in played])),
            "invalid_rate": sum(ep.invalid for ep in played) / steps,
            "mean_steps": steps / len(played)}


def evaluate_both_ways(model, tokenizer, cfg: msgrpo.Config) -> dict:
    """The trained policy with the history it learned with, and with msgrpo's prompt (the current
    state only, envs.evaluate), which is what msgrpo's tables and compare.py --adapter play."""
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
        return {"with_history": evaluate_with_history(model, tokenizer, cfg, cfg.eval_episodes),
                "current_state_only": msgrpo.evaluate_policy(model, tokenizer, cfg)}


# ---- Command line: the game's settings, and every GRPOConfig setting as a flag ----------------
@dataclass
class GameArgs:
    env: str = field(default="frozen_lake", metadata={"help": ", ".join(envs.ENV_NAMES)})
    env_opt: list[str] = field(default_factory=list,
                               metadata={"help": "game options KEY=VALUE, e.g. max_steps=8"})
    model: str = field(default="", metadata={"help": "msgrpo's: '' = its default for the device"})
    lora_r: int = 8
    quantize: bool = field(default=True, metadata={"help": "NF4 4-bit base weights"})
    training_start: str = field(default="", metadata={"help": "'' = the game's (msgrpo's)"})
    reply_tokens: int = field(default=0, metadata={"help": "tokens per reply; 0 = msgrpo's"})
    start_seeds: int = field(default=10_000, metadata={"help": "training start seeds to draw"})
    eval_episodes: int = field(default=200, metadata={"help": "held-out episodes after training"})


def bridge_defaults(cuda: bool) -> dict:
    """GRPOConfig settings chosen to match msgrpo's defaults where TRL's differ: 8 groups x 8
    episodes per optimizer step on one process (16 per micro-step x 4 accumulated), msgrpo's
    constant learning rate, advantages centred but not divided by the group's std, each episode
    weighing the same in the loss (loss_type grpo: a mean over each episode's tokens, then over
    episodes)."""
    return dict(output_dir="trl-run", num_generations=8, per_device_train_batch_size=16,
                gradient_accumulation_steps=4, max_steps=100, learning_rate=2e-4,
                lr_scheduler_type="constant",
                scale_rewards="none", loss_type="grpo", beta=0.0, temperature=1.0,
                logging_steps=1, save_steps=25, report_to="none", bf16=cuda, use_cpu=not cuda,
                gradient_checkpointing=cuda)


def game_config(game: GameArgs, args) -> msgrpo.Config:
    """msgrpo's Config for the game and model, with the trainer's G and seed."""
    options = envs.options_from_text(game.env, [pair.split("=", 1) for pair in game.env_opt])
    return msgrpo.resolve_defaults(msgrpo.Config(
        env=game.env, env_options=options, model=game.model, lora_r=game.lora_r,
        quantize=game.quantize, training_start=game.training_start,
        max_new_tokens=game.reply_tokens, group_size=args.num_generations, seed=args.seed,
        eval_episodes=game.eval_episodes, run_dir=args.output_dir))


# ---- Checks before any model loads: msgrpo.py's, on this command line's flags ------------------
# The settings of msgrpo's Config that come from a flag here, checked by support.SETTING_RANGES.
BRIDGE_FLAGS = {"lora_r": "--lora_r", "max_new_tokens": "--reply_tokens",
                "group_size": "--num_generations", "eval_episodes": "--eval_episodes"}
# Transformers seeds numpy's global generator with --seed, which takes 0 .. 2**32 - 1 only.
SEED_LIMIT = 2**32
# Held-out episodes: beyond this, days of play; in the billions, a list of seeds fills the memory.
MAX_EVAL_EPISODES = 100_000
KNOWN_MODELS = ("smollm2-135m", "tiny")


def fail(message: str):
    raise SystemExit(f"error: {message}")


def model_problem(name: str) -> str:
    """Why --model names no model this can load, or "": a known name, a hub id (owner/name) or a
    folder that holds a transformers model."""
    if name in KNOWN_MODELS:
        return ""
    if problem := support.model_folder_problem(name):
        return problem
    if support.looks_like_a_folder(name) or "/" in name:
        return ""  # a model folder, or a hub id: transformers fetches it
    if Path(name).is_dir():
        return support.model_folder_problem(f"./{name}")
    return (f"{name} is neither {' nor '.join(KNOWN_MODELS)}, a hub id (owner/name) nor a model "
            f"folder")


def checked_game_config(game: GameArgs, flags) -> msgrpo.Config:
    """game_config, each flag checked first as msgrpo.py checks its own (support.validate_config):
    one line and exit on the first bad one. flags: the parsed command line (num_generations, seed,
    output_dir)."""
    if game.env not in envs.GAMES:
        fail(f"--env {game.env}: valid envs: {', '.join(envs.ENV_NAMES)}")
    try:
        pairs = [support.parse_env_option(text) for text in game.env_opt]
        envs.options_from_text(game.env, pairs)
    except (argparse.ArgumentTypeError, ValueError) as error:
        fail(f"--env_opt: {error}")
    starts = envs.GAMES[game.env].starts
    if game.training_start and game.training_start not in starts:
        fail(f"--training_start is {game.training_start}; for {game.env} it must be one of "
             f"{', '.join(starts)}")
    if game.reply_tokens < 0:
        fail(f"--reply_tokens is {game.reply_tokens}; it must be at least 0 (0: msgrpo's)")
    if not 1 <= game.start_seeds <= envs.HELDOUT_SEED_START:  # more would repeat training seeds
        fail(f"--start_seeds is {game.start_seeds}; it must be from 1 to "
             f"{envs.HELDOUT_SEED_START}, the training seeds there are")
    if not 0 <= flags.seed < SEED_LIMIT:
        fail(f"--seed is {flags.seed}; it must be from 0 to {SEED_LIMIT - 1}")
    if game.eval_episodes > MAX_EVAL_EPISODES:
        fail(f"--eval_episodes is {game.eval_episodes}; it must be at most {MAX_EVAL_EPISODES}")
    cfg = game_config(game, flags)
    for name, flag in BRIDGE_FLAGS.items():
        value = getattr(cfg, name)
        allowed, what = support.SETTING_RANGES[name]
        if not (math.isfinite(value) and allowed(value)):
            fail(f"{flag} is {value}; it must be {what}")
    for options in (msgrpo.env_options(cfg), msgrpo.training_env_options(cfg)):
        try:
            game_made = envs.make(cfg.env, **options)
        except ValueError as error:
            fail(f"--env_opt: {error}")
    if warning := envs.pointless_options_warning(game_made):
        print(f"{cfg.env}: {warning}", file=sys.stderr)
    if problem := model_problem(cfg.model):
        fail(f"--model {problem}")
    if problem := output_dir_problem(Path(flags.output_dir)):
        fail(f"--output_dir {flags.output_dir} {problem}")
    return cfg


# ---- The output folder: written only if new, empty or this command's own earlier output ---------
CHECKPOINT_FOLDER = re.compile(r"checkpoint-\d+")  # the trainer's save every save_steps
TRL_OUTPUT_FILES = ("adapter_config.json", "adapter_model.safetensors", "training_args.bin",
                    "trainer_state.json")
EVAL_KEYS = {"with_history", "current_state_only"}  # evaluate_both_ways's eval.json


def read_json(path: Path):
    """path's JSON, or None where it is no JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None


def output_dir_problem(folder: Path) -> str:
    """Why the trainer may not write `folder`, or "". Its save_model and eval.json would replace an
    msgrpo.py run's files (the run then no longer resumes) or a model's, so a folder that holds
    anything but an earlier output of this command is refused."""
    if folder.exists() and not folder.is_dir():
        return "is a file"
    if (blocked := support.unwritable_folder(folder)) is not None:
        return f"cannot be written: {blocked} is not writable"
    names = sorted(path.name for path in folder.iterdir()) if folder.is_dir() else []
    if not names:
        return ""
    config = read_json(folder / "config.json") if "config.json" in names else None
    evaluation = read_json(folder / "eval.json") if "eval.json" in names else None
    ours_eval = isinstance(evaluation, dict) and EVAL_KEYS <= set(evaluation)
    run_files = [name for name in (*support.RUN_FILES, support.LOCK_FILE) if name in names
                 and name not in ("config.json", "eval.json")]
    if (isinstance(config, dict) and "env" in config) or run_files \
            or ("eval.json" in names and not ours_eval):
        return "holds an msgrpo.py run: train into a new or empty --output_dir"
    ours = ours_eval or any(name in TRL_OUTPUT_FILES or CHECKPOINT_FOLDER.fullmatch(name)
                            for name in names)
    if "config.json" in names and not ours:
        return "holds a model (its config.json): train into a new or empty --output_dir"
    if not ours:
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        return (f"holds files that are no output of trl_bridge.py ({shown}): train into a new or "
                f"empty --output_dir")
    return ""


def main(argv: list[str] | None = None):
    from transformers import HfArgumentParser
    from trl import GRPOConfig
    parser = HfArgumentParser((GameArgs, GRPOConfig))
    parser.set_defaults(**bridge_defaults(torch.cuda.is_available()))
    # The flags are checked before GRPOConfig is made: it checks a few itself, with a traceback.
    flags = parser.parse_args(argv)
    game = GameArgs(**{f.name: getattr(flags, f.name) for f in dataclasses.fields(GameArgs)})
    cfg = checked_game_config(game, flags)
    try:
        _, args = parser.parse_args_into_dataclasses(argv)
    except ValueError as error:
        fail(support.one_line(error))
    # TRL's vLLM samples each reply with max_completion_length tokens, stopped after </action>
    args.max_completion_length = cfg.max_new_tokens
    if args.use_vllm:
        args.generation_kwargs = {"stop": [msgrpo.ACTION_END], "include_stop_str_in_output": True,
                                  **(args.generation_kwargs or {})}
    trainer = make_trainer(cfg, args, seed_dataset(game.start_seeds, args.seed))
    trainer.train()
    trainer.save_model(args.output_dir)  # the LoRA adapter
    if trainer.accelerator.is_main_process and cfg.eval_episodes > 0:
        model = trainer.accelerator.unwrap_model(trainer.model)
        result = evaluate_both_ways(model, trainer.processing_class, cfg)
        Path(args.output_dir, "eval.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
    trainer.accelerator.wait_for_everyone()
    return trainer


if __name__ == "__main__":
    main(sys.argv[1:])
