"""SGLang backend: output parsing/contract checks, the HTTP client path against a stand-in server
(NOT SGLang: a stdlib script answering /generate in SGLang's output format). Real SGLang runs in
tests/test_sglang_engine_real.py and its siblings (marker `sglang`; `make test-sglang`)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from megatron_opd.rollout.base import SamplingParams, assert_fresh
from megatron_opd.rollout.server import ServerProcess
from megatron_opd.rollout.sglang_engine import SGLangEngine, SGLangOutputError, parse_sglang_output

SP = SamplingParams(max_new_tokens=4)


def out(ids, reason, lps=None):
    lps = [-0.5] * len(ids) if lps is None else lps
    return {"output_ids": ids, "meta_info": {"finish_reason": {"type": reason},
                                             "output_token_logprobs": [[x, t, None] for x, t in zip(lps, ids)]}}


def test_parse_contract():
    s = parse_sglang_output(out([5, 6, 2], "stop"), 3, [1, 2], SP, {2}, version=7)
    assert (s.prompt_index, s.response_ids, s.finish_reason, s.weight_version) == (3, [5, 6, 2], "stop", 7)
    assert s.logprobs == [-0.5] * 3 and not s.truncated
    assert parse_sglang_output(out([5, 6, 7, 8], "length"), 0, [1], SP, {2}, 0).truncated
    with pytest.raises(SGLangOutputError, match="not a stop id"):
        parse_sglang_output(out([5, 6], "stop"), 0, [1], SP, {2}, 0)
    with pytest.raises(SGLangOutputError, match="3 tokens != max_new_tokens 4"):
        parse_sglang_output(out([5, 6, 7], "length"), 0, [1], SP, {2}, 0)
    with pytest.raises(SGLangOutputError, match="abort"):
        parse_sglang_output(out([5], "abort"), 0, [1], SP, {2}, 0)
    bad = out([5, 6, 2], "stop")
    bad["meta_info"]["output_token_logprobs"].pop()
    with pytest.raises(SGLangOutputError, match="2 log-probs for 3 tokens"):
        parse_sglang_output(bad, 0, [1], SP, {2}, 0)


def test_parse_eos_at_the_budget_is_not_truncated():
    """SGLang says finish_reason=length when EOS is the budget's last token: complete, as in LocalEngine."""
    s = parse_sglang_output(out([5, 6, 7, 2], "length"), 0, [1], SP, {2}, 0)
    assert s.finish_reason == "stop" and not s.truncated
    assert parse_sglang_output(out([5, 6, 7, 8], "length"), 0, [1], SP, {2}, 0).truncated


FAKE = r'''
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
port = int(sys.argv[1])
LOG = []

def gen(ids, sp):
    toks, t = [], ids[-1]
    for _ in range(sp["max_new_tokens"]):
        t = (t * 7 + 3) % 50
        toks.append(t)
        if t in sp["stop_token_ids"]:
            return toks, "stop"
    return toks, "length"

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self._send({"ok": True})
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/generate":
            assert req["return_logprob"] and all(sp["no_stop_trim"] for sp in req["sampling_params"])
            res = []
            for ids, sp in zip(req["input_ids"], req["sampling_params"]):
                toks, reason = gen(ids, sp)
                res.append({"output_ids": toks, "meta_info": {
                    "finish_reason": {"type": reason}, "seed": sp.get("sampling_seed"),
                    "output_token_logprobs": [[-0.01 * t, t, None] for t in toks]}})
            self._send(res)
        elif self.path == "/update_weights_from_disk":
            ok = req["model_path"] != "/nonexistent"
            self._send({"success": ok, "message": "" if ok else "model_path not found"})
        else:
            self._send({"error": self.path})

HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_server_mode_client_against_stand_in(tmp_path):
    from _dist import free_port

    (tmp_path / "fake.py").write_text(FAKE)
    port = free_port()
    with ServerProcess([sys.executable, tmp_path / "fake.py", port], port=port, startup_timeout=30,
                       log_path=tmp_path / "log") as srv:
        eng = SGLangEngine(tmp_path, mode="server", server_url=srv.url, eos_token_ids=[31])
        samples = eng.generate([[1, 2], [4]], SamplingParams(max_new_tokens=6, n=2, seed=10, stop_token_ids=[17]))
        assert [s.prompt_index for s in samples] == [0, 0, 1, 1]
        for s in samples:  # brute force of the stand-in's rule: t -> (7t + 3) % 50, stop at 31 or 17
            t, want = s.prompt_ids[-1], []
            for _ in range(6):
                t = (t * 7 + 3) % 50
                want.append(t)
                if t in (17, 31):
                    break
            assert s.response_ids == want
            assert s.finish_reason == ("stop" if want[-1] in (17, 31) else "length")
            assert s.logprobs == pytest.approx([-0.01 * x for x in want])
        assert_fresh(samples, 0)
        eng.update_weights_from_disk(tmp_path, version=1)
        assert eng.weight_version == 1
        assert_fresh(eng.generate([[3]], SamplingParams(max_new_tokens=2)), 1)
        with pytest.raises(RuntimeError, match="model_path not found"):
            eng.update_weights_from_disk("/nonexistent", version=2)
        assert eng.weight_version == 1
        with pytest.raises(ValueError, match="must be > current weight_version 1"):
            eng.update_weights_from_disk(tmp_path, version=1)


def test_engine_mode_without_sglang_says_so():
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    with pytest.raises(ImportError, match="needs the `sglang` package"):
        SGLangEngine("/tmp", mode="engine", eos_token_ids=[2])


# Real SGLang (engine and server mode, weight sync, trainer runs): tests/test_sglang_*_real.py
