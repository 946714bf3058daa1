"""Lifecycle of an HTTP inference server subprocess (SGLang's `launch_server`, or any server with /health).

Why: a rollout or teacher server that dies (OOM, CUDA error) must surface as one clear error carrying
its last log lines, not as a hung trainer or an opaque ConnectionRefused. The server binds 127.0.0.1
by default (it accepts weight-update requests, so it must not be reachable from outside by accident).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_opd.rollout.keyed_launch import KEY_ENV


class ServerError(RuntimeError):
    """The server failed to start, died, or did not answer in time."""


def api_key_from_env(var: Optional[str]) -> Optional[str]:
    """The API key held by environment variable `var` ("" / None / unset / empty: no key). Keys live in the
    environment, never in a config file: the trainer writes its config next to its checkpoints."""
    return (os.environ.get(var) or None) if var else None


def redact(argv: Sequence[str]) -> list[str]:
    """argv with the value after `--api-key` (or of `--api-key=...`) replaced, for logs and error messages."""
    out, hide = [], False
    for a in map(str, argv):
        if hide:
            out.append("<redacted>")
            hide = False
        elif a == "--api-key":
            out.append(a)
            hide = True
        elif a.startswith("--api-key="):
            out.append("--api-key=<redacted>")
        else:
            out.append(a)
    return out


def http_json(url: str, payload: Optional[dict] = None, timeout: float = 60.0, method: Optional[str] = None,
              api_key: Optional[str] = None) -> Any:
    """GET (payload None) or POST JSON; returns the decoded JSON body (or the text if not JSON).
    HTTP error statuses raise ServerError with the body, which is where servers put the reason
    (`.status` holds the code). `api_key` is sent as `Authorization: Bearer <key>` (SGLang's --api-key)."""
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, method=method or ("GET" if data is None else "POST"),
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read().decode()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:2000]
        hint = ""
        if e.code in (401, 403):
            hint = (" (the server wants an API key: export the one it was started with --api-key in the variable "
                    "named by rollout.api_key_env / teacher.api_key_env, default SGLANG_API_KEY)" if not api_key
                    else " (the API key sent was refused: is it the server's --api-key?)")
        err = ServerError(f"{url}: HTTP {e.code}: {detail}{hint}")
        err.status = e.code
        raise err from None
    try:
        return json.loads(body) if body else None
    except json.JSONDecodeError:
        return body


def http_json_retry(url: str, payload: Optional[dict] = None, timeout: float = 60.0, retries: int = 4,
                    backoff: float = 0.5, max_backoff: float = 30.0, api_key: Optional[str] = None,
                    what: str = "server") -> Any:
    """http_json for a server given by URL (nothing to watch but the network): connection errors and
    HTTP 5xx are retried `retries` times with exponential backoff (backoff * 2**attempt, capped); a
    timeout and other HTTP errors (4xx: a bad request or a missing key) raise at once. After the last attempt:
    ServerError naming the URL, the attempt count and the last error. Use only for idempotent requests."""
    last: Optional[BaseException] = None
    for attempt in range(retries + 1):
        try:
            return http_json(url, payload, timeout=timeout, api_key=api_key)
        except ServerError as e:
            if getattr(e, "status", 0) < 500:
                raise
            last = e
        except (OSError, urllib.error.URLError) as e:  # refused / reset / DNS / timeout
            if isinstance(getattr(e, "reason", e), TimeoutError):
                # not retried: the server may still be working on it (a resent prefill doubles its load),
                # and `retries` x `timeout` would stall a run for an hour before it hears of a dead server
                raise ServerError(f"{what} {url}: no answer within {timeout:g} s (not retried)") from e
            last = e
        if attempt < retries:
            time.sleep(min(backoff * 2 ** attempt, max_backoff))
    raise ServerError(f"{what} {url}: no successful answer after {retries + 1} attempt(s) "
                      f"(exponential backoff from {backoff}s); last error: {last}")


def _tail(path: Path, n: int) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=n))
    except OSError as e:
        return f"<log unavailable: {e}>"


class ServerProcess:
    """One server subprocess: start + health wait, liveness checks, requests with retries, shutdown.

    `cmd` is the full argv. The process runs in its own session so shutdown reaches the workers it
    spawns (SGLang forks scheduler/detokenizer processes) and only those. stdout+stderr go to `log_path`.
    `max_restarts` > 0 restarts a dead server on the next request instead of raising.

    `api_key` is sent with every request. With `pass_key` the server is also started with it, out of
    sight: `cmd` (a python command, `[python, -m, module, ...]` or `[python, script, ...]`) runs through
    `rollout/keyed_launch.py`, which takes the key from the environment, gives it to the server as
    `--api-key` inside the process, and redacts it from everything the server and its workers print.
    Log tails in error messages are redacted too.
    """

    def __init__(self, cmd: Sequence[str], host: str = "127.0.0.1", port: int = 30000, health_path: str = "/health",
                 startup_timeout: float = 600.0, request_timeout: float = 600.0, retries: int = 2,
                 log_path: Optional[str | Path] = None, env: Optional[dict[str, str]] = None, max_restarts: int = 0,
                 log_tail_lines: int = 40, api_key: Optional[str] = None, pass_key: bool = False):
        self.cmd = [str(c) for c in cmd]
        self.api_key = api_key  # sent with every request (the server was started with --api-key)
        if pass_key:
            if not api_key:
                raise ValueError("ServerProcess: pass_key without an api_key")
            self.cmd = [self.cmd[0], "-m", "megatron_opd.rollout.keyed_launch", *self.cmd[1:]]
            env = {**(env or {}), KEY_ENV: api_key}
        self.host, self.port = host, port
        self.health_path = health_path
        self.startup_timeout = startup_timeout
        self.request_timeout = request_timeout
        self.retries = retries
        self.max_restarts = max_restarts
        self.restarts = 0
        self.log_tail_lines = log_tail_lines
        self.env = {**os.environ, **(env or {})}
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="server_", suffix=".log")[1])
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "ServerProcess":
        if self.proc is not None and self.proc.poll() is None:
            raise ServerError(f"server at {self.url} already running (pid {self.proc.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        finally:
            log.close()
        self.wait_healthy(self.startup_timeout)
        return self

    def last_log(self, n: Optional[int] = None) -> str:
        tail = _tail(self.log_path, n or self.log_tail_lines)
        return tail.replace(self.api_key, "<redacted>") if self.api_key else tail

    def _died(self, what: str) -> ServerError:
        rc = self.proc.returncode if self.proc is not None else None
        return ServerError(f"server {self.url} {what} (exit code {rc}); command: {' '.join(redact(self.cmd))}\n"
                           f"--- last log lines ({self.log_path}) ---\n{self.last_log()}")

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            http_json(self.url + self.health_path, timeout=timeout, api_key=self.api_key)
            return True
        except (ServerError, OSError):
            return False

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        delay = 0.1
        while True:
            if not self.is_alive():
                raise self._died("exited during start-up")
            if self.healthy():
                return
            if time.monotonic() > deadline:
                self.shutdown()
                raise ServerError(f"server {self.url} not healthy after {timeout:.0f}s; killed it.\n"
                                  f"--- last log lines ({self.log_path}) ---\n{self.last_log()}")
            time.sleep(delay)
            delay = min(delay * 1.5, 2.0)

    def ensure_alive(self) -> None:
        """Raise (or restart, within max_restarts) if the process has exited."""
        if self.is_alive():
            return
        if self.proc is None:
            raise ServerError(f"server {self.url} was never started")
        if self.restarts < self.max_restarts:
            err = self._died("died")
            self.restarts += 1
            print(f"[server] restarting ({self.restarts}/{self.max_restarts}) after: {err}", file=sys.stderr)
            self.start()
            return
        raise self._died("died")

    def request(self, path: str, payload: Optional[dict] = None, timeout: Optional[float] = None,
                retries: Optional[int] = None) -> Any:
        """POST (or GET) `path`; connection failures are retried with backoff while the process lives
        (pass retries=0 for requests that must not run twice). A dead server raises ServerError with
        its log tail (or is restarted first, within max_restarts)."""
        last: Optional[BaseException] = None
        retries = self.retries if retries is None else retries
        for attempt in range(retries + 1):
            self.ensure_alive()
            try:
                return http_json(self.url + path, payload, timeout=timeout or self.request_timeout,
                                 api_key=self.api_key)
            except ServerError:
                raise
            except (OSError, urllib.error.URLError) as e:  # refused / reset / timeout
                last = e
                time.sleep(min(0.5 * 2 ** attempt, 5.0))
        if not self.is_alive():
            raise self._died(f"died while serving {path}")
        raise ServerError(f"server {self.url}{path}: no answer after {retries + 1} attempt(s): {last}")

    def shutdown(self, timeout: float = 30.0) -> None:
        """SIGTERM the server's process group, then SIGKILL what is left after `timeout`."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                return
            try:
                p.wait(timeout=wait)
                try:  # the group may outlive its leader (forked workers)
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> "ServerProcess":
        return self.start() if not self.is_alive() else self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def sglang_cli_args(args: Optional[dict[str, Any]]) -> list[str]:
    """SGLang ServerArgs as `launch_server` flags: {tp_size: 2, disable_cuda_graph: true} ->
    ["--tp-size", "2", "--disable-cuda-graph"] (false / None: left out; lists: repeated values)."""
    out: list[str] = []
    for k, v in (args or {}).items():
        flag = "--" + str(k).replace("_", "-")
        if v is None or v is False:
            continue
        if v is True:
            out.append(flag)
        elif isinstance(v, (list, tuple)):
            out += [flag, *map(str, v)]
        elif isinstance(v, dict):
            out += [flag, json.dumps(v)]
        else:
            out += [flag, str(v)]
    return out


def sglang_server_cmd(model_path: str | Path, host: str = "127.0.0.1", port: int = 30000,
                      extra_args: Sequence[str] = (), python: str = sys.executable) -> list[str]:
    """argv for `python -m sglang.launch_server` serving `model_path` on host:port (token ids in/out)."""
    return [python, "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", host,
            "--port", str(port), "--skip-tokenizer-init", *extra_args]


__all__ = ["ServerError", "ServerProcess", "api_key_from_env", "http_json", "http_json_retry", "redact",
           "sglang_cli_args", "sglang_server_cmd"]
