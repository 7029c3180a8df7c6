"""The CPU speed-ups (cpu_speedups.py) give the plain path's numbers: an iteration trained with and
without them, and each speed-up on its own, against msgrpo.py's plain forward.

Tolerances: the speed-ups add the same products in another order (a shared prefix's keys and
values computed once, oneDNN's kernel, attention over grouped heads), so float32 rounding moves
log-probs by up to ~1e-6 on the tiny model; we allow 1e-4 for log-probs and rtol 1e-3 / atol 1e-6
for LoRA gradients. A sampled token could move only where a uniform draw falls within that
rounding of a cumulative-probability boundary; with the seeds here none does, and the test says
so by comparing every token.
"""

import contextlib
import os
from unittest import mock

import numpy as np
import pytest
import torch

import cpu_speedups
import msgrpo
from test_msgrpo import (  # noqa: F401 (tiny: the tiny policy, a fixture)
    _lap_steps, _logprobs_and_lora_grads, _tiny_policy_with_a_trained_adapter, tiny)
from test_same_metrics import tiny_model_that_names_moves

LOGPROB_TOLERANCE = 1e-4
GRAD_RTOL, GRAD_ATOL = 1e-3, 1e-6


def _one_iteration(speedups: bool):
    """One MS-GRPO iteration on the tiny model nudged to name moves (so returns differ within
    groups and advantages are non-zero), KL on: its episodes, update statistics and LoRA gradients
    (of its one AdamW step, at lr 0 so the weights stay as they were)."""
    cfg = msgrpo.resolve_defaults(msgrpo.Config(
        model="tiny", groups=2, group_size=4, env_options={"max_steps": 4}, beta=0.1, lr=1e-12,
        cpu_speedups=speedups, run_dir="unused"))
    assert cfg.cpu_speedups == speedups
    with tiny_model_that_names_moves():
        torch.manual_seed(0)
        model, tokenizer = msgrpo.load_policy(cfg)
    for module in model.modules():  # B = 0 at init would leave every lora_A gradient 0
        if hasattr(module, "lora_B"):
            for weight in module.lora_B.values():
                torch.nn.init.normal_(weight.weight, std=0.1)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)
    rng = np.random.default_rng(0)
    torch.manual_seed(1)
    episodes = msgrpo.play_groups(model, tokenizer, cfg, [3, 4])
    stats = msgrpo.msgrpo_update(model, optimizer, tokenizer, episodes, cfg, rng)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return episodes, stats, grads


def test_an_iteration_with_the_speedups_gives_the_plain_paths_tokens_logprobs_and_gradients():
    (plain_eps, plain_stats, plain_grads), (fast_eps, fast_stats, fast_grads) = (
        _one_iteration(False), _one_iteration(True))
    assert plain_stats["episodes_trained"] > 0 and plain_stats["loss"] != 0  # it trains
    assert [ep.responses for ep in fast_eps] == [ep.responses for ep in plain_eps]  # every token
    for plain, fast in zip(plain_eps, fast_eps):
        for plain_step, fast_step in zip(plain.logprobs, fast.logprobs):
            np.testing.assert_allclose(fast_step, plain_step, atol=LOGPROB_TOLERANCE)
    for name in ("episodes_trained", "steps_trained", "tokens_trained"):
        assert fast_stats[name] == plain_stats[name]
    for name in ("loss", "kl", "grad_norm"):
        assert fast_stats[name] == pytest.approx(plain_stats[name], rel=1e-3, abs=1e-6), name
    assert plain_grads.keys() == fast_grads.keys() and plain_grads
    assert any(grad.abs().sum() > 0 for grad in plain_grads.values())
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fast_grads[name], grad, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)


def test_the_speedups_are_on_on_the_cpu_only_and_off_with_gradient_checkpointing():
    on = msgrpo.resolve_defaults(msgrpo.Config(model="tiny", run_dir="x"))
    assert on.cpu_speedups == (not torch.cuda.is_available())
    assert not msgrpo.resolve_defaults(msgrpo.Config(cpu_speedups=False, run_dir="x")).cpu_speedups
    checkpointed = msgrpo.Config(gradient_checkpointing=True, run_dir="x")
    assert not msgrpo.resolve_defaults(checkpointed).cpu_speedups  # it recomputes without a cache


# --- sampling ---------------------------------------------------------------------------------


def _assert_samples_as_the_plain_loop(model, tokenizer, prompts, speedups: dict):
    """Same seed, the plain loop and the speed-ups (their dict `speedups`): the same replies, and
    log-probs within LOGPROB_TOLERANCE."""
    runs = []
    for side in (None, speedups):
        torch.manual_seed(5)
        runs.append(msgrpo.sample_responses(model, tokenizer, prompts, 6, 1.0, side))
    (plain_ids, plain_logp), (fast_ids, fast_logp) = runs
    assert fast_ids == plain_ids
    for plain_row, fast_row in zip(plain_logp, fast_logp):
        np.testing.assert_allclose(fast_row, plain_row, atol=LOGPROB_TOLERANCE)


def test_reading_prompts_once_samples_what_the_plain_loop_samples(tiny):
    """Same seed, plain and with the speed-ups' first forward (the shared prefix and each distinct
    prompt read once, a preallocated cache): the same replies and log-probs, repeated prompts
    included."""
    cfg, model, tokenizer = tiny
    four = [step[0] for step in _lap_steps(tokenizer, cfg, ["", "", "", ""])]
    for prompts in (four + four[::-1] + four[:1], four[:1] * 3):  # 9 rows of 4 prompts; 3 of one
        _assert_samples_as_the_plain_loop(model, tokenizer, prompts, {})


def test_kept_prefixes_sample_what_the_plain_loop_samples(tiny):
    """A rollout's calls, one after another: the first keeps the rules' keys and values, the later
    ones (a single prompt, whose shared prefix alone would be empty, and the prompts reversed)
    start from them, and the replies and log-probs are the plain loop's."""
    cfg, model, tokenizer = tiny
    four = [step[0] for step in _lap_steps(tokenizer, cfg, ["", "", "", ""])]
    kept = {}
    for prompts in [four, four[:1], four[::-1]]:
        _assert_samples_as_the_plain_loop(model, tokenizer, prompts, kept)
    assert len(kept) == 1  # computed by the first call, found by the others
    (prefix,) = kept
    assert len(prefix) == cpu_speedups.shared_prefix_length(four) > 0


def test_kept_prefix_is_the_longest_one_every_prompt_goes_past():
    kept = {(1, 2): None, (1, 2, 3): None, (9,): None}
    assert cpu_speedups.kept_prefix(kept, [(1, 2, 3, 4), (1, 2, 3, 5)]) == (1, 2, 3)
    assert cpu_speedups.kept_prefix(kept, [(1, 2, 3, 4), (1, 2, 7)]) == (1, 2)
    assert cpu_speedups.kept_prefix(kept, [(1, 2, 3)]) == (1, 2)  # a prompt must go past it
    assert cpu_speedups.kept_prefix(kept, [(1, 2, 3, 4), (8,)]) == ()
    assert cpu_speedups.kept_prefix({}, [(1, 2)]) == ()


def test_shared_prefix_length_leaves_keep_tokens_of_every_row():
    assert cpu_speedups.shared_prefix_length([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9]]) == 2
    assert cpu_speedups.shared_prefix_length([[1, 2, 3, 4], [1, 2, 3, 4]], keep=1) == 3
    assert cpu_speedups.shared_prefix_length([[1, 2, 3, 4], [1, 2, 3, 4]], keep=3) == 1
    assert cpu_speedups.shared_prefix_length([[1, 2, 3]]) == 0  # one row: nothing to share
    assert cpu_speedups.shared_prefix_length([[5, 2], [1, 2]]) == 0


# --- the update's batches -----------------------------------------------------------------------


def test_shared_steps_give_the_plain_batchs_logprobs_and_gradients():
    """The shared prefix run once (its keys and values repeated for every row) and identical steps
    read once give the per-step log-probs and LoRA gradients of one row per step."""
    cfg, model, tokenizer = _tiny_policy_with_a_trained_adapter()
    steps = _lap_steps(tokenizer, cfg, ["right</action>", "down</action>\n", "up"])
    steps.append((steps[0][0], steps[0][1], 0.5))  # the same step again, from another episode
    plain = msgrpo.collate_steps(steps, tokenizer.pad_token_id)
    shared = cpu_speedups.collate_steps(steps, tokenizer.pad_token_id)
    assert len(shared.prefix_ids) > 50 and len(shared.input_ids) == 3
    assert shared.step_rows.tolist()[-1] == 0
    assert shared.response_tokens() == plain.response_tokens() == sum(len(r) for _, r, _ in steps)
    model.train()
    (full, mask, full_grads), (fast, fast_mask, fast_grads) = (
        _logprobs_and_lora_grads(model, plain), _logprobs_and_lora_grads(model, shared))
    assert torch.equal(mask, fast_mask)
    assert (full - fast)[mask.bool()].abs().max() < LOGPROB_TOLERANCE
    for name, grad in full_grads.items():
        torch.testing.assert_close(fast_grads[name], grad, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)


def test_the_prefix_tree_reads_each_distinct_prompt_once():
    """A group's episodes share their first prompt and differ in the reply: the prefix once, then
    the 3 distinct prompts once, then all 5 rows' tails, where the plain forward reads 5 rows
    whole; the same log-probs and LoRA gradients."""
    cfg, model, tokenizer = _tiny_policy_with_a_trained_adapter()
    steps = _lap_steps(tokenizer, cfg, ["right</action>", "down</action>", "up</action>"])
    steps += [(steps[0][0], tokenizer(reply, add_special_tokens=False).input_ids, advantage)
              for reply, advantage in [("left</action>", -1.0), ("up</action>", 0.5)]]
    model.train()
    results = {}
    for collate in (msgrpo.collate_steps, cpu_speedups.collate_steps):
        forward_rows = []
        original_forward = type(model).forward

        def counting_forward(self, *args, **kwargs):
            forward_rows.append(kwargs["input_ids"].shape[0])
            return original_forward(self, *args, **kwargs)

        with mock.patch.object(type(model), "forward", counting_forward):
            results[collate] = _logprobs_and_lora_grads(model, collate(steps,
                                                                       tokenizer.pad_token_id))
        assert forward_rows == ([5] if collate is msgrpo.collate_steps else [1, 3, 5])
    (rows, mask, rows_grads), (tree, _, tree_grads) = results.values()
    assert (rows - tree)[mask.bool()].abs().max() < LOGPROB_TOLERANCE
    for name, grad in rows_grads.items():
        torch.testing.assert_close(tree_grads[name], grad, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)


def test_micro_batches_keep_every_step_and_hold_size_distinct_steps_however_often_each_repeats():
    """Identical steps are one row of the forward, so they count once against --micro-batch."""
    steps = [([1, 2, k % 3], [7], float(k)) for k in range(9)] + [([1, 2, 3], [8], 9.0)]
    micro = cpu_speedups.micro_batches(steps, 2)
    assert [len(m) for m in micro] == [6, 4]  # prompts ending 0 and 1; then 2 and the 8 reply
    assert [len({(tuple(p), tuple(r)) for p, r, _ in m}) for m in micro] == [2, 2]
    assert sorted(a for m in micro for _, _, a in m) == [float(k) for k in range(10)]
    assert [len(m) for m in cpu_speedups.micro_batches(steps, 0)] == [10]
    assert [len(m) for m in msgrpo.chunks(steps, 2)] == [2, 2, 2, 2, 2]  # the plain path's


# --- 4-bit weights --------------------------------------------------------------------------------


def _three_step_batch(tokenizer, cfg):
    steps = _lap_steps(tokenizer, cfg, ["right</action>", "down</action>\n", "up"])
    return cpu_speedups.collate_steps(steps, tokenizer.pad_token_id)


def test_dequantized_weights_give_the_4bit_layers_logprobs_and_gradients():
    """Each 4-bit base weight dequantized once and kept gives what bitsandbytes computes, forward
    and backward, and the layers are bitsandbytes' own again afterwards."""
    import bitsandbytes as bnb

    cfg, model, tokenizer = _tiny_policy_with_a_trained_adapter()
    batch = _three_step_batch(tokenizer, cfg)
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    model.train()
    results = {}
    for kept in (False, True):
        with cpu_speedups.dequantized_4bit_weights(model) if kept else contextlib.nullcontext():
            on_cpu = not torch.cuda.is_available()
            assert all(("forward" in vars(layer)) == (kept and on_cpu) for layer in layers)
            results[kept] = _logprobs_and_lora_grads(model, batch)
    assert not any("forward" in vars(layer) for layer in layers)  # bitsandbytes' forward is back
    (plain, mask, plain_grads), (kept, _, kept_grads) = results[False], results[True]
    assert (plain - kept)[mask.bool()].abs().max() < 1e-5
    assert any(grad.abs().sum() > 0 for grad in plain_grads.values())
    for name, grad in plain_grads.items():
        torch.testing.assert_close(kept_grads[name], grad, rtol=1e-4, atol=1e-7, msg=name)


def test_sampling_and_training_leave_the_4bit_layers_as_they_were(tiny):
    """After the context, and after it entered inside itself, the layers are bitsandbytes' own."""
    import bitsandbytes as bnb

    cfg, model, tokenizer = tiny
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    before = [(m.weight.data.data_ptr(), m.weight.quant_state) for m in layers]
    prompt = msgrpo.lap_prompt_ids(tokenizer, "You are at (row 0, col 0).", cfg)
    msgrpo.sample_responses(model, tokenizer, [prompt], 4, 1.0, speedups={})
    shadowed = lambda: [("forward" in vars(m)) for m in layers]  # noqa: E731
    assert layers and not any(shadowed())
    with cpu_speedups.dequantized_4bit_weights(model):
        with cpu_speedups.dequantized_4bit_weights(model):
            pass
        assert all(shadowed()) == (not torch.cuda.is_available())
    assert not any(shadowed())
    assert [(m.weight.data.data_ptr(), m.weight.quant_state) for m in layers] == before


def test_onednn_linear_gives_the_default_kernels_logprobs_and_gradients():
    if torch.cuda.is_available() or not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN's CPU kernels only")
    cfg, model, tokenizer = _tiny_policy_with_a_trained_adapter()
    batch = _three_step_batch(tokenizer, cfg)
    model.train()
    results = {}
    for onednn in (False, True):
        apply = cpu_speedups.OneDNNFrozenLinear.apply
        with mock.patch.object(cpu_speedups, "onednn_is_faster", lambda shape, rows: onednn), \
                mock.patch.object(cpu_speedups.OneDNNFrozenLinear, "apply", wraps=apply) as calls, \
                cpu_speedups.dequantized_4bit_weights(model):
            results[onednn] = _logprobs_and_lora_grads(model, batch)
        assert calls.called == onednn
    (plain, mask, plain_grads), (onednn, _, onednn_grads) = results[False], results[True]
    assert (plain - onednn)[mask.bool()].abs().max() < LOGPROB_TOLERANCE
    assert any(grad.abs().sum() > 0 for grad in plain_grads.values())
    for name, grad in plain_grads.items():
        torch.testing.assert_close(onednn_grads[name], grad, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                   msg=name)


def test_onednn_linear_backward_is_the_transposed_product():
    """dL/dx = dL/dy W, hand-checked on a 2x3 weight: y = x W^T."""
    weight = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    x = torch.tensor([[1.0, 0.0, -1.0]], requires_grad=True)
    y = cpu_speedups.OneDNNFrozenLinear.apply(x, weight, weight.t().contiguous())
    assert torch.allclose(y, torch.tensor([[-2.0, -2.0]]))
    y.backward(torch.tensor([[1.0, 1.0]]))
    assert torch.allclose(x.grad, torch.tensor([[5.0, 7.0, 9.0]]))


def test_the_kernel_is_chosen_per_power_of_two_of_rows_up_to_256():
    """A decoding step's rows and an update's are timed apart: [batch, tokens, features] counts
    batch x tokens rows, rounded up to a power of two."""
    shapes = [(1, 1, 7), (2, 7), (3, 5, 7), (16, 7), (17, 7), (300, 7), (64, 71, 7)]
    buckets = [cpu_speedups.rows_bucket(torch.zeros(*shape)) for shape in shapes]
    assert buckets == [1, 2, 16, 16, 32, 256, 256]


def test_grouped_query_attention_keeps_logprobs_and_gradients():
    """Attention over the grouped key/value heads (no copies of them) gives the log-probs and LoRA
    gradients of transformers' path, which copies each key/value head per query head; the switch
    is off again afterwards."""
    from transformers.integrations import sdpa_attention

    cfg, model, tokenizer = _tiny_policy_with_a_trained_adapter()
    assert model.config.num_attention_heads > model.config.num_key_value_heads
    batch = _three_step_batch(tokenizer, cfg)
    model.train()
    results = {}
    for grouped in (False, True):
        copying = mock.patch.object(sdpa_attention, "repeat_kv", wraps=sdpa_attention.repeat_kv)
        attention = (cpu_speedups.grouped_query_attention() if grouped
                     else contextlib.nullcontext())
        with copying as copies, attention:
            results[grouped] = _logprobs_and_lora_grads(model, batch)
        assert copies.called != grouped
    assert cpu_speedups.FORCE_GQA not in os.environ
    (copied, mask, copied_grads), (grouped, _, grouped_grads) = results[False], results[True]
    assert (copied - grouped)[mask.bool()].abs().max() < LOGPROB_TOLERANCE
    for name, grad in copied_grads.items():
        torch.testing.assert_close(grouped_grads[name], grad, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                   msg=name)


# --- the allocator ------------------------------------------------------------------------------


def test_the_command_starts_again_under_jemalloc_once_where_the_system_has_it(monkeypatch):
    started = []
    monkeypatch.setattr(cpu_speedups.os, "execve", lambda *args: started.append(args))
    monkeypatch.setattr("ctypes.util.find_library", lambda name: f"lib{name}.so.2")
    monkeypatch.setattr(cpu_speedups.sys, "platform", "linux")
    monkeypatch.setenv("LD_PRELOAD", "libother.so")
    cpu_speedups.run_under_jemalloc(["msgrpo.py", "--no-cpu-speedups"])  # the switch: as is
    assert not started
    cpu_speedups.run_under_jemalloc(["msgrpo.py", "--env", "snake"])
    ((executable, argv, env),) = started
    assert argv == [executable, "msgrpo.py", "--env", "snake"]
    assert env["LD_PRELOAD"] == "libjemalloc.so.2 libother.so"
    monkeypatch.setenv("LD_PRELOAD", env["LD_PRELOAD"])  # the started process: runs as is
    cpu_speedups.run_under_jemalloc(["msgrpo.py"])
    monkeypatch.setattr("ctypes.util.find_library", lambda name: None)  # no jemalloc: as is
    monkeypatch.delenv("LD_PRELOAD")
    cpu_speedups.run_under_jemalloc(["msgrpo.py"])
    assert len(started) == 1
