"""Zero-shot language-model agents (local and behind a chat server) and the comparison table
(benchmarks/compare.py).

The chat-server agent is tested against a real OpenAI-compatible server (`transformers serve` on
the bundled SmolLM2) for a full evaluation, and against a small local HTTP server that misbehaves
on purpose (slow, errors, malformed replies) for the failure cases.
"""

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import torch

import baselines
import envs
import msgrpo
import support

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import compare  # noqa: E402

# --- local models --------------------------------------------------------------------------------


def test_local_agent_plays_a_full_evaluation_deterministically():
    agent = baselines.LLMAgent("tiny")
    seeds = envs.heldout_seeds(3)
    first = envs.evaluate(agent, "frozen_lake", seeds, max_steps=3)
    assert first["episodes"] == 3
    assert envs.evaluate(agent, "frozen_lake", seeds, max_steps=3) == first  # greedy
    obs, info = envs.make("frozen_lake").reset(seed=0)
    assert agent.act(obs, info).startswith(msgrpo.response_prefix(agent.cfg))


@pytest.fixture(scope="module")
def tiny_adapter(tmp_path_factory):
    """A trained-looking run folder: adapter/ with nonzero LoRA weights, and config.json."""
    run = tmp_path_factory.mktemp("run")
    cfg = msgrpo.resolve_defaults(msgrpo.Config(model="tiny", quantize=False, run_dir=str(run)))
    model, _ = msgrpo.load_policy(cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(run / "adapter")
    config = {**dataclasses.asdict(cfg), "max_new_tokens": 5, "a_key_from_a_newer_msgrpo": 1}
    (run / "config.json").write_text(json.dumps(config))
    return run / "adapter", {n: p.detach().clone() for n, p in model.named_parameters()
                             if "lora_B" in n}


def test_local_agent_plays_an_adapter_with_its_training_settings(tiny_adapter):
    path, saved = tiny_adapter
    agent = baselines.LLMAgent(adapter=path)
    assert (agent.cfg.model == "tiny" and agent.cfg.max_new_tokens == 5
            and agent.cfg.quantize is False)
    loaded = {n: p for n, p in agent.lap.model.named_parameters() if "lora_B" in n}
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[n], saved[n]) for n in saved)
    result = envs.evaluate(agent, "frozen_lake", envs.heldout_seeds(2), max_steps=2)
    assert result["episodes"] == 2


@pytest.mark.parametrize("damage, named", [("truncated", "is unreadable: SafetensorError"),
                                           ("another model", "does not fit")])
def test_an_adapter_that_does_not_load_stops_with_one_line(tiny_adapter, tmp_path, damage, named):
    from safetensors.torch import load_file, save_file

    run = tmp_path / "run"
    shutil.copytree(Path(tiny_adapter[0]).parent, run)
    weights = run / "adapter" / "adapter_model.safetensors"
    if damage == "truncated":  # a copy cut short
        weights.write_bytes(weights.read_bytes()[:1000])
    else:  # LoRA matrices shaped for a model of half the width
        save_file({name: w[:, :32].contiguous() if "lora_A" in name else w
                   for name, w in load_file(weights).items()}, weights)
    with pytest.raises(SystemExit) as stop:
        baselines.main(["--agent", "llm", "--adapter", str(run / "adapter"), "--episodes", "1"])
    message = str(stop.value.code)
    assert named in message and str(run / "adapter") in message and "\n" not in message


# --- chat servers: a misbehaving local HTTP server for the failure cases --------------------------


def reply(content):
    return {"id": "x", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": content}}]}


class Misbehaving(BaseHTTPRequestHandler):
    """POST /<mode>/v1/chat/completions. Modes: ok, slow, error, bad_request, garbage, no_choices,
    null_content, hang_up, flaky (every odd-numbered request fails)."""

    hits = []  # (mode, headers, body) of every request

    def do_POST(self):
        mode = self.path.split("/")[1]
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Misbehaving.hits.append((mode, dict(self.headers), body))
        if mode == "slow":
            time.sleep(1.0)
        if mode == "hang_up":
            self.close_connection = True
            return  # no status line at all
        if mode == "error" or (mode == "flaky"
                               and len([h for h in self.hits if h[0] == "flaky"]) % 2 == 1):
            return self.send(500, b'{"error": "overloaded"}')
        if mode == "bad_request":
            return self.send(400, b'{"error": "no such model"}')
        payload = {"garbage": b"<html>not json", "no_choices": json.dumps({"error": "?"}).encode(),
                   "null_content": json.dumps(reply(None)).encode()}.get(
                       mode, json.dumps(reply("right")).encode())
        self.send(200, payload)

    def send(self, status, payload):
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except OSError:
            pass  # the client gave up (timeout)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def bad_server(serve):
    return serve(Misbehaving)


def server_agent(url, mode, **options):
    return baselines.ChatServerAgent(f"{url}/{mode}/v1", "m", timeout=0.3, retries=1, backoff=0.0,
                                     **options)


@pytest.mark.parametrize("mode, error", [
    ("slow", "TimeoutError"), ("error", "HTTP 500"), ("bad_request", "RequestFailed"),
    ("garbage", "JSONDecodeError"), ("no_choices", "KeyError"), ("null_content", "TypeError"),
    ("hang_up", "RemoteDisconnected")])
def test_a_failing_server_gives_counted_invalid_actions_and_loses_no_episode(bad_server, mode,
                                                                            error):
    agent = server_agent(bad_server, mode)
    result = envs.evaluate(agent, "frozen_lake", envs.heldout_seeds(3), map="classic", max_steps=2)
    assert result["episodes"] == 3 and result["mean_steps"] == 2
    assert result["invalid_rate"] == 1.0 and result["mean_return"] == pytest.approx(2 * -0.1)
    assert agent.requests == 6 and agent.failures == 6
    tries = 6 if mode == "bad_request" else 12  # one retry each, except for a rejected request
    assert dict(agent.errors) == {error: tries}


def test_a_rejected_request_is_not_retried_and_others_are(bad_server):
    Misbehaving.hits.clear()
    server_agent(bad_server, "bad_request").act("state", {})
    server_agent(bad_server, "error").act("state", {})
    assert [mode for mode, _, _ in Misbehaving.hits] == ["bad_request", "error", "error"]


def test_retries_recover_from_a_flaky_server(bad_server):
    Misbehaving.hits.clear()
    agent = server_agent(bad_server, "flaky", concurrency=1)  # one at a time: each first try fails
    result = envs.evaluate(agent, "frozen_lake", envs.heldout_seeds(3), map="classic", max_steps=2)
    assert result["invalid_rate"] == 0.0 and agent.failures == 0


def test_request_carries_the_lap_messages_and_the_key_from_the_environment(bad_server, monkeypatch):
    obs, info = envs.make("frozen_lake").reset(seed=0)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    Misbehaving.hits.clear()
    assert server_agent(bad_server, "ok").act(obs, info) == "right"
    _, headers, body = Misbehaving.hits[-1]
    assert "Authorization" not in headers
    assert body["messages"] == msgrpo.lap_messages(obs, msgrpo.Config())
    assert body["model"] == "m" and body["temperature"] == 0.0 and body["stop"] == ["</action>"]
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    server_agent(bad_server, "ok").act(obs, info)
    assert Misbehaving.hits[-1][1]["Authorization"] == "Bearer sk-test"


# --- chat servers: a real OpenAI-compatible server ------------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def transformers_server(tmp_path_factory):
    """`transformers serve` (transformers' own OpenAI-compatible server) on the bundled SmolLM2."""
    folder, port = support.model_path("smollm2-135m"), free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    command = [str(Path(sys.executable).parent / "transformers"), "serve", folder,
               "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32"]
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                  env=os.environ.copy())
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.time() + 300
        while True:
            assert server.poll() is None, f"transformers serve exited:\n{log.read_text()}"
            assert time.time() < deadline, f"transformers serve did not come up:\n{log.read_text()}"
            try:
                urllib.request.urlopen(f"{url}/models", timeout=5).read()
                break
            except OSError:
                time.sleep(1)
        yield url, folder
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def test_a_real_openai_compatible_server_plays_a_full_frozen_lake_evaluation(transformers_server):
    url, model = transformers_server
    answers = []

    class Recording(baselines.ChatServerAgent):
        def respond(self, obs_text):
            answers.append(super().respond(obs_text))
            return answers[-1]

    agent = Recording(url, model, max_tokens=8, concurrency=4, timeout=120)
    result = envs.evaluate(agent, "frozen_lake", envs.heldout_seeds(3), map="classic", max_steps=3)
    assert result["episodes"] == 3
    assert agent.failures == 0 and agent.requests == len(answers) == round(3 * result["mean_steps"])
    assert all(isinstance(a, str) and a for a in answers)


# --- the comparison -------------------------------------------------------------------------------


def test_compare_writes_both_files_and_reports_what_it_skipped(tmp_path, tiny_adapter, capsys):
    runs, out = tmp_path / "runs", tmp_path / "results"
    baselines.main(["--env", "frozen_lake", "--agent", "dqn", "--train-steps", "200",
                    "--episodes", "1", "--runs", str(runs)])
    adapter, _ = tiny_adapter
    report = compare.main(["--episodes", "3", "--games", "frozen_lake,snake", "--runs", str(runs),
                             "--out", str(out), "--llm-model", "tiny",
                             "--adapter", f"trained={adapter}",
                             "--adapter", "ghost=/nowhere/adapter"])
    rules = set(baselines.SNAKE_RULES)
    assert set(report["results"]) == {"random", "optimal", "dqn", "tiny zero-shot", "trained",
                                      *rules}
    assert set(report["results"]["dqn"]) == {"frozen_lake"}  # no snake DQN was trained
    assert all(set(report["results"][rule]) == {"snake"}
               for rule in rules)  # they read Snake's board
    skipped = {(s["agent"], s["game"]) for s in report["skipped"]}
    assert skipped == {("dqn", "snake"), ("ghost", "all"),
                       *((rule, "frozen_lake") for rule in rules)}
    assert report["results"]["optimal"]["frozen_lake"]["fraction_of_optimum"] == 1.0
    assert report["games"]["frozen_lake"]["optimum"] == 1.0
    assert json.loads((out / "comparison.json").read_text()) == report
    table = (out / "comparison.md").read_text()
    for row in ["| random |", "| optimal |", "| dqn |", "| tiny zero-shot |", "| trained |",
                "ghost", "Skipped"]:
        assert row in table
    assert "skipped ghost" in capsys.readouterr().out


def test_compare_can_be_cut_down_to_a_few_agents(tmp_path):
    report = compare.main(["--episodes", "2", "--agents", "random,optimal", "--games",
                             "frozen_lake_slippery", "--out", str(tmp_path)])
    assert set(report["results"]) == {"random", "optimal"}
    assert report["games"]["frozen_lake_slippery"]["optimum"] == pytest.approx(0.8167, abs=1e-4)


def test_compare_again_updates_its_cells_and_keeps_the_others(tmp_path):
    """Slow rows and fast rows can come from separate commands into one table (same seeds)."""
    first = compare.main(["--episodes", "2", "--agents", "random", "--games", "frozen_lake",
                          "--out", str(tmp_path)])
    second = compare.main(["--episodes", "2", "--agents", "optimal", "--games", "frozen_lake,snake",
                           "--out", str(tmp_path)])
    assert second["results"]["random"] == first["results"]["random"]
    assert set(second["results"]["optimal"]) == {"frozen_lake", "snake"}
    assert set(second["games"]) == {"frozen_lake", "snake"}
    other_seeds = ["--episodes", "3", "--agents", "optimal", "--games", "snake",
                   "--out", str(tmp_path)]
    saved = (tmp_path / "comparison.json").read_text()
    with pytest.raises(SystemExit, match="3 result cells .* --replace"):
        compare.main(other_seeds)  # different seeds: a fresh table of 1 cell would replace 3
    assert (tmp_path / "comparison.json").read_text() == saved
    assert set(compare.main(other_seeds + ["--replace"])["results"]) == {"optimal"}


@pytest.mark.parametrize("argv, named", [(["--games", "chess"], "chess"),
                                         (["--agents", "random,alphazero"], "alphazero")])
def test_compare_rejects_an_unknown_game_or_agent_in_one_line_naming_the_valid_ones(
        argv, named, tmp_path):
    result = subprocess.run([sys.executable, str(Path(compare.__file__)), *argv,
                             "--out", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode != 0 and not list(tmp_path.iterdir())
    [line] = result.stderr.strip().splitlines()  # one line, no traceback
    assert named in line and ("snake_poison_apple" in line if named == "chess"
                              else "optimal, dqn" in line)
