"""The CUDA default's choices, shown on the CPU: compute precision, the evaluation batch, scores
only where used, non-reentrant checkpointing, random state on every device, the start-of-run
line."""

import dataclasses

import numpy as np
import pytest
import torch

import envs
import msgrpo
import support


def tiny_config(**overrides):
    return msgrpo.resolve_defaults(msgrpo.Config(model="tiny", run_dir="unused", **overrides))


def test_activations_run_in_bf16_on_cuda_and_fp32_on_the_cpu():
    assert msgrpo.compute_dtype("cuda") is torch.bfloat16
    assert msgrpo.compute_dtype("cpu") is torch.float32


def test_the_base_stays_in_the_compute_dtype_while_lora_weights_stay_fp32(monkeypatch):
    """peft's prepare_model_for_kbit_training would upcast the embedding and norms to fp32, and the
    residual stream with them; here only the LoRA weights are fp32 and the activations stay bf16."""
    monkeypatch.setattr(msgrpo, "compute_dtype", lambda device: torch.bfloat16)  # as on CUDA
    model, tokenizer = msgrpo.load_policy(tiny_config(quantize=False))
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name and p.dtype == torch.float32
                             for name, p in trainable.items())
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    ids = torch.tensor([tokenizer("You are at (row 0, col 0).").input_ids])
    out = model(input_ids=ids, output_hidden_states=True)
    assert all(h.dtype == torch.bfloat16 for h in out.hidden_states)
    out.logits.float().logsumexp(-1).sum().backward()
    # lora_B starts at zero, so only it has a gradient on the first step (lora_A's goes through B)
    assert all(p.grad.abs().sum() > 0 for name, p in trainable.items() if "lora_B" in name)


def test_gradient_checkpointing_is_non_reentrant_and_lora_still_learns():
    model, tokenizer = msgrpo.load_policy(tiny_config(gradient_checkpointing=True))
    functions = [m._gradient_checkpointing_func for m in model.modules()
                 if hasattr(m, "_gradient_checkpointing_func")]
    assert functions and all(f.keywords == {"use_reentrant": False} for f in functions)
    model.train()
    ids = torch.tensor([tokenizer("You are at (row 0, col 0).").input_ids])
    model(input_ids=ids).logits.logsumexp(-1).sum().backward()
    lora = [p for name, p in model.named_parameters()
            if "lora_B" in name]  # lora_A's gradient goes through B = 0
    assert lora and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora)


def test_the_evaluation_batch_is_a_setting_sized_per_device(monkeypatch):
    assert tiny_config().eval_batch == 64
    assert tiny_config(eval_batch=5).eval_batch == 5
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert tiny_config().eval_batch == 32

    seen = {}

    def fake_evaluate(agent, env_name, seeds, batch_size, progress, **options):
        seen.update(batch_size=batch_size, episodes=len(seeds))
        return {}

    monkeypatch.setattr(envs, "evaluate", fake_evaluate)
    msgrpo.evaluate_policy(None, None, dataclasses.replace(tiny_config(), eval_batch=7,
                                                           eval_episodes=20))
    assert seen == {"batch_size": 7, "episodes": 20}


def test_evaluation_replies_and_rollouts_get_their_log_probs():
    cfg = tiny_config()
    torch.manual_seed(0)
    model, tokenizer = msgrpo.load_policy(cfg)
    agent = msgrpo.LAPAgent(model, tokenizer, cfg, greedy=False)
    assert len(agent.act_batch(["You are at (row 0, col 0).", "You are at (row 1, col 2)."],
                               [{}, {}])) == 2
    prompts = [msgrpo.lap_prompt_ids(tokenizer, "You are at (row 0, col 0).", cfg)]
    responses, logprobs = msgrpo.sample_responses(model, tokenizer, prompts, 4, 1.0)
    assert len(logprobs[0]) == len(responses[0]) > 0 and all(lp <= 0 for lp in logprobs[0])


def test_the_start_of_run_line_names_device_model_precision_and_quantisation():
    model = torch.nn.Linear(1, 1)
    names = (msgrpo.compute_dtype, msgrpo.GPU_MODEL, msgrpo.CPU_MODEL)
    line = support.describe_run(tiny_config(), model, *names)
    assert line == "device cpu, model tiny, compute float32, base NF4 4-bit + LoRA r 8"
    cpu_config = msgrpo.Config(model=msgrpo.CPU_MODEL, quantize=False, lora_r=4)
    line = support.describe_run(cpu_config, model, *names)
    assert f"no CUDA in this torch: the CPU model, not {msgrpo.GPU_MODEL}" in line
    assert line.endswith("base float32 + LoRA r 4")


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA device to compare its random state")
def test_evaluation_leaves_the_cuda_random_state_where_it_was():
    cfg = tiny_config(eval_episodes=2, eval_batch=2)
    model, tokenizer = msgrpo.load_policy(cfg)
    before = torch.cuda.get_rng_state_all()
    msgrpo.evaluate_policy(model, tokenizer, cfg, greedy=False)
    assert all(torch.equal(a, b) for a, b in zip(before, torch.cuda.get_rng_state_all()))


def test_checkpoints_keep_and_restore_the_cuda_random_state_where_cuda_exists(monkeypatch,
                                                                              tmp_path):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    rng = np.random.default_rng(0)
    support.save_checkpoint(tmp_path, model, optimizer, rng, 3)
    assert "cuda_rng" not in support.load_checkpoint(tmp_path)  # no CUDA: nothing to keep

    cuda_state = [torch.arange(4, dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: cuda_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    support.save_checkpoint(tmp_path, model, optimizer, rng, 4)
    checkpoint = support.load_checkpoint(tmp_path)
    assert torch.equal(checkpoint["cuda_rng"][0], cuda_state[0])
    rng.random(5)  # move the generator on; restoring brings it back
    support.restore_random_state(checkpoint, rng)
    assert rng.bit_generator.state == np.random.default_rng(0).bit_generator.state
    assert len(restored) == 1 and torch.equal(restored[0][0], cuda_state[0])
