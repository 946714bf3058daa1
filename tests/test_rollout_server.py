"""Server lifecycle (rollout/server.py) against a real subprocess HTTP server on 127.0.0.1.

The server here is a tiny stand-in written below, NOT SGLang: it exercises only the lifecycle
(start, /health wait, requests, retries, death detection with log tail, restart, shutdown)."""

from __future__ import annotations

import sys
import time

import pytest

from megatron_opd.rollout.server import ServerError, ServerProcess, http_json

FAKE_SERVER = r'''
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

port, delay, mode = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
print(f"fake server starting pid={os.getpid()} mode={mode}", flush=True)
if mode == "fail":
    print("FATAL: pretend CUDA out of memory while loading weights", flush=True)
    sys.exit(3)
time.sleep(delay)

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _send(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.path == "/health":
            self._send(200, {"ok": True})
        else:
            self._send(404, {"error": "no such path " + self.path})
    def do_POST(self):
        n = int(self.headers.get("Content-Length", 0))
        req = json.loads(self.rfile.read(n) or b"{}")
        if self.path == "/echo":
            self._send(200, {"echo": req, "pid": os.getpid()})
        elif self.path == "/crash":
            print("FATAL: scheduler crashed: pretend NCCL error", flush=True)
            os._exit(7)
        elif self.path == "/bad":
            self._send(400, {"error": "bad request: field input_ids missing"})
        else:
            self._send(404, {"error": "no such path " + self.path})

HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "fake_server.py"
    p.write_text(FAKE_SERVER)
    return p


def make(script, tmp_path, mode="ok", delay=0.5, **kw):
    from _dist import free_port

    port = free_port()
    return ServerProcess([sys.executable, script, port, delay, mode], port=port, log_path=tmp_path / "srv.log",
                         **kw)


def test_start_request_shutdown(script, tmp_path):
    srv = make(script, tmp_path, startup_timeout=30)
    with srv:
        assert srv.url.startswith("http://127.0.0.1:")
        assert srv.healthy()
        out = srv.request("/echo", {"x": [1, 2]})
        assert out["echo"] == {"x": [1, 2]} and out["pid"] == srv.proc.pid
        with pytest.raises(ServerError, match="HTTP 400: .*input_ids missing"):
            srv.request("/bad", {})
    assert not srv.is_alive() and srv.proc.returncode is not None
    with pytest.raises(OSError):
        http_json(srv.url + "/health", timeout=2)


def test_startup_failure_reports_log_tail(script, tmp_path):
    srv = make(script, tmp_path, mode="fail", startup_timeout=30)
    with pytest.raises(ServerError, match="exited during start-up \\(exit code 3\\)") as e:
        srv.start()
    assert "FATAL: pretend CUDA out of memory" in str(e.value)


def test_startup_timeout_kills_server(script, tmp_path):
    srv = make(script, tmp_path, delay=60, startup_timeout=1.5)
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="not healthy after 2s"):
        srv.start()
    assert time.monotonic() - t0 < 20
    assert not srv.is_alive()


def test_dead_server_detected_with_log(script, tmp_path):
    srv = make(script, tmp_path, startup_timeout=30, retries=1)
    with srv:
        with pytest.raises(ServerError):
            srv.request("/crash", {}, timeout=5)
        srv.proc.wait(timeout=10)
        with pytest.raises(ServerError, match="died \\(exit code 7\\)") as e:
            srv.request("/echo", {"x": 1})
        assert "pretend NCCL error" in str(e.value)


def test_dead_server_restarted_when_allowed(script, tmp_path):
    srv = make(script, tmp_path, startup_timeout=30, retries=1, max_restarts=1)
    with srv:
        pid0 = srv.proc.pid
        with pytest.raises(ServerError):
            srv.request("/crash", {}, timeout=5, retries=0)
        srv.proc.wait(timeout=10)
        out = srv.request("/echo", {"x": 2})
        assert out["pid"] != pid0 and srv.restarts == 1
