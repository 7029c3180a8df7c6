"""Fixtures more than one test file uses."""

import threading
from http.server import ThreadingHTTPServer

import pytest


@pytest.fixture(scope="module")
def serve():
    """serve(Handler) -> the base URL of a local HTTP server answering with Handler, in a thread of
    its own; every server started is shut down when the module's tests are done."""
    servers = []

    def start(handler):
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
