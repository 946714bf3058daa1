"""Start a server with an API key that appears in neither its command line nor its output.

    python -m megatron_opd.rollout.keyed_launch [--key-env VAR] -m sglang.launch_server ARGS...
    python -m megatron_opd.rollout.keyed_launch [--key-env VAR] SCRIPT.py ARGS...

SGLang takes its key as `--api-key KEY` and logs its ServerArgs, key included, at INFO. Here the key
comes from the environment variable VAR (default MEGATRON_OPD_SGLANG_API_KEY; removed from this
process's environment once read), is appended to the target's `sys.argv` inside this process (so
/proc/PID/cmdline and `ps` show the command without it), and every line written to this process's
stdout and stderr -- and to those of the workers it starts, which inherit them -- passes through a
filter that replaces the key by `<redacted>` before it reaches the log.
"""

from __future__ import annotations

import atexit
import os
import re
import runpy
import sys
import threading

KEY_ENV = "MEGATRON_OPD_SGLANG_API_KEY"
REDACTED = b"<redacted>"
_LINE = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)")


def redact_output(secret: str) -> threading.Thread:
    """Route file descriptors 1 and 2 (this process's and its future children's) through a pipe whose
    reader writes each line, `secret` replaced, to the original stdout."""
    key = secret.encode()
    out = os.dup(1)
    r, w = os.pipe()
    os.dup2(w, 1)
    os.dup2(w, 2)
    os.close(w)

    def pump() -> None:
        buf = b""
        while True:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            buf += chunk
            end = 0
            for m in _LINE.finditer(buf):
                end = m.end()
            if end:  # whole lines only: a key is never split between two writes
                os.write(out, buf[:end].replace(key, REDACTED))
                buf = buf[end:]
            elif len(buf) > 1 << 20:  # a megabyte without a line break: let it through, key still redacted
                keep = len(key) - 1
                os.write(out, buf[:-keep].replace(key, REDACTED))
                buf = buf[-keep:]
        if buf:
            os.write(out, buf.replace(key, REDACTED))

    thread = threading.Thread(target=pump, name="redact-output", daemon=True)
    thread.start()

    def drain() -> None:  # at exit: close our write ends and let the reader finish what is buffered
        sys.stdout.flush()
        sys.stderr.flush()
        os.close(1)
        os.close(2)
        thread.join(timeout=5)

    atexit.register(drain)
    return thread


def main(argv: list[str]) -> None:
    key_env = KEY_ENV
    if argv[:1] == ["--key-env"]:
        key_env, argv = argv[1], argv[2:]
    if not argv or argv[0] == "-m" and len(argv) < 2:
        raise SystemExit("usage: python -m megatron_opd.rollout.keyed_launch [--key-env VAR] "
                         "(-m MODULE | SCRIPT) ARGS...")
    key = os.environ.pop(key_env, "")
    if not key:
        raise SystemExit(f"keyed_launch: ${key_env} is empty: no API key to start the server with")
    redact_output(key)
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:], "--api-key", key]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = [argv[0], *argv[1:], "--api-key", key]
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as `python SCRIPT` would
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
