"""trl_bridge on TRL's GRPOTrainer: one training step on the CPU with the tiny model, Frozen Lake.

The random tiny model never names a move, so every return would be equal, every advantage 0 and
no weight would move; as in test_same_metrics.py its logits are nudged toward the move words, so
returns differ within a group and the step trains. One run serves every test here.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

trl = pytest.importorskip("trl")

import envs  # noqa: E402
import msgrpo  # noqa: E402
import trl_bridge  # noqa: E402
from test_same_metrics import tiny_model_that_names_moves  # noqa: E402

G, SEEDS, GAME_STEPS = 4, 2, 2  # a group of 4 episodes from each of 2 start seeds, 2 moves each


def recording(function, calls):
    def record(*args, **kwargs):
        result = function(*args, **kwargs)
        calls.append((args, kwargs, result))
        return result
    record.__name__ = function.__name__  # TRL names the reward after its function
    return record


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trl")
    cfg = msgrpo.resolve_defaults(msgrpo.Config(
        model="tiny", group_size=G, env_options={"max_steps": GAME_STEPS}, eval_episodes=0,
        run_dir=str(folder / "run")))
    args = trl.GRPOConfig(
        output_dir=str(folder / "out"), num_generations=G, per_device_train_batch_size=G * SEEDS,
        max_steps=1, learning_rate=1e-2, scale_rewards="none", loss_type="grpo", seed=0,
        max_completion_length=cfg.max_new_tokens, report_to="none", use_cpu=True, bf16=False,
        gradient_checkpointing=False, save_strategy="no", logging_steps=1, disable_tqdm=True)
    with tiny_model_that_names_moves():
        trainer = trl_bridge.make_trainer(cfg, args, trl_bridge.seed_dataset(SEEDS, seed=0))
    rollouts, rewards, losses = [], [], []
    trainer.rollout_func = recording(trainer.rollout_func, rollouts)
    trainer.reward_funcs[0] = recording(trainer.reward_funcs[0], rewards)
    trainer.compute_loss = recording(trainer.compute_loss, losses)
    lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    (prompts, _), _, out = rollouts[0]
    return SimpleNamespace(cfg=cfg, trainer=trainer, tokenizer=trainer.processing_class,
                           prompts=prompts, out=out, rewards=rewards[0][2],
                           loss_inputs=losses[0][0][1], lora_before=lora)


def replies_of(run, row):
    """The reply token runs of a completion: the stretches env_mask marks as the model's."""
    ids, mask = run.out["completion_ids"][row], run.out["env_mask"][row]
    runs, current = [], []
    for token, sampled in zip(ids, mask):
        if sampled:
            current.append(token)
        elif current:
            runs, current = runs + [current], []
    return runs + ([current] if current else [])


class ScriptedAgent:
    """Plays recorded reply texts, one per step, through envs.evaluate's harness."""

    def __init__(self, texts):
        self.texts = list(texts)

    def act(self, observation, info):
        return self.texts.pop(0)


def test_each_start_seed_gets_a_group_of_G_episodes_from_its_start_state(run):
    seeds = [trl_bridge.seed_of(p) for p in run.prompts]
    assert len(set(seeds)) == SEEDS
    assert seeds == [s for s in dict.fromkeys(seeds) for _ in range(G)]  # G rows, side by side
    assert len(run.out["completion_ids"]) == len(run.out["prompt_ids"]) == SEEDS * G
    for seed, prompt_ids in zip(seeds, run.out["prompt_ids"]):
        first, _ = envs.make("frozen_lake", **msgrpo.training_env_options(run.cfg)).reset(seed=seed)
        assert prompt_ids == msgrpo.lap_prompt_ids(run.tokenizer, first, run.cfg)


def test_rewards_are_the_episodes_returns_as_envs_evaluate_counts_them(run):
    assert run.rewards == run.out["episode_return"]
    for row, prompt in enumerate(run.prompts):
        texts = [msgrpo.response_text(run.tokenizer, r, run.cfg) for r in replies_of(run, row)]
        played = envs.evaluate(ScriptedAgent(texts), "frozen_lake", [trl_bridge.seed_of(prompt)],
                               **msgrpo.training_env_options(run.cfg))
        assert played["mean_steps"] == len(texts)  # the episode ended where its replies end
        assert run.rewards[row] == played["mean_return"]
    invalid = sum(run.out["invalid"]) / sum(run.out["steps"])
    assert 0 < invalid < 1  # some replies name a move and some do not: returns differ


def test_the_sequence_is_the_chat_template_of_the_conversation(run):
    """Prompt + completion decode to the conversation as the chat template writes it: system and
    first observation, then each reply and the game's next observation as a user turn."""
    end_texts = {run.tokenizer.decode([t]) for t in msgrpo.end_token_ids(
        run.trainer.model, run.tokenizer)}
    for row, prompt in enumerate(run.prompts):
        game = envs.make("frozen_lake", **msgrpo.training_env_options(run.cfg))
        observation, _ = game.reset(seed=trl_bridge.seed_of(prompt))
        messages = msgrpo.lap_messages(observation, run.cfg)
        for reply in replies_of(run, row):
            text = run.tokenizer.decode(reply)
            for end in end_texts:  # a reply's own end of turn is the template's
                text = text.removesuffix(end)
            reply_text = msgrpo.response_prefix(run.cfg) + text
            messages.append({"role": "assistant", "content": reply_text})
            observation, *_ = game.step(game.parse_action(msgrpo.response_text(
                run.tokenizer, reply, run.cfg)))
            messages.append(msgrpo.lap_messages(observation, run.cfg)[-1])
        conversation = run.tokenizer.apply_chat_template(messages, tokenize=False)
        sequence = run.tokenizer.decode(run.out["prompt_ids"][row] + run.out["completion_ids"][row])
        assert conversation.startswith(sequence)
        assert sequence.count("<|im_start|>user") == len(replies_of(run, row))


def loss_rows(run):
    """The row of the rollout that each row of the loss's batch holds (TRL shuffles them)."""
    inputs = run.loss_inputs
    lengths = inputs["completion_mask"].sum(1).tolist()
    completions = [ids[:n] for ids, n in zip(inputs["completion_ids"].tolist(), lengths)]
    return [run.out["completion_ids"].index(ids) for ids in completions]


def test_game_text_carries_no_loss(run):
    """TRL's loss mask is env_mask: 1 on the replies' tokens, 0 on the game's text and on pad."""
    inputs = run.loss_inputs
    loss_mask = (inputs["completion_mask"] * inputs["tool_mask"]).tolist()
    assert sorted(loss_rows(run)) == list(range(SEEDS * G))
    for mask, row in zip(loss_mask, loss_rows(run)):
        env_mask = run.out["env_mask"][row]
        assert mask == env_mask + [0] * (len(mask) - len(env_mask))
    assert any(0 in env_mask for env_mask in run.out["env_mask"])  # some games went on
    for row, env_mask in enumerate(run.out["env_mask"]):
        game_text = [t for t, m in zip(run.out["completion_ids"][row], env_mask) if not m]
        turns = len(replies_of(run, row)) - 1  # the game's turns between replies
        assert run.tokenizer.decode(game_text).count("Next to you:") == turns
        sampled = [lp for lp, m in zip(run.out["logprobs"][row], env_mask) if m]
        assert all(lp < 0 for lp in sampled)  # real log-probs; game text gets none
        assert len(run.out["logprobs"][row]) == len(env_mask) == len(run.out["completion_ids"][row])


def test_each_episode_gets_its_return_minus_its_group_mean(run):
    returns = np.array(run.rewards).reshape(SEEDS, G)
    expected = (returns - returns.mean(axis=1, keepdims=True)).ravel()
    np.testing.assert_allclose(run.loss_inputs["advantages"].tolist(), expected[loss_rows(run)],
                               atol=1e-6)
    assert np.abs(expected).max() > 0


def test_the_lora_weights_change_and_stay_fp32(run):
    after = {n: p.detach() for n, p in run.trainer.model.named_parameters() if p.requires_grad}
    assert after and all("lora_" in n for n in after)
    assert all(p.dtype == torch.float32 for p in after.values())
    changed = [n for n in after if not torch.equal(after[n], run.lora_before[n])]
    assert any("lora_B" in n for n in changed)


# ---- The command line: every flag and the output folder checked before any model loads ----------
class ReachedTheTrainer(Exception):
    pass


@pytest.fixture
def no_model(monkeypatch):
    """main() up to the trainer: loading the model or making the trainer stops it."""
    def refuse(*args, **kwargs):
        raise ReachedTheTrainer

    monkeypatch.setattr(msgrpo, "load_policy", refuse)
    monkeypatch.setattr(trl_bridge, "make_trainer", refuse)


def bridge_argv(output_dir, *flags):
    return ["--model", "tiny", "--output_dir", str(output_dir), "--num_generations", "2",
            "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", *flags]


def stopped_in_one_line(argv) -> str:
    with pytest.raises(SystemExit) as stop:
        trl_bridge.main(argv)
    message = str(stop.value.code)
    assert message.startswith("error: ") and "\n" not in message
    return message


@pytest.mark.parametrize("flags, named", [
    (["--env", "bogus"], "--env bogus"), (["--env_opt", "size=abc"], "size"),
    (["--env_opt", "size"], "KEY=VALUE"), (["--env_opt", "size=3000"], "size"),
    (["--env", "snake", "--env_opt", "apples=3000000000"], "apples"),
    (["--lora_r", "0"], "--lora_r"), (["--num_generations", "1"], "--num_generations"),
    (["--num_generations", "0"], "--num_generations"), (["--reply_tokens", "-1"], "--reply_tokens"),
    (["--seed", "-1"], "--seed"), (["--seed", str(2**32)], "--seed"),
    (["--start_seeds", "0"], "--start_seeds"), (["--eval_episodes", "-1"], "--eval_episodes"),
    (["--training_start", "corner"], "--training_start"), (["--model", "bogus"], "--model"),
    (["--model", "/nowhere/model"], "--model")])
def test_a_bad_flag_stops_in_one_line_before_any_model_loads(tmp_path, no_model, flags, named):
    message = stopped_in_one_line(bridge_argv(tmp_path / "out", *flags))
    assert named in message
    assert not (tmp_path / "out").exists()


FOREIGN_FOLDERS = {
    "msgrpo run": {"config.json": '{"env": "frozen_lake", "lora_r": 8}', "metrics.jsonl": "{}\n",
                   "checkpoint.pt": "weights", "eval.json": '[{"iteration": 0}]'},
    "msgrpo eval only": {"eval.json": '[{"iteration": 0, "success_rate": 0.5}]'},
    "model": {"config.json": '{"model_type": "llama"}', "model.safetensors": "weights"},
    "other files": {"notes.txt": "mine"},
}


def folder_with(folder, files):
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return {name: (folder / name).read_text() for name in files}


@pytest.mark.parametrize("kind", FOREIGN_FOLDERS)
def test_an_output_dir_that_holds_something_else_is_never_written(tmp_path, no_model, kind):
    folder = tmp_path / "theirs"
    before = folder_with(folder, FOREIGN_FOLDERS[kind])
    message = stopped_in_one_line(bridge_argv(folder))
    assert "--output_dir" in message and str(folder) in message
    assert {name: (folder / name).read_text() for name in before} == before
    assert sorted(path.name for path in folder.iterdir()) == sorted(before)


TRL_OUTPUT = {"adapter_config.json": "{}", "adapter_model.safetensors": "weights",
              "training_args.bin": "args", "checkpoint-25/trainer_state.json": "{}",
              "eval.json": '{"with_history": {}, "current_state_only": {}}'}


@pytest.mark.parametrize("files", [None, {}, TRL_OUTPUT], ids=["new", "empty", "trl output"])
def test_a_new_or_empty_folder_or_an_earlier_trl_output_is_trained_into(tmp_path, no_model,
                                                                       files):
    folder = tmp_path / "out"
    if files is not None:
        folder_with(folder, files)
    with pytest.raises(ReachedTheTrainer):
        trl_bridge.main(bridge_argv(folder))
