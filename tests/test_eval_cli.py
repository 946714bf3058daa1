"""`megatron-opd eval` argument handling and a full run with a stand-in engine.

The fake engine stands in for generation only (fixed texts through the rollout contract); the tokenizer
is loaded from disk by the CLI, and grading/metrics/files are real.
"""

from __future__ import annotations

import json

import pytest

from megatron_opd.data.builtin import write_builtin_jsonl
from megatron_opd.data.toy_tokenizer import byte_tokenizer
from megatron_opd.eval.benchmarks import resolve_benchmarks
from megatron_opd.eval.cli import main
from megatron_opd.rollout.base import Sample


class EchoGoldEngine:
    """Answers every built-in arithmetic problem correctly when `good`, else answers 0 (always wrong)."""

    def __init__(self, tokenizer, answers: dict[str, str], good: bool):
        self.tok, self.answers, self.good = tokenizer, answers, good
        self.eos_token_ids = [tokenizer.eos_token_id]
        self.weight_version = 0
        self.shut = False

    def generate(self, prompts, sampling):
        out = []
        for i, ids in enumerate(prompts):
            text = self.tok.decode(ids)
            ans = next(a for p, a in self.answers.items() if p in text) if self.good else "0"
            rid = self.tok(f"The answer is $\\boxed{{{ans}}}$.", add_special_tokens=False)["input_ids"]
            out.extend(Sample(i, list(ids), rid + self.eos_token_ids, [0.0] * (len(rid) + 1), "stop")
                       for _ in range(sampling.n))
        return out

    def shutdown(self):
        self.shut = True


@pytest.fixture
def setup(tmp_path):
    tok = byte_tokenizer()
    tok.save_pretrained(tmp_path / "model")
    paths = write_builtin_jsonl(tmp_path / "data", n_train=5, n_eval=6, seed=2)
    answers = {json.loads(l)["problem"]: json.loads(l)["answer"] for l in paths["eval"].read_text().splitlines()}
    return tmp_path, tok, paths, answers


@pytest.mark.parametrize("good, expected", [(True, 1.0), (False, 0.0)])
def test_cli_runs_and_writes_results(setup, good, expected, capsys):
    tmp_path, tok, paths, answers = setup
    engines = []

    def factory(args):
        assert args.model == str(tmp_path / "model") and args.k == 2 and args.max_new_tokens == 32
        engines.append(EchoGoldEngine(tok, answers, good))
        return engines[0]

    rc = main(["--model", str(tmp_path / "model"), "--benchmarks", f"arith={paths['eval']}", "--k", "2",
               "--max-new-tokens", "32", "--limit", "4", "--out", str(tmp_path / "out")], engine_factory=factory)
    assert rc == 0 and engines[0].shut
    res = json.loads((tmp_path / "out" / "results.json").read_text())["results"]["arith"]
    assert res["num_problems"] == 4 and res["avg@2"] == expected and res["pass@2"] == expected
    assert "| arith | 4 | 2 |" in capsys.readouterr().out


def test_benchmark_name_resolved_through_data_dir(setup):
    tmp_path, _, paths, _ = setup
    assert resolve_benchmarks("arith", str(tmp_path / "data")) == {"arith": paths["eval"]}
    with pytest.raises(ValueError, match="no path"):
        resolve_benchmarks("arith", None)
    with pytest.raises(FileNotFoundError, match="math500"):
        resolve_benchmarks("math500", str(tmp_path / "data"))
    with pytest.raises(KeyError, match="unknown benchmark"):
        resolve_benchmarks("mmlu=x.jsonl", None)


@pytest.mark.parametrize("extra, msg", [
    (["--benchmarks", "nope=x.jsonl"], "unknown benchmark 'nope'"),
    (["--benchmarks", "aime24=/does/not/exist.jsonl"], "not found"),
    (["--benchmarks", "arith=a.jsonl", "--k", "0"], "--k: invalid value 0"),
    (["--benchmarks", "arith=a.jsonl", "--top-k", "0"], "--top-k: invalid value 0"),
    (["--benchmarks", "arith=a.jsonl", "--device", "tpu"], "--device: invalid value tpu"),
])
def test_cli_bad_arguments_exit_2(tmp_path, extra, msg, capsys):
    def factory(args):
        raise AssertionError("engine must not be built for bad arguments")

    rc = main(["--model", str(tmp_path), "--out", str(tmp_path / "o"), *extra], engine_factory=factory)
    assert rc == 2 and msg in capsys.readouterr().err


def test_cli_with_the_real_local_engine_on_a_tiny_model(tmp_path):
    """Integration with megatron_opd.rollout.local.LocalEngine: a random tiny Qwen2 (vocab sized to the byte
    tokenizer) generates; accuracy is whatever it is, but every sample must be graded and accounted for."""
    import torch

    from megatron_opd.models.tiny import make_tiny_hf_model

    torch.set_num_threads(1)
    tok = byte_tokenizer()
    make_tiny_hf_model("qwen2", out_dir=tmp_path / "m", vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id, bos_token_id=1, max_position_embeddings=512)
    tok.save_pretrained(tmp_path / "m")
    paths = write_builtin_jsonl(tmp_path / "d", n_train=1, n_eval=3, seed=0)
    rc = main(["--model", str(tmp_path / "m"), "--benchmarks", f"arith={paths['eval']}", "--k", "2",
               "--max-new-tokens", "6", "--temperature", "1.0", "--out", str(tmp_path / "out")])
    assert rc == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())["results"]["arith"]
    rows = [json.loads(l) for l in (tmp_path / "out" / "samples_arith.jsonl").read_text().splitlines()]
    assert res["num_problems"] == 3 and len(rows) == 6
    assert all(1 <= r["tokens"] <= 6 for r in rows)
    assert res["avg@2"] == sum(r["status"] == "correct" for r in rows) / 6
    assert res["truncation_rate"] == sum(r["finish_reason"] == "length" for r in rows) / 6


def test_local_engine_takes_dtype_and_device(tmp_path, monkeypatch):
    """`--dtype`/`--device` reach the engine; `auto` is the GPU in bfloat16 when there is one (the eval of a
    1.5B-7B student on a GPU node ran on the CPU in float32 before), the CPU in float32 otherwise."""
    import torch

    from megatron_opd.eval.cli import _local_engine, build_parser
    from megatron_opd.models.tiny import make_tiny_hf_model
    from megatron_opd.rollout.local import LocalEngine

    make_tiny_hf_model("qwen2", out_dir=tmp_path / "m", vocab_size=64)
    seen = []
    monkeypatch.setattr(LocalEngine, "from_pretrained", classmethod(lambda cls, path, **kw: seen.append(kw)))
    base = ["--model", str(tmp_path / "m"), "--out", str(tmp_path / "o"), "--k", "1"]
    _local_engine(build_parser().parse_args(base))
    assert (seen[-1]["dtype"], seen[-1]["device"]) == (torch.float32, "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    _local_engine(build_parser().parse_args(base))
    assert (seen[-1]["dtype"], seen[-1]["device"]) == (torch.bfloat16, "cuda:3")
    _local_engine(build_parser().parse_args(base + ["--dtype", "float32", "--device", "cpu"]))
    assert (seen[-1]["dtype"], seen[-1]["device"]) == (torch.float32, "cpu")
    monkeypatch.undo()
    engine = _local_engine(build_parser().parse_args(base + ["--dtype", "bfloat16"]))  # the real engine
    assert next(engine.model.parameters()).dtype == torch.bfloat16


def test_missing_model_directory_is_named_not_a_hub_error(tmp_path, capsys):
    """A local path that does not exist is "not found", not transformers' "Repo id must be in the form..."."""
    for argv, want in (([f"--model={tmp_path / 'nope'}"], f"--model {tmp_path / 'nope'}: not found"),
                       ([f"--model={tmp_path}", f"--tokenizer={tmp_path / 'tok'}"], f"--tokenizer {tmp_path / 'tok'}: "
                                                                                   "not found"),
                       ([f"--model={tmp_path}"], "not an HF model directory (no config.json)")):
        data = write_builtin_jsonl(tmp_path / "d", n_train=1, n_eval=2, seed=0)
        assert main([*argv, "--benchmarks", f"arith={data['eval']}", "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert want in err and "Repo id" not in err, err
