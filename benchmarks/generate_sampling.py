"""The rollout sampler that support.sample_replies replaced, kept to time against it (bench_cpu.py).

transformers' model.generate over left-padded prompts, each distinct prompt read once (its keys and
values but the last token's, which generate reads itself, copied to every row holding it), on
bitsandbytes' packed CPU 4-bit layout, which multiplies faster than its differentiable one but
rounds differently from the weights the update trains.
"""

import copy
import functools
from contextlib import contextmanager

import torch

import msgrpo
import support


@contextmanager
def packed_4bit_weights(model):
    """bitsandbytes' packed CPU layout swapped in for sampling, the differentiable one back after
    (bitsandbytes' inverse is lossy, so each layer packs a copy once). Only on AVX512-BF16 CPUs."""
    from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu, has_avx512bf16
    layers = support.cpu_4bit_layers(model)
    if not layers or not has_avx512bf16():
        yield
        return
    trainable = {layer: (layer.weight.data, layer.weight.quant_state) for layer in layers}
    for layer in layers:
        if not hasattr(layer, "packed_for_generation"):
            layer.packed_for_generation = _convert_weight_packed_for_cpu(
                layer.weight.data.clone(), copy.deepcopy(layer.weight.quant_state))
        layer.weight.data, layer.weight.quant_state = layer.packed_for_generation
    try:
        yield
    finally:
        for layer, (data, quant_state) in trainable.items():
            layer.weight.data, layer.weight.quant_state = data, quant_state


def prompts_for_generate(model, prompts: list[list[int]], pad_id: int):
    """generate()'s left-padded input_ids and attention_mask, one row per prompt, and the keys and
    values of every row but its last token: the shared prefix read once, each distinct prompt
    once, then copied to the rows that hold it."""
    device = next(model.parameters()).device
    distinct, rows = support.distinct_rows([tuple(p) for p in prompts])
    shared = support.shared_prefix_length(distinct)
    suffix_ids, suffix_mask = support.left_pad([list(p[shared:]) for p in distinct], pad_id)
    prefix = torch.tensor(distinct[0][:shared], dtype=torch.long)
    input_ids = torch.cat([prefix.expand(len(distinct), shared), suffix_ids], dim=1)
    attention_mask = torch.cat([torch.ones(len(distinct), shared, dtype=torch.long), suffix_mask],
                               dim=1)
    cache = support.prefix_cache(model, prefix, len(distinct)) if shared else None
    if input_ids.shape[1] - 1 > shared:
        mask = attention_mask[:, :-1]
        position_ids = support.left_padded_positions(mask)[:, shared:]
        cache = model(input_ids=input_ids[:, shared:-1].to(device), attention_mask=mask.to(device),
                      position_ids=position_ids.to(device), cache=cache, use_cache=True,
                      logits_to_keep=1).cache
    if cache is not None:
        cache.batch_select_indices(rows.to(device))
    return input_ids[rows], attention_mask[rows], cache


@functools.cache
def stop_string_criterion(tokenizer, text: str):
    from transformers import StopStringCriteria
    return StopStringCriteria(tokenizer, [text])


@torch.no_grad()
def sample_responses(model, tokenizer, prompts: list[list[int]], max_new_tokens: int,
                     temperature: float, share_prefix: bool = True, kept_prefixes=None):
    """msgrpo.sample_responses' signature and results, sampled with model.generate. The prefix is
    read again in every call (kept_prefixes is not used: the code before kept none)."""
    model.eval()
    device = next(model.parameters()).device
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, min_p=None)
    with packed_4bit_weights(model):
        input_ids, attention_mask, cache = prompts_for_generate(model, prompts,
                                                                tokenizer.pad_token_id)
        out = model.generate(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), cache=cache,
            max_new_tokens=max_new_tokens, repetition_penalty=1.0,
            **(sampling if temperature > 0 else dict(do_sample=False)),
            stopping_criteria=[stop_string_criterion(tokenizer, msgrpo.ACTION_END)],
            pad_token_id=tokenizer.pad_token_id, output_scores=True, return_dict_in_generate=True)
    new_tokens = out.sequences[:, input_ids.shape[1]:].cpu()
    logprobs = torch.stack([step.float().log_softmax(-1).gather(-1, new_tokens[:, t, None])[:, 0]
                            for t, step in enumerate(out.scores)], 1).cpu()
    end_ids = msgrpo.end_token_ids(model, tokenizer)
    responses, response_logprobs = [], []
    for row in range(len(prompts)):
        ids = new_tokens[row].tolist()
        n = next((j + 1 for j in range(len(ids))
                  if msgrpo.ends_reply(ids[: j + 1], end_ids, tokenizer)), len(ids))
        responses.append(ids[:n])
        response_logprobs.append(logprobs[row, :n].tolist())
    return responses, response_logprobs
