"""SGLangTeacher client against a stand-in server (NOT SGLang) that answers /generate in SGLang's
prefill-logprob format from a tiny HF model's precomputed log-probs: checks request/parse alignment and
equality with HFTeacher. Real SGLang: tests/test_sglang_server_real.py (marker `sglang`)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_opd.models.tiny import make_tiny_hf_model
from megatron_opd.rollout.server import ServerProcess
from megatron_opd.teacher.base import TeacherScoreError
from megatron_opd.teacher.hf import HFTeacher
from megatron_opd.teacher.sglang import SGLangTeacher

FAKE_SGLANG = r'''
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
port, table_path, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
# {json(input_ids): [V log-probs predicting position j] for j = 0..L-2}, precomputed by the test from the HF model:
# the stand-in stays stdlib-only so it starts in well under a second.
TABLE = json.load(open(table_path))

def prefill(ids, start, k):
    lp = TABLE[json.dumps(ids)]
    positions = range(start, len(ids)) if mode == "ok" else range(start - 1, len(ids) - 1)
    tok, top = [], []
    for j in positions:
        if j <= 0:
            tok.append([None, ids[0], None]); top.append(None); continue
        row = lp[j - 1]
        tok.append([row[ids[j]], ids[j], None])
        if k:
            best = sorted(range(len(row)), key=lambda t: -row[t])[:k]
            top.append([[row[t], t, None] for t in best])
    meta = {"finish_reason": {"type": "length", "length": 0}, "input_token_logprobs": tok,
            "output_token_logprobs": [], "prompt_tokens": len(ids), "completion_tokens": 0}
    if k:
        meta["input_top_logprobs"] = top
    return {"output_ids": [], "meta_info": meta}

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
        assert req["sampling_params"]["max_new_tokens"] == 0 and req["return_logprob"]
        starts = req["logprob_start_len"]
        self._send([prefill(ids, s, req.get("top_logprobs_num", 0)) for ids, s in zip(req["input_ids"], starts)])

print("fake sglang ready", flush=True)
HTTPServer(("127.0.0.1", port), H).serve_forever()
'''

PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [20], [3, 4]]
RESPONSES = [[40, 41, 2], [50], [60, 61, 62, 63, 64], []]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("teacher")
    make_tiny_hf_model("qwen2", out_dir=d, seed=9)
    return d


def _server(tmp_path, model_dir, mode):
    from _dist import free_port

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    table = {}
    for p, r in zip(PROMPTS, RESPONSES):
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([p + r])).logits[0].float(), -1)
        table[json.dumps(p + r)] = lp[:-1].tolist()
    (tmp_path / "table.json").write_text(json.dumps(table))
    script = tmp_path / "fake_sglang.py"
    script.write_text(FAKE_SGLANG)
    port = free_port()
    return ServerProcess([sys.executable, script, port, tmp_path / "table.json", mode], port=port,
                         startup_timeout=60, log_path=tmp_path / "fake.log")


def test_sglang_teacher_matches_hf_teacher(tmp_path, model_dir):
    torch.set_num_threads(1)
    hf = HFTeacher.from_pretrained(model_dir, micro_batch_size=2)
    expected = hf.score(PROMPTS, RESPONSES, top_k=3)
    with _server(tmp_path, model_dir, "ok") as srv:
        got = SGLangTeacher(srv, eos_token_ids=[2], micro_batch_size=2).score(PROMPTS, RESPONSES, top_k=3)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g.logprobs, e.logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(g.topk_logprobs, e.topk_logprobs, atol=1e-5, rtol=0)
        assert torch.equal(g.topk_ids, e.topk_ids)


def test_sglang_teacher_detects_misaligned_server(tmp_path, model_dir):
    with _server(tmp_path, model_dir, "shift") as srv:
        with pytest.raises(TeacherScoreError, match="misaligned"):
            SGLangTeacher(srv, eos_token_ids=[2]).score(PROMPTS[:1], RESPONSES[:1])


# Real SGLang prefill scoring vs the megatron teacher: tests/test_sglang_server_real.py

def test_parse_prefill_accepts_sglang_last_vocab_id_labelled_0():
    """SGLang 0.5.23 labels the last vocabulary id V-1 as 0 in input_token_logprobs
    (logprob_result_processor.py: `x if x < vocab_size - 1 else 0`); the value is V-1's. With the served
    vocab size the client accepts 0 exactly where the response token is V-1, and nowhere else."""
    from megatron_opd.teacher.sglang import parse_prefill

    out = {"meta_info": {"input_token_logprobs": [[None, 5, None], [-1.0, 0, None], [-2.0, 7, None],
                                                  [-3.0, 99, None]]}}
    assert parse_prefill(out, [99, 7, 99], 0, 0, vocab_size=100).logprobs.tolist() == [-1.0, -2.0, -3.0]
    with pytest.raises(TeacherScoreError, match="scored token 0 at response position 0, expected 99"):
        parse_prefill(out, [99, 7, 99], 0, 0)  # vocab size unknown: strict
    with pytest.raises(TeacherScoreError, match="scored token 0 at response position 0, expected 98"):
        parse_prefill(out, [98, 7, 99], 0, 0, vocab_size=100)  # only V-1 may come back as 0
    t = SGLangTeacher("http://127.0.0.1:9", eos_token_ids=[2], vocab_size=100)
    t._post = lambda payload: [out]
    assert t.score([[1, 5]], [[99, 7, 99]])[0].logprobs.tolist() == [-1.0, -2.0, -3.0]
