"""The API key of a server we start is in neither its command line (`ps`) nor its log, nor in the log
tail an error message carries (rollout/keyed_launch.py, ServerProcess(pass_key=True)). The server here
is the SGLang stand-in, which prints its arguments the way SGLang logs its ServerArgs and has a worker
process print the key on stdout and stderr; the same checks run against real SGLang in the `sglang`
leg (tests/test_sglang_real.py)."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import pytest

from _proc import explain
from _dist import free_port, session_cmdlines
from megatron_opd.rollout.server import ServerError, ServerProcess, http_json

ROOT = Path(__file__).resolve().parents[1]
STANDIN = Path(__file__).resolve().parent / "sglang_standin.py"


def test_the_key_is_in_no_command_line_and_no_log(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    key = secrets.token_hex(24)
    port = free_port()
    log = tmp_path / "server.log"
    srv = ServerProcess([sys.executable, str(STANDIN), "--port", str(port), "--log", str(tmp_path / "calls.jsonl"),
                         "--echo-worker"], port=port, log_path=log, api_key=key, pass_key=True)
    with srv:
        assert http_json(srv.url + "/get_server_info", api_key=key)["tp_size"] == 1
        with pytest.raises(ServerError, match="HTTP 401"):  # the server did get the key
            http_json(srv.url + "/get_server_info")
        lines = session_cmdlines(srv.proc.pid)
        assert lines and all(key not in c for c in lines.values()), lines
        assert any("megatron_opd.rollout.keyed_launch" in c for c in lines.values())
    text = log.read_text()
    assert key not in text
    # what would have leaked: the ServerArgs line and the worker's stdout and stderr, each redacted
    assert "api_key='<redacted>'" in text and "worker api_key=<redacted>" in text and "to stderr: <redacted>" in text


def test_a_dead_servers_error_carries_a_redacted_log_tail(tmp_path):
    key = secrets.token_hex(24)
    script = tmp_path / "dies.py"
    script.write_text("import sys\nprint('starting with', sys.argv[1:], flush=True)\nsys.exit(3)\n")
    srv = ServerProcess([sys.executable, str(script)], port=free_port(), log_path=tmp_path / "s.log",
                        api_key=key, pass_key=True, startup_timeout=30)
    with pytest.raises(ServerError, match="exit code 3") as e:
        srv.start()
    assert key not in str(e.value) and "'--api-key', '<redacted>'" in str(e.value)
    # a tail read from a log the launcher did not write (a server started by hand) is redacted too
    (tmp_path / "s.log").write_text(f"ServerArgs(api_key='{key}')\n")
    assert key not in srv.last_log() and "<redacted>" in srv.last_log()


def test_without_the_key_in_the_environment_the_launcher_refuses(tmp_path):
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_OPD_SGLANG_API_KEY"}
    env["PYTHONPATH"] = str(ROOT)
    res = subprocess.run([sys.executable, "-m", "megatron_opd.rollout.keyed_launch", str(STANDIN)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "MEGATRON_OPD_SGLANG_API_KEY is empty" in res.stderr, explain(res)
