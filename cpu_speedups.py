"""The CPU speed-ups: msgrpo.py's plain path, the same numbers in less time and memory on a CPU.

msgrpo.py never needs this file to be understood. Config.cpu_speedups (on by default on the CPU
without gradient checkpointing; --no-cpu-speedups turns it off) swaps in four things, no more:

    1. 4-bit weights   NF4 base weights dequantized once and kept, oneDNN's kernel where it times
                       faster, attention on grouped key/value heads (dequantized_4bit_weights)
    2. prompts         the rollout's first forward: each distinct prompt read once, the shared
                       prefix once, kept across calls, the cache preallocated (read_prompts)
    3. steps           the update's batches: identical steps one row, the shared prefix once,
                       a prefix tree for the rest (collate_steps, response_logprobs)
    4. allocator       jemalloc, where the system has it (run_under_jemalloc)

A token sees earlier tokens only through their keys and values, so tokens several rows share can
be run once and their keys and values handed to every row: the same numbers, fewer FLOPs.
tests/test_cpu_speedups.py trains an iteration with and without them (same seed) and compares
tokens, log-probs and gradients; benchmarks/bench_cpu.py times both side by side.
"""

from __future__ import annotations

import ctypes.util
import functools
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from support import left_pad, left_padded_positions

# 1. 4-bit weights: dequantized once, the faster kernel, grouped-query attention ----------------
@contextmanager
def dequantized_4bit_weights(model):
    """Sample and train with each 4-bit base weight dequantized once and kept. bitsandbytes'
    differentiable CPU path dequantizes every weight in every forward and again in every backward
    (y = x W^T needs W; so does dL/dx = dL/dy W), though the base never changes. The kept W gives
    bitsandbytes' numbers, in rollouts as in the update, so tokens are sampled from exactly the
    policy the loss scores. The price is the fp32 copy (~0.4 GB for SmolLM2-135M), so this runs on
    the CPU only; elsewhere, or entered again inside itself, it does nothing. Inside it, attention
    runs on the grouped key/value heads too (grouped_query_attention)."""
    import bitsandbytes as bnb
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)
              and m.weight.device.type == "cpu" and "forward" not in vars(m)]
    for layer in layers:
        if not hasattr(layer, "dequantized_weight"):
            layer.dequantized_weight = bnb.functional.dequantize_4bit(layer.weight.data,
                                                                      layer.weight.quant_state)
        # shadows the class's forward
        layer.forward = functools.partial(linear_with_dequantized_weight, layer)
    try:
        with grouped_query_attention() if layers else nullcontext():
            yield
    finally:
        for layer in layers:
            del layer.forward

FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"  # transformers' switch: sdpa's enable_gqa with a mask

@contextmanager
def grouped_query_attention():
    """Attention over the key/value heads as they are. Given a mask, transformers copies each of
    SmolLM2-135M's 3 key/value heads 3 times (it has 9 query heads), and autograd keeps the copies.
    torch's CPU attention takes grouped heads (enable_gqa): the same numbers up to float rounding,
    an update's peak memory 0.6 GB lower at micro-batches of 16 steps, its step 1.1-1.3x faster."""
    before = os.environ.get(FORCE_GQA)
    os.environ[FORCE_GQA] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[FORCE_GQA]
        else:
            os.environ[FORCE_GQA] = before  # as it was set outside

def linear_with_dequantized_weight(layer, x: torch.Tensor) -> torch.Tensor:
    weight = layer.dequantized_weight.to(x.dtype)
    bias = None if layer.bias is None else layer.bias.to(x.dtype)
    if x.dtype == torch.float32 and onednn_is_faster(tuple(weight.shape), rows_bucket(x)):
        if not hasattr(layer, "dequantized_weight_t"):
            layer.dequantized_weight_t = weight.t().contiguous()
        y = OneDNNFrozenLinear.apply(x, weight, layer.dequantized_weight_t)
        return y if bias is None else y + bias
    return torch.nn.functional.linear(x, weight, bias)

def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T through oneDNN's kernel for nn.Linear (the one torch's CPU inductor backend calls)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, None, "none", [], "")

class OneDNNFrozenLinear(torch.autograd.Function):
    """y = x W^T, and in backward dL/dx = dL/dy W, both through oneDNN; W is the frozen base: no
    dL/dW. torch sends fp32 matmuls to MKL, half as fast on some CPUs (AVX-512 measured); results
    agree to float rounding (sums in another order). weight_t: W^T, contiguous for the backward."""

    @staticmethod
    def forward(ctx, x, weight, weight_t):
        ctx.save_for_backward(weight_t)
        return onednn_linear(x, weight)

    @staticmethod
    def backward(ctx, grad_y):
        (weight_t,) = ctx.saved_tensors
        return onednn_linear(grad_y, weight_t), None, None

def rows_bucket(x: torch.Tensor) -> int:
    """The rows of x (all but its last dimension) rounded up to a power of two, at most 256: the
    faster kernel differs between a decoding step's few rows and an update's hundreds."""
    rows = max(1, x.numel() // x.shape[-1])
    return min(256, 1 << (rows - 1).bit_length())

@functools.cache
def onednn_is_faster(weight_shape: tuple[int, int], rows: int) -> bool:
    """Is oneDNN's fp32 linear faster than torch's default (MKL) for this weight shape and row count
    on this CPU? It depends on all three: timed once each, forward and backward, best of 5."""
    if not torch.backends.mkldnn.is_available():
        return False
    out_features, in_features = weight_shape
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(weight_shape, generator=generator)
    weight_t = weight.t().contiguous()
    x = torch.randn(rows, in_features, generator=generator)
    grad_y = torch.randn(rows, out_features, generator=generator)

    def best_seconds(forward_and_backward):
        forward_and_backward()  # first call: oneDNN builds its kernel for this shape
        times = []
        for _ in range(5):
            start = time.perf_counter()
            forward_and_backward()
            times.append(time.perf_counter() - start)
        return min(times)

    default = best_seconds(lambda: (torch.nn.functional.linear(x, weight), grad_y @ weight))
    onednn = best_seconds(lambda: (onednn_linear(x, weight), onednn_linear(grad_y, weight_t)))
    return onednn < default

# 2. Prompts: each distinct prompt read once, the rules once a rollout -------------------------
def distinct_rows(items: list) -> tuple[list, torch.Tensor]:
    """The distinct items in first-seen order, and for each item the row of its copy among them:
    identical prompts or steps are then computed once."""
    distinct = list(dict.fromkeys(items))
    row_of = {item: row for row, item in enumerate(distinct)}
    return distinct, torch.tensor([row_of[item] for item in items])

def shared_prefix_length(sequences: list[list[int]], keep: int = 1) -> int:
    """How many leading tokens all sequences share, short of each one's last `keep`. Every LAP
    prompt opens alike (system prompt, rules, actions): ~90 of SmolLM2's ~160 on Frozen Lake."""
    if len(sequences) < 2:
        return 0
    first, limit = sequences[0], min(len(s) for s in sequences) - keep
    length = 0
    while length < limit and all(s[length] == first[length] for s in sequences):
        length += 1
    return length

def prefix_cache(model, prefix_ids: torch.Tensor, rows: int, kept: dict | None = None):
    """The shared prefix's keys and values, computed once, repeated for each row: a token sees
    earlier ones only through these, so the numbers are those of the prefix run in every row (under
    autograd the repeat sums the rows' gradients back). kept (prefix tokens -> keys and values)
    carries them to the next call while the weights stay the same: a kept prefix is not rerun."""
    from transformers import DynamicCache
    key = tuple(prefix_ids.tolist())
    if kept is not None and key in kept:
        keys_values = kept[key]
    else:
        device = next(model.parameters()).device
        cache = model(input_ids=prefix_ids[None].to(device), use_cache=True, logits_to_keep=1).cache
        keys_values = [(layer.keys, layer.values) for layer in cache.layers]
        if kept is not None:
            kept[key] = keys_values
    return DynamicCache([(keys.repeat_interleave(rows, 0), values.repeat_interleave(rows, 0))
                         for keys, values in keys_values], config=model.config)

def kept_prefix(kept: dict, prompts: list[tuple]) -> tuple:
    """The longest prefix in kept that every prompt starts with and goes past; () if none."""
    fits = [prefix for prefix in kept
            if all(len(p) > len(prefix) and p[:len(prefix)] == prefix for p in prompts)]
    return max(fits, key=len, default=())

def read_prompts(model, prompts: list[list[int]], pad_id: int, max_new_tokens: int, kept: dict):
    """The rollout's first forward, as msgrpo.sample_responses reads it: (next-token logits [N, V],
    the cache, the attention mask [N, L]). Each distinct prompt is read once (a group's episodes
    share their first prompt), their shared prefix once (prefix_cache, kept across calls), and the
    cache copied to every row once, with room for the reply (StaticCache): appending then writes
    in place, where a growing cache would copy every row's keys and values again at every token."""
    from transformers import StaticCache
    device = next(model.parameters()).device
    distinct, rows = distinct_rows([tuple(p) for p in prompts])
    shared = len(kept_prefix(kept, distinct)) or shared_prefix_length(distinct)
    suffix_ids, suffix_mask = left_pad([list(p[shared:]) for p in distinct], pad_id)
    prefix_ids = torch.tensor(distinct[0][:shared], dtype=torch.long)
    cache = prefix_cache(model, prefix_ids, len(distinct), kept) if shared else None
    attention_mask = torch.cat([torch.ones(len(distinct), shared, dtype=torch.long),
                                suffix_mask], 1)
    position_ids = left_padded_positions(attention_mask)[:, shared:]
    out = model(input_ids=suffix_ids.to(device), attention_mask=attention_mask.to(device),
                position_ids=position_ids.to(device), cache=cache, use_cache=True, logits_to_keep=1)
    device_rows = rows.to(device)
    logits, attention_mask = out.logits[device_rows, -1], attention_mask[rows].to(device)
    if max_new_tokens <= 1:  # the reply is the first token: no forward reads the cache
        return logits, None, attention_mask
    static = StaticCache(config=model.config,
                         max_cache_len=out.cache.get_seq_length() + max_new_tokens - 1)
    for layer, prompt_layer in zip(static.layers, out.cache.layers):
        layer.update(prompt_layer.keys[device_rows], prompt_layer.values[device_rows])
    return logits, static, attention_mask

# 3. Steps: identical steps one row, the shared prefix once, a prefix tree ----------------------
@dataclass
class SharedSteps:
    """msgrpo.StepBatch's steps, each distinct one a row after the prefix all share (system prompt,
    rules, actions); step_rows: the row each step reads. A group starts from one observation and
    often answers alike, so many steps are the same."""
    input_ids: torch.Tensor  # [U, L] the distinct steps, each after the shared prefix
    attention_mask: torch.Tensor  # [U, L] 1 on prompt and response tokens
    response_mask: torch.Tensor  # [U, L] 1 on response tokens only
    advantages: torch.Tensor  # [N] each step's episode advantage
    prefix_ids: torch.Tensor  # [P] the tokens every row starts with
    step_rows: torch.Tensor  # [N] the row of input_ids that step n reads

    def response_tokens(self) -> int:
        """Response tokens over all steps, identical steps counted each time (the loss's count)."""
        return int(self.response_mask.sum(1)[self.step_rows].sum())

def collate_steps(steps: list[tuple[list[int], list[int], float]], pad_id: int) -> SharedSteps:
    """steps: (prompt ids, response ids, advantage) -> SharedSteps."""
    distinct, step_rows = distinct_rows([(tuple(p), tuple(r)) for p, r, _ in steps])
    sequences = [list(p + r) for p, r in distinct]
    keep = max(len(r) for _, r in distinct) + 1  # the positions predicting a response stay in rows
    shared = shared_prefix_length(sequences, keep)
    input_ids, attention_mask = left_pad([s[shared:] for s in sequences], pad_id)
    response_mask = torch.zeros_like(attention_mask)
    for row, (_, response) in enumerate(distinct):
        if response:
            response_mask[row, -len(response):] = 1
    return SharedSteps(input_ids, attention_mask, response_mask, step_rows=step_rows,
                       advantages=torch.tensor([a for _, _, a in steps], dtype=torch.float32),
                       prefix_ids=torch.tensor(sequences[0][:shared], dtype=torch.long))

def micro_batches(minibatch: list, size: int) -> list[list]:
    """A minibatch's steps sorted, identical ones side by side, cut into slices of at most `size`
    distinct steps (all in one when size is 0): collate_steps makes identical steps one row, so a
    slice holds `size` rows. The gradient sums over the steps, whatever their order and grouping."""
    slices, keys = [], set()
    for step in sorted(minibatch, key=lambda step: (step[0], step[1])):
        key = (tuple(step[0]), tuple(step[1]))
        if not slices or (key not in keys and 0 < size == len(keys)):
            slices.append([])
            keys = set()
        slices[-1].append(step)
        keys.add(key)
    return slices

def response_logprobs(model, batch: SharedSteps, n: int, temperature: float, token_logprobs):
    """msgrpo.response_logprobs of every step, (logprobs [N, n], mask [N, n]): each distinct row's
    logits at its last n + 1 positions (last_logits), token_logprobs(logits, targets, T) on them,
    each step handed its row's values: the loss and its gradients are those of a row per step."""
    logits = last_logits(model, batch.input_ids, batch.attention_mask, batch.prefix_ids, n + 1)
    logprobs = token_logprobs(logits, batch.input_ids[:, -n:], temperature)
    rows = batch.step_rows.to(logits.device)
    return logprobs[rows], batch.response_mask[:, -n:].to(logits.device)[rows]

def last_logits(model, input_ids, attention_mask, prefix_ids, keep: int) -> torch.Tensor:
    """Logits at the last `keep` positions of left-padded rows that all continue prefix_ids, read
    as a prefix tree: the shared prefix, each distinct head (a row but its last `keep` positions),
    each row's tail. A group's G episodes share their first prompt and differ in the tail, so a
    head is often several rows': its keys and values are computed once and copied to each (under
    autograd their gradients add up in it). Position ids follow the mask, as when sampling."""
    device = next(model.parameters()).device
    split, shared = input_ids.shape[1] - keep, len(prefix_ids)
    attention_mask = torch.cat([torch.ones(len(input_ids), shared, dtype=torch.long),
                                attention_mask], dim=1)
    position_ids = left_padded_positions(attention_mask)[:, shared:]
    if not shared:  # one distinct row, or rows with nothing in common: the plain forward
        return model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                     position_ids=position_ids.to(device), logits_to_keep=keep).logits
    head_tokens = torch.cat([input_ids[:, :split], attention_mask[:, shared:shared + split]], 1)
    heads, head_of_row = distinct_rows([tuple(row) for row in head_tokens.tolist()])
    rows_heads = head_of_row.tolist()
    first_row = [rows_heads.index(head) for head in range(len(heads))]
    cache = prefix_cache(model, prefix_ids, len(heads))
    if split > 0:
        cache = model(input_ids=input_ids[first_row, :split].to(device),
                      attention_mask=attention_mask[first_row, :shared + split].to(device),
                      position_ids=position_ids[first_row, :split].to(device), cache=cache,
                      use_cache=True, logits_to_keep=1).cache
    cache.batch_select_indices(head_of_row.to(device))
    return model(input_ids=input_ids[:, split:].to(device), cache=cache, use_cache=True,
                 attention_mask=attention_mask.to(device), logits_to_keep=keep,
                 position_ids=position_ids[:, split:].to(device)).logits

# 4. The allocator ----------------------------------------------------------------------------
def run_under_jemalloc(argv: list[str]) -> None:
    """Rerun this command under jemalloc where the system has it (Linux: libjemalloc2), it is not
    loaded yet and --no-cpu-speedups is not given; else return. glibc's malloc keeps freed memory in
    its heap and hands fresh tensors pages it must fault in again; jemalloc reuses and returns them
    (as PyTorch's CPU tuning guides recommend). An update of 16 distinct steps peaks at 3.9 GB under
    it, 5.5 GB under glibc, and runs 1.1x faster (results/NOTES.md), with the same numbers."""
    library = ctypes.util.find_library("jemalloc")
    if (not library or sys.platform != "linux" or "--no-cpu-speedups" in argv
            or "jemalloc" in os.environ.get("LD_PRELOAD", "")):
        return
    preload = " ".join(filter(None, [library, os.environ.get("LD_PRELOAD")]))
    os.execve(sys.executable, [sys.executable, *argv], {**os.environ, "LD_PRELOAD": preload})
