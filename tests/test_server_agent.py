"""The chat-server agent's deadline: a server that sends a byte now and then, never enough for the
per-read timeout to fire, is cut at the deadline and its reply counted as an invalid action."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import baselines
import envs

REPLY = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "right"}}]}).encode()


class Trickling(BaseHTTPRequestHandler):
    """POST /<where>/v1/chat/completions sends a correct reply one byte every 0.1 s: its headers
    (where = headers) or only its body (where = body). A full reply would take about half a minute."""

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
def trickling_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Trickling)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


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
    agent = baselines.ChatServerAgent(f"{trickling_server}/{where}/v1", "m", timeout=5, retries=2, backoff=0.0,
                                      deadline=1.0)
    result = within(60, lambda: envs.evaluate(agent, "frozen_lake", envs.heldout_seeds(2), map="classic",
                                              max_steps=1))
    assert result["episodes"] == 2 and result["invalid_rate"] == 1.0
    assert agent.requests == 2 and agent.failures == 2
    assert dict(agent.errors) == {"TimeoutError": 2}  # the deadline covers the retries too


def test_the_terminal_summary_counts_failed_requests(trickling_server, capsys):
    within(60, lambda: baselines.main(["--agent", "server", "--base-url", f"{trickling_server}/body/v1", "--model", "m",
                                       "--episodes", "1", "--map", "classic", "--max-steps", "1", "--deadline", "1",
                                       "--retries", "0"]))
    out = capsys.readouterr().out
    assert "server requests: 1 of 1 failed" in out and "TimeoutError 1" in out


@pytest.mark.parametrize("flag, value", [("--concurrency", "0"), ("--timeout", "0"), ("--deadline", "-1"),
                                         ("--retries", "-1"), ("--backoff", "nan")])
def test_bad_server_flags_are_rejected(flag, value, capsys):
    with pytest.raises(SystemExit) as stop:
        baselines.main(["--agent", "server", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", flag, value])
    assert stop.value.code != 0 and flag in capsys.readouterr().err
