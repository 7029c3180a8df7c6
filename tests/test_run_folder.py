"""The run folder: a new run never destroys an old one, and an iteration is saved wholly or not at
all, wherever the process is killed."""

import errno
import json
import os
import shutil

import numpy as np
import peft
import pytest
import torch

import msgrpo
import support

TINY = ["--env", "frozen_lake", "--model", "tiny", "--groups", "1", "--group-size", "3",
        "--env-opt", "max_steps=2", "--eval-episodes", "2", "--eval-every", "1",
        "--probe-every", "0"]
TIMING = {"seconds", "rollout_seconds", "update_seconds", "train_tokens_per_second"}


@pytest.fixture(autouse=True)
def returns_that_differ(monkeypatch):
    """A random tiny model replies nonsense, so every episode returns the same and nothing would be
    updated; distinct returns make every iteration train, so a resume has an update to get wrong."""
    original = msgrpo.episode_returns
    monkeypatch.setattr(msgrpo, "episode_returns",
                        lambda rewards: original(rewards) + np.arange(len(rewards)))


def outcome(run_dir):
    """What a run produced: its metrics (timing aside), its evaluations and its final weights."""
    metrics = [{k: v for k, v in m.items() if k not in TIMING}
               for m in support.read_metrics(run_dir)]
    checkpoint = support.load_checkpoint(run_dir)
    return (metrics, support.load_json(run_dir / "eval.json"), checkpoint["iteration"],
            checkpoint["lora"])


def assert_same_outcome(run_dir, expected):
    metrics, evals, iteration, lora = outcome(run_dir)
    assert (metrics, evals, iteration) == expected[:3]
    assert lora.keys() == expected[3].keys() and all(torch.equal(lora[n], expected[3][n])
                                                     for n in lora)
    from safetensors.torch import load_file

    # the adapter matches the checkpoint
    adapter = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    assert len(adapter) == len(lora) and all(any(torch.equal(w, v) for v in lora.values())
                                             for w in adapter.values())


def snapshot(run_dir):
    return {str(path.relative_to(run_dir)): path.read_bytes()
            for path in sorted(run_dir.rglob("*")) if path.is_file()}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted two-iteration run, and the save steps its first iteration took."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    with pytest.MonkeyPatch.context() as patch:
        original = msgrpo.episode_returns
        patch.setattr(msgrpo, "episode_returns",
                      lambda rewards: original(rewards) + np.arange(len(rewards)))
        with SaveSteps(patch) as steps:
            msgrpo.main(TINY + ["--iterations", "2", "--run-dir", str(run_dir)])
    return run_dir, outcome(run_dir), steps.seen


class SaveSteps:
    """Counts, and optionally interrupts, the file operations of iteration 1's save.

    `kill_at` = n raises KeyboardInterrupt (Ctrl-C) at the n-th operation: before a rename or a
    delete, or halfway through a write, which leaves a half-written file behind.
    """

    def __init__(self, patch, kill_at=None):
        self.patch, self.kill_at, self.seen, self.active = patch, kill_at, [], False

    def __enter__(self):
        save_iteration = support.save_iteration

        def watched_save_iteration(run_dir, model, optimizer, rng, iteration, metrics=None,
                                   extra=None):
            self.active = iteration == 1
            try:
                save_iteration(run_dir, model, optimizer, rng, iteration, metrics, extra)
            finally:
                self.active = False

        self.patch.setattr(support, "save_iteration", watched_save_iteration)
        for owner, name, half_write in [(os, "replace", None), (os, "rename", None),
                                        (shutil, "rmtree", None),
                                        (torch, "save", self.half_save),
                                        (peft.PeftModel, "save_pretrained",
                                         self.half_save_pretrained)]:
            self.patch.setattr(owner, name, self.watch(getattr(owner, name), name, half_write))
        return self

    def __exit__(self, *exc):
        return False

    def watch(self, operation, name, half_write):
        def watched(*args, **kwargs):
            if self.active:
                self.seen.append(name)
                if len(self.seen) == self.kill_at:
                    if half_write:
                        half_write(*args)
                    raise KeyboardInterrupt
            return operation(*args, **kwargs)
        return watched

    @staticmethod
    def half_save(state, path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"PK\x03\x04 half a checkpoint")

    @staticmethod
    def half_save_pretrained(model, folder, *args, **kwargs):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "adapter_model.safetensors"), "wb") as f:
            f.write(b"half an adapter")


def test_the_save_sequence_has_the_steps_this_test_interrupts(straight):
    _, (metrics, *_), steps = straight
    assert {"replace", "save", "save_pretrained", "rename"} <= set(steps) and len(steps) >= 6
    assert all(m["steps_trained"] > 0 for m in metrics)  # every iteration updated the weights


def test_a_kill_anywhere_in_the_save_resumes_to_the_uninterrupted_run(straight, tmp_path,
                                                                      monkeypatch):
    _, expected, steps = straight
    for kill_at in range(1, len(steps) + 1):
        run_dir = tmp_path / f"killed-at-{kill_at}"
        with monkeypatch.context() as patch, SaveSteps(patch, kill_at) as save_steps:
            with pytest.raises(SystemExit) as stopped:
                msgrpo.main(TINY + ["--iterations", "2", "--run-dir", str(run_dir)])
            assert stopped.value.code == 130 and len(save_steps.seen) == kill_at
        # at most the unfinished iteration is lost
        assert support.load_checkpoint(run_dir)["iteration"] in (0, 1)
        msgrpo.main(["--resume", str(run_dir)])
        assert_same_outcome(run_dir, expected)


def test_a_run_stopped_in_its_first_evaluation_resumes(straight, tmp_path, monkeypatch):
    _, expected, _ = straight
    run_dir = tmp_path / "run"
    with monkeypatch.context() as patch:
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        patch.setattr(msgrpo, "evaluate_policy", interrupted)
        with pytest.raises(SystemExit):
            msgrpo.main(TINY + ["--iterations", "2", "--run-dir", str(run_dir)])
    msgrpo.main(["--resume", str(run_dir)])
    assert_same_outcome(run_dir, expected)


def test_non_finite_weights_are_never_saved(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    train_iteration = msgrpo.train_iteration

    def poisoned(model, *args):
        metrics = train_iteration(model, *args)
        with torch.no_grad():
            next(p for p in model.parameters() if p.requires_grad).fill_(float("nan"))
        return metrics

    monkeypatch.setattr(msgrpo, "train_iteration", poisoned)
    with pytest.raises(SystemExit, match="non-finite") as stopped:
        msgrpo.main(TINY + ["--iterations", "2", "--eval-episodes", "0", "--run-dir", str(run_dir)])
    assert "lower --lr" in str(stopped.value.code)
    checkpoint = support.load_checkpoint(run_dir)
    assert checkpoint["iteration"] == 0 and all(torch.isfinite(w).all()
                                                for w in checkpoint["lora"].values())
    assert support.read_metrics(run_dir) == []


def test_a_policy_that_diverged_stops_with_the_line_that_says_lower_the_lr(tmp_path, monkeypatch):
    """Weights that are finite but huge (a too high --lr) give the next rollouts non-finite
    probabilities: the run stops with a line, as for a non-finite loss, and keeps what it saved."""
    run_dir = tmp_path / "run"
    train_iteration = msgrpo.train_iteration

    def diverged(model, *args):
        metrics = train_iteration(model, *args)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.fill_(1e20)
        return metrics

    monkeypatch.setattr(msgrpo, "train_iteration", diverged)
    with pytest.raises(SystemExit, match="Stopped at iteration 2: .*not finite.*lower --lr"):
        msgrpo.main(TINY + ["--iterations", "3", "--eval-episodes", "0", "--run-dir", str(run_dir)])
    assert support.load_checkpoint(run_dir)["iteration"] == 1


def test_a_new_run_refuses_a_folder_that_holds_a_run_and_leaves_it_untouched(straight, tmp_path,
                                                                             monkeypatch):
    run_dir = tmp_path / "run"
    shutil.copytree(straight[0], run_dir)
    before = snapshot(run_dir)

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    with monkeypatch.context() as patch:
        patch.setattr(msgrpo, "load_policy", no_model)
        with pytest.raises(SystemExit) as refused:
            msgrpo.main(TINY + ["--iterations", "1", "--run-dir", str(run_dir)])
    message = str(refused.value.code)
    assert "--resume" in message and "--overwrite" in message and "\n" not in message
    assert snapshot(run_dir) == before


def test_overwrite_replaces_the_old_run_entirely(straight, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(straight[0], run_dir)
    msgrpo.main(TINY + ["--iterations", "1", "--eval-every", "0", "--eval-episodes", "0",
                        "--run-dir", str(run_dir), "--overwrite"])
    assert [m["iteration"] for m in support.read_metrics(run_dir)] == [1]
    assert not (run_dir / "eval.json").exists()  # no stale evaluation of the old run
    assert json.loads((run_dir / "config.json").read_text())["iterations"] == 1


def test_flags_given_with_resume_are_kept_by_the_next_resume(tmp_path, monkeypatch):
    """--resume D --iterations 3 --env-opt slippery=true, interrupted, then the plain --resume D
    that the interrupted run prints: it trains to 3, and D's max_steps survives the added option."""
    run_dir = tmp_path / "run"
    msgrpo.main(TINY + ["--iterations", "1", "--eval-episodes", "0", "--run-dir", str(run_dir)])
    train_iteration, calls = msgrpo.train_iteration, []

    def interrupted_in_the_second(*args):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return train_iteration(*args)

    with monkeypatch.context() as patch:
        patch.setattr(msgrpo, "train_iteration", interrupted_in_the_second)
        with pytest.raises(SystemExit):
            msgrpo.main(["--resume", str(run_dir), "--iterations", "3",
                         "--env-opt", "slippery=true"])
    saved = support.load_json(run_dir / "config.json")
    assert saved["iterations"] == 3 and saved["env_options"] == {"max_steps": 2, "slippery": True}
    msgrpo.main(["--resume", str(run_dir)])
    assert [m["iteration"] for m in support.read_metrics(run_dir)] == [1, 2, 3]


def test_an_adapter_whose_weights_fit_no_layer_is_refused_by_name(tmp_path):
    """peft only warns where an adapter's weight names match none of the model's layers; the base
    model would then be scored under the adapter's name."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    def base():
        return AutoModelForCausalLM.from_pretrained(support.tiny_model_folder())

    adapter = tmp_path / "adapter"
    lora = peft.LoraConfig(r=4, target_modules=msgrpo.LORA_TARGETS, task_type="CAUSAL_LM")
    peft.get_peft_model(base(), lora).save_pretrained(adapter)
    assert isinstance(support.load_adapter(base(), adapter), peft.PeftModel)  # as saved, it loads
    weights = load_file(adapter / "adapter_model.safetensors")
    for renamed in (lambda name: name.replace("layers", "blocks"),  # none loads
                    lambda name: name.replace("layers.0.", "layers.9.")):  # some do not
        save_file({renamed(name): w for name, w in weights.items()},
                  adapter / "adapter_model.safetensors")
        with pytest.raises(SystemExit) as refused:
            support.load_adapter(base(), adapter)
        assert str(adapter) in str(refused.value.code) and "\n" not in str(refused.value.code)


class LoRAOnly(torch.nn.Module):
    """The part of a policy a save reads: its LoRA weights, and peft's save_pretrained."""

    def __init__(self):
        super().__init__()
        self.lora_A = torch.nn.Parameter(torch.ones(2))

    def save_pretrained(self, folder, state_dict):
        SaveSteps.half_save_pretrained(self, folder)
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_save_onto_a_full_disk_stops_with_one_line_and_leaves_the_older_files(tmp_path,
                                                                                 monkeypatch):
    run_dir = tmp_path / "run"
    (run_dir / "adapter").mkdir(parents=True)
    for name in ("metrics.jsonl", "eval.json", "config.json", "checkpoint.pt",
                 "adapter/adapter_model.safetensors"):
        (run_dir / name).write_text("[]" if name == "eval.json" else f"the older {name}")
    before = snapshot(run_dir)

    def disk_full_after_half(path):
        with open(path, "w") as f:
            f.write("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    model = LoRAOnly()
    monkeypatch.setattr(support.Path, "write_text", lambda path, text: disk_full_after_half(path))
    monkeypatch.setattr(torch, "save", lambda state, path: disk_full_after_half(path))
    optimizer, rng = torch.optim.AdamW(model.parameters()), np.random.default_rng(0)
    for name, save in [
            ("metrics.jsonl", lambda: support.save_text(run_dir / "metrics.jsonl", "{}\n")),
            ("eval.json", lambda: support.record_eval(run_dir, 1, {"episodes": 1})),
            ("config.json", lambda: support.save_json(run_dir / "config.json", {"env": "snake"})),
            ("checkpoint.pt", lambda: support.save_checkpoint(run_dir, model, optimizer, rng, 1)),
            ("adapter", lambda: support.save_adapter(run_dir, model))]:
        with pytest.raises(SystemExit) as stopped:
            save()
        message = str(stopped.value.code)
        assert str(run_dir / name) in message and "No space left" in message and "\n" not in message
        assert snapshot(run_dir) == before and not list(run_dir.glob("*.tmp"))
