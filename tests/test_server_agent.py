"""The chat-server agent against servers that misbehave, and its flags.

A server that sends a byte now and then, never enough for the per-read timeout to fire, is cut at
the deadline; a reply nested too deeply to decode, or one that never ends, is malformed content:
each is counted as an invalid action and the evaluation goes on. A --base-url that is no server
address is refused before anything is played."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest

import baselines
import envs

REPLY = json.dumps({"choices": [{"index": 0,
                                 "message": {"role": "assistant", "content": "right"}}]}).encode()


class Trickling(BaseHTTPRequestHandler):
    """POST /<where>/v1/chat/completions sends a correct reply one byte every 0.1 s: its headers
    (where = headers) or only its body (where = body). A full reply would take about half a
    minute."""

    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        head = (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(REPLY)}\r\n\r\n").encode()
        slow, fast = (head + REPLY, b"") if self.path.startswith("/headers/") else (REPLY, head)
        try:
            self.wfile.write(fast)
            for byte in slow:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.1)
        except OSError:
            pass  # the client hung up

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def trickling_server(serve):
    return serve(Trickling)


def within(seconds, work):
    """Run `work` in a thread; its result, or a failure if it is still running after `seconds`."""
    result = []
    worker = threading.Thread(target=lambda: result.append(work()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still waiting for the server after {seconds} s"
    return result[0]


@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_trickling_server_is_cut_at_the_deadline_and_counted_invalid(trickling_server, where):
    agent = baselines.ChatServerAgent(f"{trickling_server}/{where}/v1", "m", timeout=5, retries=2,
                                      backoff=0.0, deadline=1.0)
    result = within(60, lambda: envs.evaluate(agent, "frozen_lake", envs.heldout_seeds(2),
                                              map="classic", max_steps=1))
    assert result["episodes"] == 2 and result["invalid_rate"] == 1.0
    assert agent.requests == 2 and agent.failures == 2
    assert dict(agent.errors) == {"TimeoutError": 2}  # the deadline covers the retries too


def test_the_terminal_summary_counts_failed_requests(trickling_server, capsys):
    within(60, lambda: baselines.main(["--agent", "server",
                                       "--base-url", f"{trickling_server}/body/v1", "--model", "m",
                                       "--episodes", "1", "--map", "classic", "--max-steps", "1",
                                       "--deadline", "1", "--retries", "0"]))
    out = capsys.readouterr().out
    assert "server requests: 1 of 1 failed" in out and "TimeoutError 1" in out


@pytest.mark.parametrize("flag, value", [("--concurrency", "0"), ("--timeout", "0"),
                                         ("--deadline", "-1"), ("--retries", "-1"),
                                         ("--backoff", "nan")])
def test_bad_server_flags_are_rejected(flag, value, capsys):
    with pytest.raises(SystemExit) as stop:
        baselines.main(["--agent", "server", "--base-url", "http://127.0.0.1:9/v1", "--model", "m",
                        flag, value])
    assert stop.value.code != 0 and flag in capsys.readouterr().err


class Misbehaving(BaseHTTPRequestHandler):
    """POST /nested/...: 200 with a body of 200,000 "[". POST /endless/...: 200 with a body that
    never ends (64 KB a millisecond, until the client hangs up)."""

    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        nested = self.path.startswith("/nested/")
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length" if nested else "Connection",
                         "200000" if nested else "close")
        self.end_headers()
        try:
            if nested:
                self.wfile.write(b"[" * 200_000)
                return
            while True:
                self.wfile.write(b" " * 65536)
                time.sleep(0.001)
        except OSError:
            pass  # the client hung up

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def misbehaving_server(serve):
    return serve(Misbehaving)


def test_a_reply_nested_too_deeply_is_invalid_and_the_evaluation_goes_on(misbehaving_server,
                                                                         tmp_path):
    out = tmp_path / "result.json"
    result = within(60, lambda: baselines.main([
        "--agent", "server", "--base-url", f"{misbehaving_server}/nested/v1", "--model", "m",
        "--episodes", "2", "--map", "classic", "--max-steps", "2", "--retries", "1",
        "--backoff", "0", "--json", str(out)]))
    assert result["invalid_rate"] == 1.0 and result["failed_requests"] == result["episodes"] * 2
    assert result["request_errors"] == {"ValueError": 8}  # 4 requests, each tried twice
    assert json.loads(out.read_text()) == result


def test_an_endless_reply_is_cut_at_the_size_cap_and_counted_invalid(misbehaving_server):
    agent = baselines.ChatServerAgent(f"{misbehaving_server}/endless/v1", "m", retries=0,
                                      deadline=3.0)
    result = within(60, lambda: envs.evaluate(agent, "frozen_lake", envs.heldout_seeds(2),
                                              map="classic", max_steps=1))
    assert result["invalid_rate"] == 1.0 and agent.failures == 2
    assert dict(agent.errors) == {"ReplyTooLong": 2}  # cut at 1 MiB, not at the deadline


@pytest.mark.parametrize("base_url, problem", [
    ("localhost:8000/v1", "http:// or https://"),
    ("htp://localhost:8000/v1", "http:// or https://"),
    ("http://:8000/v1", "no host"), ("http://localhost:99999/v1", "port"),
    ("http://localhost:0/v1", "port"), ("https://localhost:port/v1", "port")])
def test_a_base_url_that_is_no_server_address_is_refused_in_one_line(base_url, problem):
    argv = ["--agent", "server", "--base-url", base_url, "--model", "m", "--episodes", "1",
            "--map", "classic", "--max-steps", "1", "--retries", "0"]
    with pytest.raises(SystemExit) as stop:
        baselines.main(argv)
    message = str(stop.value.code)
    assert "--base-url" in message and problem in message and "\n" not in message
    with pytest.raises(ValueError, match=problem):
        baselines.ChatServerAgent(base_url, "m")


def test_a_good_base_url_is_taken_with_or_without_a_port():
    for base_url in ("http://localhost:8000/v1", "https://api.example.com/v1",
                     "http://[::1]:80/v1"):
        assert baselines.url_problem(base_url) == ""


class Counting(BaseHTTPRequestHandler):
    """Answers every request with the move right, and counts the requests."""

    protocol_version = "HTTP/1.1"
    requests = 0

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        Counting.requests += 1
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(REPLY)))
        self.end_headers()
        self.wfile.write(REPLY)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def counting_server(serve):
    return serve(Counting)


@pytest.mark.parametrize("flag, value, cap", [
    ("--deadline", "1e10", "1000000"), ("--timeout", "1e7", "1000000"),
    ("--backoff", "1e300", "1000000"),
    ("--retries", "5000000", "1000"), ("--concurrency", "100000", "1024")])
def test_server_flags_beyond_their_caps_are_refused_before_any_request(counting_server, flag,
                                                                       value, cap, capsys):
    """A deadline of 1e10 s overflows the watchdog's timer, and retries in the millions make
    the doubling wait too large a number."""
    Counting.requests = 0
    with pytest.raises(SystemExit) as stop:
        baselines.main(["--agent", "server", "--base-url", f"{counting_server}/v1", "--model", "m",
                        "--episodes", "1", "--map", "classic", "--max-steps", "1", flag, value])
    assert stop.value.code != 0
    error = capsys.readouterr().err
    assert flag in error and f"at most {cap}" in error
    assert Counting.requests == 0
    setting = flag.removeprefix("--")
    with pytest.raises(ValueError, match=f"{setting} must be .*at most {cap}"):
        baselines.ChatServerAgent(f"{counting_server}/v1", "m", **{setting: float(value)})
