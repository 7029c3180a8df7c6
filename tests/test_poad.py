"""POAD and NTPO (baselines.py): the backups against hand-computed values, the critic on the tiny
model."""

import dataclasses

import numpy as np
import pytest
import torch

import baselines
import msgrpo
import support
from test_msgrpo import TINY_RUN, _without_timing

# --- the backups, by hand ---------------------------------------------------------------------

# A 3-step episode, reward 1 on the last step only, V = 0 everywhere, actions of 2, 3 and 1 tokens.
TOKENS = [2, 3, 1]
ZERO_VALUES = [np.zeros(n) for n in TOKENS]
REWARDS = [0.0, 0.0, 1.0]


def test_bad_gives_every_token_of_an_action_gamma_to_the_number_of_actions_before_the_reward():
    advantages = baselines.bad_advantages(ZERO_VALUES, REWARDS, gamma=0.95, lam=1.0)
    expected = [[0.95 ** 2] * 2, [0.95] * 3, [1.0]]
    for got, want in zip(advantages, expected):
        np.testing.assert_allclose(got, want)


def test_ntpo_discounts_by_the_number_of_tokens_to_the_rewarded_token():
    advantages = baselines.ntpo_advantages(ZERO_VALUES, REWARDS, gamma=0.95, lam=1.0)
    # Tokens 0..5 in order; the rewarded action's last token is token 5, so token k gets 0.95^(5-k).
    expected = [[0.95 ** 5, 0.95 ** 4], [0.95 ** 3, 0.95 ** 2, 0.95], [1.0]]
    for got, want in zip(advantages, expected):
        np.testing.assert_allclose(got, want)


# Two actions of 2 and 1 tokens, values V(o_1) = 0.5, V(o_1, w_1) = 0.2, V(o_2) = 0.4,
# rewards 0 then 1, gamma 0.9, lambda 0.5.
VALUES = [np.array([0.5, 0.2]), np.array([0.4])]


def test_bad_with_lambda_below_one_and_nonzero_values():
    # action 2, its only token:  delta = 1 + 0.9 * 0 - 0.4 = 0.6
    #                            A = 0.6
    # action 1, last token:      delta = 0 + 0.9 * 0.4 - 0.2 = 0.16
    #                            A = 0.16 + 0.9 * 0.5 * 0.6 = 0.43
    # action 1, first token:     delta = 0.2 - 0.5 = -0.3 (no discount)
    #                            A = -0.3 + 0.5 * 0.43 = -0.085
    advantages = baselines.bad_advantages(VALUES, [0.0, 1.0], gamma=0.9, lam=0.5)
    np.testing.assert_allclose(advantages[0], [-0.085, 0.43])
    np.testing.assert_allclose(advantages[1], [0.6])


def test_ntpo_with_lambda_below_one_and_nonzero_values():
    # token deltas: 0 + 0.9 * 0.2 - 0.5 = -0.32, 0 + 0.9 * 0.4 - 0.2 = 0.16, 1 - 0.4 = 0.6
    # gamma lambda = 0.45 at every token: 0.6, 0.16 + 0.45 * 0.6 = 0.43,
    # -0.32 + 0.45 * 0.43 = -0.1265
    advantages = baselines.ntpo_advantages(VALUES, [0.0, 1.0], gamma=0.9, lam=0.5)
    np.testing.assert_allclose(advantages[0], [-0.1265, 0.43])
    np.testing.assert_allclose(advantages[1], [0.6])


def test_with_one_token_actions_bad_and_ntpo_are_the_same_gae():
    rng = np.random.default_rng(0)
    values = [rng.normal(size=1) for _ in range(6)]
    rewards = list(rng.normal(size=6))
    bad = baselines.bad_advantages(values, rewards, gamma=0.9, lam=0.8)
    ntpo = baselines.ntpo_advantages(values, rewards, gamma=0.9, lam=0.8)
    np.testing.assert_allclose(np.concatenate(bad), np.concatenate(ntpo))


def test_clipped_value_loss_by_hand():
    old = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0]])
    mask = torch.tensor([[1, 1]])
    # V = 0.5: unclipped error 0.5, clipped V = 0.2 with error 0.8 -> the larger, 0.5 * 0.64 = 0.32
    # V = 1.0: error 0, clipped V = 0.2 with error 0.8 -> 0.32 again; the mean is 0.32
    loss = baselines.clipped_value_loss(torch.tensor([[0.5, 1.0]]), old, returns, mask,
                                        eps_clip=0.2)
    assert loss.item() == pytest.approx(0.32)
    # A masked token does not count.
    loss = baselines.clipped_value_loss(torch.tensor([[0.1, 5.0]]), old, returns,
                                        torch.tensor([[1, 0]]), 0.2)
    assert loss.item() == pytest.approx(0.5 * 0.9 ** 2)


# --- the critic on the tiny model ---------------------------------------------------------------


def attach_value_head(model):
    """What msgrpo.train does with baselines.value_head_beside: the critic becomes
    model.value_head."""
    for name, module in baselines.value_head_beside(model).items():
        setattr(model, name, module)


@pytest.fixture(scope="module")
def tiny_with_critic():
    cfg = msgrpo.resolve_defaults(baselines.POADConfig(model="tiny", run_dir="unused", group_size=2,
                                                env_options={"max_steps": 3}))
    torch.manual_seed(0)
    model, tokenizer = msgrpo.load_policy(cfg)
    attach_value_head(model)
    torch.nn.init.normal_(model.value_head.mlp[2].weight)  # a critic that is not zero everywhere
    return cfg, model, tokenizer


def test_values_come_from_the_positions_that_sample_each_response_token(tiny_with_critic):
    cfg, model, tokenizer = tiny_with_critic
    prompts = [msgrpo.lap_prompt_ids(tokenizer, "a short observation", cfg),
               msgrpo.lap_prompt_ids(tokenizer, "a much longer observation than the other one",
                                     cfg)]
    batch = msgrpo.collate_steps([(prompts[0], [11, 12, 13], 0.0), (prompts[1], [14], 0.0)],
                                 tokenizer.pad_token_id)
    model.eval()
    with torch.no_grad():
        logprobs, mask, values = baselines.logprobs_and_values(model, batch, cfg.temperature)
        expected_logprobs, _ = msgrpo.response_logprobs(model, batch, cfg.temperature)
        position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
        hidden = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=position_ids,
                       output_hidden_states=True).hidden_states[-1]
    # Row 0: V(o), V(o, w_1), V(o, w_1 w_2) sit at the last prompt token and the first two
    # response tokens.
    torch.testing.assert_close(values[0], model.value_head(hidden[0, -4:-1]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(values[1, -1], model.value_head(hidden[1, -2]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logprobs, expected_logprobs)
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_backed_up_steps_follow_the_episodes_and_their_rewards(tiny_with_critic):
    cfg, model, tokenizer = tiny_with_critic
    torch.manual_seed(1)
    episodes = msgrpo.play_groups(model, tokenizer, cfg, seeds=[5])
    steps = baselines.backed_up_steps(model, tokenizer, episodes, cfg)
    assert len(steps) == sum(len(ep.responses) for ep in episodes)
    first = 0
    for ep in episodes:
        mine = steps[first:first + len(ep.responses)]
        values = [s.old_values for s in mine]
        np.testing.assert_allclose(
            np.concatenate([s.advantages for s in mine]),
            np.concatenate(baselines.bad_advantages(values, ep.rewards, cfg.gamma, cfg.gae_lambda)))
        for step, response, sampled in zip(mine, ep.responses, ep.logprobs):
            assert step.response == response and len(step.advantages) == len(response)
            np.testing.assert_allclose(step.returns, step.advantages + step.old_values)
            np.testing.assert_allclose(step.old_logprobs, sampled,
                                       atol=1e-3)  # the policy that sampled
        first += len(ep.responses)


def test_one_update_moves_values_towards_the_returns():
    cfg = msgrpo.resolve_defaults(baselines.POADConfig(model="tiny", run_dir="unused", lr=1e-3,
                                                       vf_coef=1.0))
    torch.manual_seed(0)
    model, tokenizer = msgrpo.load_policy(cfg)
    attach_value_head(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    prompt = msgrpo.lap_prompt_ids(tokenizer, "state", cfg)
    step = baselines.TokenStep(prompt, [11, 12], advantages=np.zeros(2),
                            returns=np.array([1.0, 1.0]),
                            old_values=np.zeros(2), old_logprobs=np.zeros(2))
    batch = msgrpo.collate_steps([(prompt, [11, 12], 0.0)], tokenizer.pad_token_id)
    for _ in range(3):
        baselines.update_policy_and_critic(model, optimizer, tokenizer, [step], cfg,
                                           np.random.default_rng(0))
    with torch.no_grad():
        _, _, values = baselines.logprobs_and_values(model, batch, cfg.temperature)
    # from 0 towards 1; the clip allows at most 0.2 per step's old value
    assert (values > 0.05).all()


@pytest.mark.parametrize("algo", ["poad", "ntpo"])
def test_critic_runs_save_the_value_head_and_resume_exactly(tmp_path, algo):
    run = [algo] + TINY_RUN + ["--eval-episodes", "0"]
    straight = baselines.main(run + ["--iterations", "2", "--run-dir", str(tmp_path / "a")])
    stopped = baselines.main(run + ["--iterations", "1", "--run-dir", str(tmp_path / "b")])
    resumed = baselines.main([algo, "--resume", str(stopped), "--iterations", "2"])
    assert support.load_json(resumed / "config.json")["algo"] == algo
    metrics = support.read_metrics(resumed)
    assert all(m["value_loss"] >= 0 and m["episodes_trained"] == 8 for m in metrics)
    assert _without_timing(metrics) == _without_timing(support.read_metrics(straight))
    assert "value_head" in torch.load(resumed / "checkpoint.pt", weights_only=False)
    adapter = (resumed / "adapter" / "adapter_model.safetensors")
    from safetensors.torch import load_file
    assert not any("value_head" in name
                   for name in load_file(adapter))  # the adapter is the policy only


def test_the_critics_settings_are_baselines_flags_not_msgrpos(capsys):
    with pytest.raises(ValueError, match="algo"):
        baselines.POADConfig(algo="ppo")
    with pytest.raises(SystemExit):
        msgrpo.main(["--gamma", "0.9"])
    assert "unrecognized arguments: --gamma" in capsys.readouterr().err
    assert "--algo" not in msgrpo.build_parser().format_help()


def test_the_critic_gradient_does_not_shrink_the_policys():
    cfg = msgrpo.resolve_defaults(baselines.POADConfig(model="tiny", run_dir="unused", lr=0.0))
    torch.manual_seed(0)
    model, tokenizer = msgrpo.load_policy(cfg)
    attach_value_head(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=0.0)  # nothing moves
    prompt = msgrpo.lap_prompt_ids(tokenizer, "state", cfg)
    step = baselines.TokenStep(prompt, [11, 12], advantages=np.array([1.0, -1.0]),
                            returns=np.array([50.0, 50.0]),
                            old_values=np.zeros(2), old_logprobs=np.zeros(2))
    norms = [baselines.update_policy_and_critic(model, optimizer, tokenizer, [step],
                                                dataclasses.replace(cfg, vf_coef=c),
                                                np.random.default_rng(0))["grad_norm"]
             for c in (0.0, 100.0)]
    assert norms[0] > 0 and norms[0] == pytest.approx(norms[1])
