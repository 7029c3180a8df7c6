"""The same seed gives the same training metrics as the recorded runs (tiny model, CPU).

tests/data/tiny_run_metrics.json holds the metrics.jsonl lines of a 3-iteration MS-GRPO run and a
3-iteration POAD run, timing fields left out. Any change meant to keep behaviour (moving code,
renaming, compacting, speed-ups that keep the numbers) must leave them as they are. The random tiny
model never names a move, so every return would be equal and no update would run; here its logits
are nudged toward the four move words, so about half its replies are moves, returns differ within
groups, and both runs train (episodes_trained > 0, loss != 0). Re-record only for a change that is
meant to alter training: PYTHONPATH=. python tests/test_same_metrics.py --record
"""

import contextlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

import baselines
import envs
import msgrpo

FIXTURE = Path(__file__).resolve().parent / "data" / "tiny_run_metrics.json"
RUN = ["--env", "frozen_lake", "--model", "tiny", "--groups", "2", "--group-size", "4",
       "--iterations", "3", "--env-opt", "max_steps=4", "--eval-episodes", "0",
       "--probe-every", "1", "--seed", "0", "--training-start", "beside_hole"]
TIMING = {"seconds", "rollout_seconds", "update_seconds", "train_tokens_per_second"}
# added to the logits of "left", "down", "right", "up" (with and without a space)
MOVE_LOGIT_BIAS = 9.0


@contextlib.contextmanager
def tiny_model_that_names_moves():
    """msgrpo.load_policy, with a forward hook on the output layer that adds MOVE_LOGIT_BIAS to the
    move words' logits: sampling and the loss's log-probs both see the same nudged model."""
    load_policy = msgrpo.load_policy

    def load_nudged(cfg, adapter=None):
        model, tokenizer = load_policy(cfg, adapter)
        words = [f"{space}{move}" for move in envs.FROZEN_LAKE_ACTIONS for space in ("", " ")]
        bias = torch.zeros(model.get_output_embeddings().weight.shape[0])
        bias[[tokenizer(word, add_special_tokens=False).input_ids[0]
              for word in words]] = MOVE_LOGIT_BIAS
        model.get_output_embeddings().register_forward_hook(
            lambda layer, inputs, logits: logits + bias)
        return model, tokenizer

    msgrpo.load_policy = load_nudged
    try:
        yield
    finally:
        msgrpo.load_policy = load_policy


def train_msgrpo(run_dir):
    return msgrpo.main(RUN + ["--run-dir", str(run_dir)])


def train_poad(run_dir):
    return baselines.main(["poad"] + RUN + ["--run-dir", str(run_dir)])


def metrics_of(run_dir) -> list[dict]:
    return [{k: v for k, v in m.items() if k not in TIMING} for m in msgrpo.read_metrics(run_dir)]


def tiny_run_metrics(folder: Path) -> dict:
    # One thread: a matmul's sum order, and so its last bits, can depend on the thread count.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tiny_model_that_names_moves():
            return {"msgrpo": metrics_of(train_msgrpo(folder / "msgrpo")),
                    "poad": metrics_of(train_poad(folder / "poad"))}
    finally:
        torch.set_num_threads(threads)


def assert_same(got, want, where=""):
    if isinstance(want, dict):
        assert list(got) == list(want), where  # the same keys, in the same order
        for key in want:
            assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert isinstance(got, (int, float)), where
        assert ((math.isnan(got) and math.isnan(want))
                or math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-6)), \
            f"{where}: {got} != {want}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the recorded numbers are the CPU's")
def test_the_same_seed_gives_the_recorded_msgrpo_and_poad_metrics(tmp_path):
    recorded = json.loads(FIXTURE.read_text())
    # the guard sees the update only if the recorded runs train
    for algorithm in ("msgrpo", "poad"):
        assert any(m["episodes_trained"] > 0 and m["loss"] != 0
                   for m in recorded[algorithm]), algorithm
    assert_same(tiny_run_metrics(tmp_path), recorded)


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        FIXTURE.write_text(json.dumps(tiny_run_metrics(Path(folder)), indent=1) + "\n")
    print(f"wrote {FIXTURE}")
