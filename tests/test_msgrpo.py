"""MS-GRPO's math against hand-computed values, and the trainer on the tiny model."""

import contextlib
import json
import math
import os
from unittest import mock

import numpy as np
import pytest
import torch

import envs
import msgrpo
import support

# --- returns and group advantages --------------------------------------------------------------


def test_episode_returns_are_undiscounted_sums():
    returns = msgrpo.episode_returns([[0, 0, 1], [-0.1, 0.0], [], [0.5, -0.1, -0.1, 1.0]])
    np.testing.assert_allclose(returns, [1.0, -0.1, 0.0, 1.3])


def test_group_advantages_normalise_within_each_group():
    returns = [1.0, 0.0, 0.0, 0.0, 3.0, 1.0]
    groups = [0, 0, 0, 0, 1, 1]
    # group 0: mean 0.25, population std sqrt(3/16); group 1: mean 2, std 1
    std0 = math.sqrt(3 / 16)
    expected = [0.75 / std0, -0.25 / std0, -0.25 / std0, -0.25 / std0, 1.0, -1.0]
    np.testing.assert_allclose(msgrpo.group_advantages(returns, groups, eps=0.0), expected)
    np.testing.assert_allclose(msgrpo.group_advantages(returns, groups, eps=1e-6),
                               [e * s / (s + 1e-6) for e, s in zip(expected, [std0] * 4 + [1, 1])])


def test_group_advantages_without_std_scaling_are_centred_returns():
    advantages = msgrpo.group_advantages([1.0, 0.0, 3.0, 1.0], [0, 0, 1, 1], scale=False)
    np.testing.assert_allclose(advantages, [0.5, -0.5, 1.0, -1.0])


def test_zero_variance_group_gets_exactly_zero_and_is_counted():
    # 0.1 three times has a floating-point mean that is not exactly 0.1: still exactly zero
    # advantage
    returns = [0.1, 0.1, 0.1, 1.0, 0.0, 0.0]
    groups = [7, 7, 7, 3, 3, 3]
    advantages = msgrpo.group_advantages(returns, groups)
    assert np.all(advantages[:3] == 0.0)
    assert np.all(advantages[3:] != 0.0)
    assert msgrpo.zero_variance_groups(returns, groups) == 1


def test_groups_are_not_mixed_by_order():
    """Group ids, not positions, define the groups (interleaved ids give the same result)."""
    a = msgrpo.group_advantages([1, 0, 5, 3], [0, 1, 0, 1])
    np.testing.assert_allclose(a, [-1, -1, 1, 1], atol=1e-5)


# --- AAW sampling ------------------------------------------------------------------------------


def test_aaw_never_draws_zero_advantage_episodes_and_caps_k():
    advantages = np.array([0.0, 2.0, 0.0, -1.0, 0.0])
    rng = np.random.default_rng(0)
    for _ in range(200):
        chosen = msgrpo.aaw_sample(advantages, 2, rng)
        assert sorted(chosen) == [1, 3]
    chosen = msgrpo.aaw_sample(advantages, 10, rng)  # k larger than the nonzero episodes
    assert sorted(chosen) == [1, 3]
    assert len(msgrpo.aaw_sample(np.zeros(4), 3, rng)) == 0


def test_aaw_draw_probability_is_proportional_to_absolute_advantage():
    advantages = np.array([0.5, -1.5, 2.0, 0.0])
    rng = np.random.default_rng(1)
    draws = np.array([msgrpo.aaw_sample(advantages, 1, rng)[0] for _ in range(20000)])
    frequencies = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(frequencies, [0.125, 0.375, 0.5, 0.0], atol=0.015)


def test_aaw_draws_without_replacement():
    rng = np.random.default_rng(2)
    for _ in range(100):
        chosen = msgrpo.aaw_sample(np.linspace(-1, 1, 11), 6, rng)  # index 5 has A = 0
        assert len(set(chosen)) == 6 and 5 not in chosen


def test_choose_episodes_sizes_per_sampling_mode():
    advantages = np.array([1.0, -1.0, 0.0, 0.0, 0.5, -0.5, 0.0, 0.0])
    rng = np.random.default_rng(0)
    cfg = msgrpo.Config(sample_frac=0.5)
    assert len(msgrpo.choose_episodes(advantages, cfg, rng)) == 4
    assert set(msgrpo.choose_episodes(advantages, cfg, rng)) == {0, 1, 4, 5}
    uniform = msgrpo.choose_episodes(advantages,
                                     msgrpo.Config(sampling="uniform", sample_frac=0.3), rng)
    assert len(uniform) == math.ceil(0.3 * 8) and len(set(uniform)) == len(uniform)
    assert (list(msgrpo.choose_episodes(advantages, msgrpo.Config(sampling="all"), rng))
            == list(range(8)))


# --- clipped policy loss -----------------------------------------------------------------------


def test_clipped_loss_on_both_sides_of_one():
    ratios = torch.tensor([[1.5, 0.5, 0.5, 1.5, 1.1]])
    advantages = torch.tensor([[1.0, -1.0, 1.0, -1.0, 2.0]])
    logp_old = torch.zeros(1, 5)
    logp_new = ratios.log().requires_grad_()
    loss = msgrpo.clipped_policy_loss(logp_new, logp_old, advantages, torch.ones(1, 5),
                                      eps_clip=0.2)
    # min(rho A, clip(rho) A): 1.2 (clipped above), -0.8 (clipped below), 0.5, -1.5, 2.2 (inside)
    assert loss.item() == pytest.approx(-(1.2 - 0.8 + 0.5 - 1.5 + 2.2) / 5)
    loss.backward()
    # clipped tokens give no gradient; the others give -A * rho / n
    np.testing.assert_allclose(logp_new.grad[0].numpy(), [0, 0, -0.5 / 5, 1.5 / 5, -2.2 / 5],
                               atol=1e-6)


def test_clipped_loss_ignores_masked_tokens_and_broadcasts_step_advantages():
    logp_new = torch.tensor([[-1.0, -2.0, 50.0], [-0.5, 80.0, 90.0]])  # masked entries are junk
    logp_old = logp_new.clone()
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss = msgrpo.clipped_policy_loss(logp_new, logp_old, torch.tensor([2.0, -1.0]), mask)
    assert loss.item() == pytest.approx(-(2 + 2 - 1) / 3)  # ratio 1 on the three real tokens


def test_kl_to_reference_is_zero_at_the_reference_and_positive_elsewhere():
    logp = torch.tensor([[-1.0, -2.0]])
    mask = torch.ones(1, 2)
    assert msgrpo.kl_to_reference(logp, logp, mask).item() == 0.0
    d = 0.3
    expected = math.exp(d) - d - 1
    assert msgrpo.kl_to_reference(logp, logp + d, mask).item() == pytest.approx(expected)


# --- broadcast to tokens, masks from lengths ---------------------------------------------------


def test_broadcast_puts_each_steps_advantage_on_its_response_tokens_only():
    pad = 2  # SmolLM2's pad id is also its end-of-turn id: a real token inside responses
    steps = [
        ([5, 6, 7, 8, 9], [11, 12, 2], 0.7),  # response ends with the end token (== pad id)
        ([5, 6], [13], -1.5),
        ([0, 0, 5], [0, 14], 0.0),  # id 0 is a real token too: masks come from lengths, not ids
    ]
    batch = msgrpo.collate_steps(steps, pad)
    token_advantages = batch.token_advantages()
    for row, (prompt, response, advantage) in enumerate(steps):
        real = len(prompt) + len(response)
        width = batch.input_ids.shape[1]
        assert batch.input_ids[row, width - real:].tolist() == prompt + response
        assert batch.attention_mask[row].tolist() == [0] * (width - real) + [1] * real
        assert batch.input_ids[row][batch.response_mask[row].bool()].tolist() == response
        expected = [0.0] * (width - len(response)) + [advantage] * len(response)
        np.testing.assert_allclose(token_advantages[row].numpy(), expected)


def test_broadcast_from_episodes_to_steps():
    """Every step of every drawn episode carries that episode's advantage (train_iteration's
    rule)."""
    episodes = [msgrpo.Episode(group=0, seed=1, prompts=[[1], [2], [3]],
                               responses=[[4], [5, 6], [7]], rewards=[0, 0, 1]),
                msgrpo.Episode(group=0, seed=1, prompts=[[1]], responses=[[9]], rewards=[0])]
    returns = msgrpo.episode_returns([ep.rewards for ep in episodes])
    advantages = msgrpo.group_advantages(returns, [0, 0])
    steps = msgrpo.episode_steps(episodes, advantages, np.array([0, 1]))
    assert [a for _, _, a in steps] == pytest.approx([1, 1, 1, -1], abs=1e-5)
    assert [r for _, r, _ in steps] == [[4], [5, 6], [7], [9]]


def test_episode_mean_gives_every_episode_the_same_weight_whatever_its_length():
    """A 3-step survivor (A = +1) and a 1-step fall (A = -1): mean length 2, so the survivor's steps
    get 2/3 each and the fall's step 2. Per episode the weights sum to A_i * 2: the two cancel,
    where a plain token mean would have weighed the survivor 3 to 1."""
    episodes = [msgrpo.Episode(group=0, seed=1, prompts=[[1], [2], [3]], responses=[[4], [5], [6]]),
                msgrpo.Episode(group=0, seed=1, prompts=[[1]], responses=[[7]]),
                msgrpo.Episode(group=0, seed=1, prompts=[[1]] * 5,
                               responses=[[8]] * 5)]  # not drawn
    chosen = np.array([0, 1])
    weights = msgrpo.episode_length_weights(episodes, chosen)
    np.testing.assert_allclose(weights[chosen], [2 / 3, 2.0])
    steps = msgrpo.episode_steps(episodes, np.array([1.0, -1.0, 0.5]) * weights, chosen)
    assert [a for _, _, a in steps] == pytest.approx([2 / 3, 2 / 3, 2 / 3, -2.0])
    assert sum(a for _, _, a in steps) == pytest.approx(0.0)
    assert msgrpo.episode_length_weights(episodes,
                                         np.array([], dtype=int)).tolist() == [1.0, 1.0, 1.0]


# --- the model pieces, on the tiny model --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    cfg = msgrpo.resolve_defaults(msgrpo.Config(model="tiny", run_dir="unused"))
    torch.manual_seed(0)
    model, tokenizer = msgrpo.load_policy(cfg)
    return cfg, model, tokenizer


def test_lora_weights_are_fp32_and_only_they_train(tiny):
    _, model, _ = tiny
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, _ in trainable)
    assert all(p.dtype == torch.float32 for _, p in trainable)


def test_prompt_ends_with_the_prefill_and_holds_the_observation(tiny):
    cfg, _, tokenizer = tiny
    text = tokenizer.decode(msgrpo.lap_prompt_ids(tokenizer, "You are at (row 0, col 1).", cfg))
    assert "You are at (row 0, col 1)." in text and text.endswith("<action>")
    think_cfg = msgrpo.resolve_defaults(msgrpo.Config(model="tiny", think=True, run_dir="x"))
    assert not tokenizer.decode(
        msgrpo.lap_prompt_ids(tokenizer, "obs", think_cfg)).endswith("<action>")


def test_thinking_gets_longer_replies_and_smaller_micro_batches():
    plain, think = (msgrpo.resolve_defaults(msgrpo.Config(model="tiny", think=t, run_dir="x"))
                    for t in (False, True))
    assert (plain.max_new_tokens, plain.micro_batch) == (6, 16)
    assert (think.max_new_tokens, think.micro_batch) == (256, 4)
    chosen = msgrpo.resolve_defaults(msgrpo.Config(model="tiny", think=True, micro_batch=2,
                                                   max_new_tokens=64, run_dir="x"))
    assert (chosen.max_new_tokens, chosen.micro_batch) == (64, 2)


def test_snake_replies_are_one_token_in_one_phase_unless_asked_otherwise():
    snake = msgrpo.resolve_defaults(msgrpo.Config(env="snake", model="tiny", run_dir="x"))
    lake = msgrpo.resolve_defaults(msgrpo.Config(model="tiny", run_dir="x"))
    assert (snake.max_new_tokens, snake.late_after, lake.late_after) == (1, 0, 25)
    assert (snake.beta, lake.beta) == (0.1, 0.0)  # a KL penalty keeps Snake's one token open
    assert (snake.minibatch, lake.minibatch) == (16, 0)  # several AdamW steps an iteration on Snake
    asked = msgrpo.resolve_defaults(msgrpo.Config(env="snake", max_new_tokens=6, late_after=10,
                                                  beta=0.0, minibatch=0, run_dir="x"))
    assert (asked.max_new_tokens, asked.late_after, asked.beta, asked.minibatch) == (6, 10, 0.0, 0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_training_logprobs_equal_sampling_logprobs(tiny, temperature):
    """Left-padded prompts of different lengths: the loss's log-probs of the sampled ids equal
    the sampler's (same ids, same temperature, same positions, the same kept weights), so the
    first ratio is 1."""
    cfg, model, tokenizer = tiny
    prompts = [msgrpo.lap_prompt_ids(tokenizer, text, cfg)
               for text in ["short", "a much longer observation " * 5]]
    torch.manual_seed(3)
    responses, sampled = msgrpo.sample_responses(model, tokenizer, prompts, 6, temperature)
    batch = msgrpo.collate_steps([(p, r, 1.0) for p, r in zip(prompts, responses)],
                                 tokenizer.pad_token_id)
    with torch.no_grad():
        logp, mask = msgrpo.response_logprobs(model, batch, temperature)
    for row, values in enumerate(sampled):
        got = logp[row][mask[row].bool()].tolist()
        np.testing.assert_allclose(got, values, atol=1e-4)


def _lap_steps(tokenizer, cfg, responses):
    """Frozen Lake steps from three maps and cells: the prompts share the system prompt and
    rules."""
    steps = []
    for seed, response in zip(range(len(responses)), responses):
        game = envs.make("frozen_lake")
        game.reset(seed=seed)
        game.step(seed % 4)  # different cells, different prompt lengths
        prompt = msgrpo.lap_prompt_ids(tokenizer, game.observation(), cfg)
        steps.append((prompt, tokenizer(response, add_special_tokens=False).input_ids, 1.0 - seed))
    return steps


def _tiny_policy_with_a_trained_adapter():
    """A fresh tiny policy whose LoRA B weights are random: B = 0 at init would make most
    gradients 0."""
    cfg = msgrpo.resolve_defaults(msgrpo.Config(model="tiny", run_dir="unused"))
    torch.manual_seed(0)
    model, tokenizer = msgrpo.load_policy(cfg)
    for module in model.modules():
        if hasattr(module, "lora_B"):
            for weight in module.lora_B.values():
                torch.nn.init.normal_(weight.weight, std=0.1)
    return cfg, model, tokenizer


def _logprobs_and_lora_grads(model, batch):
    """Forward + backward of the clipped loss at ratio 1 on a fresh gradient: (log-probs, mask,
    {LoRA weight name: gradient})."""
    model.zero_grad()
    logp, mask = msgrpo.response_logprobs(model, batch, 1.0)
    msgrpo.clipped_policy_loss(logp, logp.detach(), batch.advantages, mask).backward()
    return logp.detach(), mask, {n: p.grad.clone() for n, p in model.named_parameters()
                                 if p.requires_grad}


def test_exploring_starts_move_training_games_only_and_a_group_shares_its_start(tiny):
    cfg, model, tokenizer = tiny
    cfg = msgrpo.dataclasses.replace(cfg, group_size=2, env_options={"max_steps": 1})
    assert msgrpo.training_env_options(cfg)["start"] == envs.FrozenLake.training_start
    assert "start" not in msgrpo.env_options(cfg)  # evaluation and the probe start at S
    snake = msgrpo.resolve_defaults(msgrpo.Config(env="snake", model="tiny", run_dir="unused"))
    assert msgrpo.training_env_options(snake)["start"] == "facing_wall"
    assert "start" not in msgrpo.env_options(snake)  # evaluation starts where it always did
    torch.manual_seed(0)
    seeds = list(range(8))
    episodes = msgrpo.play_groups(model, tokenizer, cfg, seeds)
    first_prompts = [tokenizer.decode(ep.prompts[0]) for ep in episodes]
    assert all(first_prompts[2 * g] == first_prompts[2 * g + 1]
               for g in range(len(seeds)))  # one start per group
    at_start = [envs.make("frozen_lake", max_steps=1).reset(seed=s)[0] in first_prompts[2 * g]
                for g, s in enumerate(seeds)]
    assert not all(at_start)  # some groups begin away from S


def test_sampled_tokens_follow_softmax_of_the_logits_over_t():
    """Inverse transform sampling: each token as often as softmax(logits / T) says, and its
    log-prob returned; T = 0 takes the most likely token."""
    logits = torch.tensor([2.0, 0.5, -1.0, 1.0, 0.0])
    for temperature in (1.0, 0.5, 2.0):
        torch.manual_seed(0)
        tokens, logprobs = msgrpo.sample_token(logits.expand(40000, 5), temperature)
        expected = (logits / temperature).softmax(-1)
        frequencies = torch.bincount(tokens[:, 0], minlength=5) / 40000
        torch.testing.assert_close(frequencies, expected, atol=0.01, rtol=0)
        torch.testing.assert_close(logprobs[:, 0], expected.log()[tokens[:, 0]])
    tokens, _ = msgrpo.sample_token(torch.stack([logits, -logits]), 0.0)
    assert tokens[:, 0].tolist() == [0, 2]
    with pytest.raises(FloatingPointError, match="not finite"):
        msgrpo.sample_token(torch.tensor([[0.0, math.nan]]), 1.0)


@pytest.mark.parametrize("speedups", [None, {}])
def test_greedy_replies_are_the_ones_transformers_generate_writes(tiny, speedups):
    """The sampling loop (the KV cache, one token per forward), plain and with the CPU speed-ups,
    against model.generate on the same left-padded prompts: the same greedy tokens."""
    cfg, model, tokenizer = tiny
    prompts = [step[0] for step in _lap_steps(tokenizer, cfg, ["", "", ""])] + [[5, 6, 7]]
    ours, _ = msgrpo.sample_responses(model, tokenizer, prompts, 5, 0.0, speedups)
    ids, mask = support.left_pad(prompts, tokenizer.pad_token_id)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)[:, ids.shape[1]:]
    for reply, theirs in zip(ours, out.tolist()):
        assert reply == theirs[:len(reply)]


@pytest.mark.parametrize("speedups", [None, {}])
def test_each_reply_stops_where_ends_reply_says_and_the_loop_when_all_have(tiny, monkeypatch,
                                                                            speedups):
    cfg, model, tokenizer = tiny
    prompts = [msgrpo.lap_prompt_ids(tokenizer, f"You are at (row {r}, col 0).", cfg)
               for r in range(4)]
    monkeypatch.setattr(msgrpo, "ends_reply", lambda ids, end_ids, tokenizer: ids[-1] % 3 == 0)
    torch.manual_seed(1)
    replies, logprobs = msgrpo.sample_responses(model, tokenizer, prompts, 8, 1.0, speedups)
    assert [len(r) for r in replies] == [len(lp) for lp in logprobs]
    for reply in replies:  # each stops at its first token divisible by 3, or after 8 tokens
        ended = [j + 1 for j, token in enumerate(reply) if token % 3 == 0]
        assert len(reply) == (ended[0] if ended else 8)
    monkeypatch.setattr(msgrpo, "ends_reply", lambda ids, end_ids, tokenizer: True)
    replies, _ = msgrpo.sample_responses(model, tokenizer, prompts, 8, 1.0, speedups)
    assert [len(r) for r in replies] == [1, 1, 1, 1]


def test_a_reply_ends_at_an_end_token_or_the_token_that_completes_action_end(tiny):
    _, model, tokenizer = tiny
    end = tokenizer.eos_token_id
    # SmolLM2: pad == end token, so a mask built from the pad id would drop real end tokens
    assert end == tokenizer.pad_token_id
    ends = msgrpo.end_token_ids(model, tokenizer)
    word = tokenizer("right", add_special_tokens=False).input_ids
    close = tokenizer("</action>", add_special_tokens=False).input_ids
    reply = word * 12 + close + word  # more tokens before </action> than it has characters
    ended = [n for n in range(1, len(reply) + 1) if msgrpo.ends_reply(reply[:n], ends, tokenizer)]
    assert ended[0] == 12 * len(word) + len(close)
    assert msgrpo.ends_reply(word + [end], ends, tokenizer)
    assert not any(msgrpo.ends_reply(reply[:n], ends, tokenizer) for n in range(1, ended[0]))


def _steps_logprob(model, tokenizer, steps):
    with torch.no_grad():
        logp, mask = msgrpo.response_logprobs(
            model, msgrpo.collate_steps(steps, tokenizer.pad_token_id), 1.0)
    return (logp * mask).sum(1)


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_one_update_moves_the_episode_logprob_in_the_advantages_direction(advantage):
    cfg = msgrpo.resolve_defaults(msgrpo.Config(model="tiny", lr=1e-2, run_dir="unused"))
    torch.manual_seed(0)
    model, tokenizer = msgrpo.load_policy(cfg)
    prompt = msgrpo.lap_prompt_ids(tokenizer, "You are at (row 0, col 0).", cfg)
    response = tokenizer("right</action>", add_special_tokens=False).input_ids
    steps = [(prompt, response, advantage)]
    before = _steps_logprob(model, tokenizer, steps)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    stats = msgrpo.update_policy(model, optimizer, tokenizer, steps, cfg, np.random.default_rng(0))
    after = _steps_logprob(model, tokenizer, steps)
    assert stats["clip_frac"] == 0.0  # one optimizer step: the ratio is exactly 1
    assert (after - before).item() * advantage > 0.05


def test_several_epochs_use_a_scoring_pass_and_clip(tiny):
    cfg, model, tokenizer = tiny
    cfg = msgrpo.dataclasses.replace(cfg, epochs=4, lr=5e-2, micro_batch=1)
    prompt = msgrpo.lap_prompt_ids(tokenizer, "obs", cfg)
    steps = [(prompt, tokenizer("up", add_special_tokens=False).input_ids, 1.0),
             (prompt[3:], tokenizer("down</action>", add_special_tokens=False).input_ids, -1.0)]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    stats = msgrpo.update_policy(model, optimizer, tokenizer, steps, cfg, np.random.default_rng(0))
    assert stats["clip_frac"] > 0  # later epochs move the ratio past 1 +- eps
    assert math.isfinite(stats["loss"])


# --- the trainer end to end ----------------------------------------------------------------------

TINY_RUN = ["--env", "frozen_lake", "--model", "tiny", "--groups", "2", "--group-size", "4",
            "--env-opt", "max_steps=4", "--eval-episodes", "4", "--eval-every", "1"]
TIMING = {"seconds", "rollout_seconds", "update_seconds", "train_tokens_per_second"}


def _without_timing(rows):
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


def test_two_iterations_leave_a_complete_run_folder(tmp_path):
    run = msgrpo.main(TINY_RUN + ["--iterations", "2", "--run-dir", str(tmp_path / "run")])
    for name in ["config.json", "metrics.jsonl", "eval.json", "checkpoint.pt", "curves.png",
                 "adapter/adapter_config.json", "adapter/adapter_model.safetensors"]:
        assert (run / name).exists(), name
    metrics = support.read_metrics(run)
    assert [m["iteration"] for m in metrics] == [1, 2]
    assert all(0 <= m["invalid_rate"] <= 1 and 0 <= m["distinct_responses"] <= 1 for m in metrics)
    evals = json.loads((run / "eval.json").read_text())
    assert [e["iteration"] for e in evals] == [0, 1, 2] and evals[0]["episodes"] == 4
    assert evals[-1]["sampled"]["episodes"] == 4  # the final evaluation is greedy and sampled
    config = json.loads((run / "config.json").read_text())
    assert config["model"] == "tiny" and config["env_options"] == {"max_steps": 4}

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(support.tiny_model_folder())
    assert isinstance(PeftModel.from_pretrained(base, str(run / "adapter")), PeftModel)


def test_resume_gives_the_same_metrics_as_an_uninterrupted_run(tmp_path):
    straight = msgrpo.main(TINY_RUN + ["--iterations", "3", "--run-dir", str(tmp_path / "a")])
    stopped = msgrpo.main(TINY_RUN + ["--iterations", "2", "--run-dir", str(tmp_path / "b")])
    resumed = msgrpo.main(["--resume", str(stopped), "--iterations", "3"])
    assert resumed == stopped
    assert (_without_timing(support.read_metrics(resumed))
            == _without_timing(support.read_metrics(straight)))


def test_flags_given_with_resume_are_used_and_saved(tmp_path):
    """--resume D --lr X trains on at X (the optimizer's saved state carries the old rate) and
    config.json says so, so the next plain --resume D keeps it."""
    stopped = msgrpo.main(TINY_RUN + ["--iterations", "1", "--lr", "1e-3",
                                      "--run-dir", str(tmp_path / "b")])
    seen = []
    original = msgrpo.train_iteration

    def spy(model, optimizer, *args):
        seen.append(optimizer.param_groups[0]["lr"])
        return original(model, optimizer, *args)

    with mock.patch.object(msgrpo, "train_iteration", spy):
        msgrpo.main(["--resume", str(stopped), "--iterations", "2", "--lr", "5e-5"])
    assert seen == [5e-5]
    saved = support.load_json(stopped / "config.json")
    assert (saved["lr"], saved["iterations"]) == (5e-5, 2)


def test_the_late_phase_lowers_the_rate_and_heats_the_rollouts_after_late_after_iterations(
        tmp_path):
    cfg = msgrpo.Config(late_after=12, lr=2e-4, late_lr=5e-5, temperature=1.0, late_temperature=2.0)
    assert [msgrpo.phase_settings(cfg, i) for i in (1, 12, 13, 100)] == [(2e-4, 1.0), (2e-4, 1.0),
                                                                       (5e-5, 2.0), (5e-5, 2.0)]
    assert msgrpo.phase_settings(msgrpo.dataclasses.replace(cfg, late_after=0), 100) == (2e-4, 1.0)
    seen = []
    original = msgrpo.train_iteration

    def spy(model, optimizer, tokenizer, cfg, *args):
        seen.append((optimizer.param_groups[0]["lr"], cfg.temperature))
        return original(model, optimizer, tokenizer, cfg, *args)

    run = tmp_path / "run"
    with mock.patch.object(msgrpo, "train_iteration", spy):
        msgrpo.main(TINY_RUN + ["--iterations", "2", "--lr", "1e-3", "--late-after", "1",
                                "--late-lr", "1e-5", "--temperature", "0.7",
                                "--late-temperature", "1.5", "--run-dir", str(run)])
    assert seen == [(1e-3, 0.7), (1e-5, 1.5)]
    logged = [(m["lr"], m["temperature"]) for m in support.read_metrics(run)]
    assert logged == seen
    assert (support.load_config(run, msgrpo.Config, msgrpo.resolve_defaults).temperature
            == 0.7)  # the phase's temperature is not saved as the run's


def test_bad_cli_input_fails_clearly(capsys):
    with pytest.raises(SystemExit):
        msgrpo.main(["--env", "chess"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="size"):
        msgrpo.main(["--env", "frozen_lake", "--env-opt", "colour=red"])
    with pytest.raises(SystemExit):
        msgrpo.main(["--env-opt", "no-equals-sign"])
    with pytest.raises(SystemExit, match="nothing to resume"):
        msgrpo.main(["--resume", "/nonexistent/run"])


@pytest.mark.slow
def test_bundled_smollm2_runs_one_iteration(tmp_path):
    run = msgrpo.main(["--env", "frozen_lake", "--model", "smollm2-135m", "--iterations", "1",
                       "--eval-episodes", "8", "--run-dir", str(tmp_path / "smol")])
    assert len(support.read_metrics(run)) == 1
    assert envs.heldout_seeds(1)[0] >= envs.HELDOUT_SEED_START


@pytest.mark.slow
def test_committed_adapter_reproduces_its_held_out_success():
    """results/frozen_lake_cpu/adapter, loaded on the bundled model through
    PeftModel.from_pretrained (load_policy's path), plays the first 64 of its 200 held-out maps
    within eval.json's interval."""
    import dataclasses
    from pathlib import Path

    from peft import PeftModel

    run = Path(__file__).resolve().parent.parent / "results" / "frozen_lake_cpu"
    cfg = dataclasses.replace(support.load_config(run, msgrpo.Config, msgrpo.resolve_defaults),
                              eval_episodes=64)
    trained = support.load_json(run / "eval.json")[-1]
    assert trained["iteration"] > 0 and trained["episodes"] >= 200
    model, tokenizer = msgrpo.load_policy(cfg, adapter=run / "adapter")
    assert isinstance(model, PeftModel)
    result = msgrpo.evaluate_policy(model, tokenizer, cfg)
    low, high = trained["success_ci95"]
    assert low <= result["success_rate"] <= high, (result["success_rate"], trained["success_ci95"])


def test_gradients_are_the_same_before_and_after_sampling():
    """bitsandbytes may repack 4-bit weights for CPU inference on the first no-grad eval forward,
    after which its matmul has no backward. Training after a rollout must see the same gradients."""
    cfg = msgrpo.resolve_defaults(msgrpo.Config(model="tiny", run_dir="unused"))
    torch.manual_seed(0)
    model, tokenizer = msgrpo.load_policy(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)  # so the gradient also flows into every lora_A
    prompt = msgrpo.lap_prompt_ids(tokenizer, "You are at (row 0, col 0).", cfg)
    batch = msgrpo.collate_steps(
        [(prompt, tokenizer("right</action>", add_special_tokens=False).input_ids, 1.0)],
        tokenizer.pad_token_id)

    def lora_gradients():
        model.train()
        model.zero_grad()
        logp, mask = msgrpo.response_logprobs(model, batch, 1.0)
        (logp * mask).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    before = lora_gradients()
    # a rollout, in eval mode
    msgrpo.sample_responses(model, tokenizer, [prompt, prompt[2:]], 4, 1.0)
    after = lora_gradients()
    first_layer = [n for n in before if "layers.0." in n and "lora_A" in n]
    assert first_layer and all(before[n].norm() > 0 for n in first_layer)
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=1e-4, atol=1e-7)


def test_kl_to_the_adapter_disabled_reference_grows_as_the_adapter_learns(tiny):
    cfg, model, tokenizer = tiny
    cfg = msgrpo.dataclasses.replace(cfg, beta=0.1, lr=5e-2, epochs=3)
    prompt = msgrpo.lap_prompt_ids(tokenizer, "obs", cfg)
    steps = [(prompt, tokenizer("left</action>", add_special_tokens=False).input_ids, 1.0)]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    stats = msgrpo.update_policy(model, optimizer, tokenizer, steps, cfg, np.random.default_rng(0))
    assert stats["kl"] > 0 and math.isfinite(stats["loss"])


def test_eval_table_gives_every_score_its_interval_and_snake_its_apples():
    frozen_lake = {"iteration": 12, "episodes": 4, "success_rate": 0.25,
                   "success_ci95": [0.046, 0.699],
                   "mean_return": 0.25, "return_ci95": [-0.2, 0.7], "invalid_rate": 0.5}
    text = support.eval_table([frozen_lake])
    assert "apples" not in text
    assert (text.splitlines()[-1]
            == "| 12 | 4 | 0.250 (0.046 to 0.699) | 0.250 (-0.200 to 0.700) | 0.500 |")
    snake = {**frozen_lake, "success_rate": 0.0, "success_ci95": [0.0, 0.49], "mean_apples": 1.5,
             "apples_ci95": [1.0, 2.0]}
    text = support.eval_table([snake])
    assert "| apples (95% CI) |" in text.splitlines()[0]
    assert text.splitlines()[-1].endswith("| 1.500 (1.000 to 2.000) | 0.500 |")


# --- the map-reading probe -----------------------------------------------------------------------

PROBE_KEYS = {f"probe_{move}_{kind}" for move in ("down", "right")
              for kind in ("hole", "ice", "ratio")} | {
    "probe_greedy_success", "probe_left_up_blocked"}


def test_probe_states_are_every_open_cell_of_training_maps_as_the_game_shows_them():
    options = {"max_steps": 7, "invalid_penalty": -0.1}
    seeds = range(900_000, 900_003)
    states = envs.probe_states(len(seeds), seeds[0], **options)
    assert all(seed < envs.HELDOUT_SEED_START for seed in seeds)
    for seed in seeds:
        game = envs.make("frozen_lake", **options)
        start_text, info = game.reset(seed=seed)
        map_rows, start = tuple(info["map"]), info["position"]
        open_cells = [(r, c) for r, row in enumerate(map_rows) for c, tile in enumerate(row)
                      if tile not in "HG"]
        by_cell = {cell: obs for rows, cell, obs in states if rows == map_rows}
        assert sorted(by_cell) == open_cells
        assert by_cell[start] == start_text  # the text reset() itself shows
        # A cell one firm step from the start: the text the game shows after that step, counter
        # aside.
        move = next(a for a in range(4) if envs.walks_onto(map_rows, start, a) == "ice")
        stepped_text = game.step(move)[0]
        assert stepped_text == by_cell[game.position].replace("Steps left: 7.", "Steps left: 6.")
    with pytest.raises(ValueError, match="training seeds"):
        envs.probe_states(2, envs.HELDOUT_SEED_START - 1)


def test_map_reading_probe_averages_each_moves_probability_by_what_it_walks_onto(monkeypatch):
    map_rows = ("SFF", "HFH", "FFG")
    # cell: (P(down), P(right)); what down / right walk onto in the comment
    table = {(0, 0): (0.2, 0.6),  # hole / ice
             (0, 1): (0.8, 0.2),  # ice / ice
             (0, 2): (0.2, 0.5),  # hole / edge
             (1, 1): (0.8, 0.1),  # ice / hole
             (2, 0): (0.9, 0.4),  # edge / ice
             (2, 1): (0.9, 0.9)}  # edge / goal
    states = [(map_rows, cell, f"observation {i}") for i, cell in enumerate(table)]
    probabilities = np.array([[0.0, down, right, 0.0] for down, right in table.values()])
    # (0, 2): down a hole, right the edge, so left + up count
    probabilities[2, [0, 3]] = [0.1, 0.15]
    probabilities[0, [0, 3]] = [0.3, 0.3]  # (0, 0): right is ice, so this state does not

    def fake_move_probabilities(model, tokenizer, prompts, micro_batch, greedy=False,
                                speedups=True):
        assert prompts == [f"prompt of {obs}" for _, _, obs in states] and greedy
        return probabilities, probabilities.argmax(1)

    def prompt_ids(observation):
        return f"prompt of {observation}"

    monkeypatch.setattr(support, "move_probabilities", fake_move_probabilities)
    result = support.map_reading_probe(None, None, msgrpo.Config(), states, prompt_ids)
    assert set(result) == PROBE_KEYS
    assert (result["probe_down_hole"] == pytest.approx(0.2)
            and result["probe_down_ice"] == pytest.approx(0.8))
    assert result["probe_down_ratio"] == pytest.approx(0.25)
    assert (result["probe_right_hole"] == pytest.approx(0.1)
            and result["probe_right_ice"] == pytest.approx(0.4))
    assert result["probe_right_ratio"] == pytest.approx(0.25)
    assert result["probe_left_up_blocked"] == pytest.approx(0.25)
    probabilities = probabilities[[1]]  # down walks onto ice only: no hole to compare with
    states = states[1:2]
    result = support.map_reading_probe(None, None, msgrpo.Config(), states, prompt_ids)
    assert math.isnan(result["probe_down_hole"]) and math.isnan(result["probe_down_ratio"])


def test_greedy_probe_success_walks_each_map_from_s_with_the_greedy_moves():
    left, down, right, up = range(4)
    winner, faller = ("SFF", "HFH", "FFG"), ("SFF", "FHF", "FFG")
    route = {(0, 0): right, (0, 1): down, (1, 1): down, (2, 1): right}  # S -> G on `winner`
    states, moves = [], []
    for map_rows in (winner, faller):
        for cell in msgrpo.envs.cells_with(map_rows, "F") + msgrpo.envs.cells_with(map_rows, "S"):
            states.append((map_rows, cell, "observation"))
            moves.append(route.get(cell, up))
    # `faller` has a hole at (1, 1)
    assert support.probe_greedy_success(states, moves, max_steps=16) == 0.5
    assert support.probe_greedy_success(states, moves, max_steps=3) == 0.0  # 4 moves needed
    stuck = [-1 if (m, cell) == (winner, (1, 1)) else move
             for (m, cell, _), move in zip(states, moves)]
    # an invalid reply stays put
    assert support.probe_greedy_success(states, stuck, max_steps=16) == 0.0
    into_edge = [up if (m, cell) == (winner, (0, 0)) else move
                 for (m, cell, _), move in zip(states, moves)]
    assert support.probe_greedy_success(states, into_edge, max_steps=16) == 0.0


def test_the_probe_applies_to_frozen_lake_with_the_prefilled_action_only():
    assert support.probe_applies(msgrpo.Config())
    for cfg in [msgrpo.Config(env="snake"), msgrpo.Config(think=True), msgrpo.Config(prefill=False),
                msgrpo.Config(probe_every=0)]:
        assert not support.probe_applies(cfg)
    assert [i for i in range(1, 12)
            if support.probe_due(msgrpo.Config(probe_every=5), i)] == [1, 5, 10]


@pytest.fixture(scope="module")
def probe_runs(tmp_path_factory):
    """Two tiny runs from the same seed, one probed every iteration and one never."""
    runs = {}
    for probe_every in (1, 0):
        cfg = msgrpo.resolve_defaults(msgrpo.Config(
            model="tiny", iterations=2, groups=2, group_size=4, env_options={"max_steps": 4},
            eval_episodes=0, probe_every=probe_every,
            run_dir=str(tmp_path_factory.mktemp("probe") / f"every-{probe_every}")))
        runs[probe_every] = support.read_metrics(msgrpo.train(cfg))
    return runs


def test_a_probed_run_logs_the_probe_in_every_metrics_line(probe_runs):
    metrics = probe_runs[1]
    assert [m["iteration"] for m in metrics] == [1, 2]
    for m in metrics:
        assert PROBE_KEYS <= set(m)
        assert all(math.isfinite(m[key]) and m[key] >= 0 for key in PROBE_KEYS)
        assert m["probe_down_ratio"] == pytest.approx(m["probe_down_hole"] / m["probe_down_ice"])
    assert not any(PROBE_KEYS & set(m) for m in probe_runs[0])
    assert "hole/ice P(down)" in support.progress_line(metrics[0])


def test_the_probe_does_not_move_the_training_random_numbers(probe_runs):
    probed, unprobed = ([{k: v for k, v in m.items() if k not in PROBE_KEYS}
                         for m in _without_timing(rows)]
                        for rows in (probe_runs[1], probe_runs[0]))
    assert probed == unprobed


def test_curves_get_a_map_reading_panel_from_probe_keys(tmp_path):
    import matplotlib.image

    line = {"iteration": 1, "success_rate": 0.1, "mean_return": 0.1, "invalid_rate": 0.2,
            "distinct_responses": 0.5, "entropy": 1.0, "zero_variance_groups": 1}
    probe = {"probe_down_hole": 0.5, "probe_down_ice": 0.5, "probe_down_ratio": 1.0,
             "probe_right_hole": 0.1, "probe_right_ice": 0.4, "probe_right_ratio": 0.25,
             "probe_greedy_success": 0.5}
    widths = {}
    phases = [{"lr": 2e-4, "temperature": 1.0}, {"lr": 2e-4, "temperature": 1.0},
              {"lr": 1e-4, "temperature": 1.5}]
    for name, rows in [("probed", [{**line, **probe, **phases[0]},
                                   {**line, "iteration": 2, **phases[1]},
                                   {**line, **probe, "iteration": 3, "probe_down_ratio": math.nan,
                                    **phases[2]}]),
                       ("snake", [line, {**line, "iteration": 2}])]:
        run = tmp_path / name
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        support.plot_curves(run)
        widths[name] = matplotlib.image.imread(run / "curves.png").shape[1]
    assert widths["probed"] > widths["snake"]  # a fourth panel, on a wider figure


def test_sampled_evaluation_plays_at_temperature_one_whatever_the_rollouts_explore_at(monkeypatch):
    """Rollouts may sample hotter to keep groups varied; the held-out "sampled" score is the
    policy's own distribution (T = 1), so it compares across runs."""
    played = []
    monkeypatch.setattr(msgrpo, "evaluate_policy",
                        lambda model, tokenizer, cfg, greedy=True:
                            played.append((greedy, cfg.temperature)) or {})
    cfg = msgrpo.resolve_defaults(msgrpo.Config(model="tiny", temperature=2.0, run_dir="unused"))
    result = msgrpo.evaluate_greedy_and_sampled(None, None, cfg)
    assert played == [(True, 2.0), (False, 1.0)] and "sampled" in result



def test_varied_rules_vary_training_games_only_and_evaluation_plays_the_games_own_rules():
    cfg = msgrpo.resolve_defaults(msgrpo.Config(env="snake", model="tiny", run_dir="x",
                                                env_options={"varied_rules": True}))
    rules = {seed: envs.make("snake", **msgrpo.training_env_options(cfg)).reset(seed=seed)[0]
             .split("\n")[0] for seed in range(20)}
    assert len(set(rules.values())) > 1  # training draws its rules per seed
    standard = envs.make("snake", size=6, max_steps=5).reset(seed=0)[0]
    held_out = envs.make("snake", **msgrpo.env_options(cfg)).reset(seed=0)[0]
    assert "varied_rules" not in msgrpo.env_options(cfg) and held_out == standard
