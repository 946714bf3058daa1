"""`megatron-opd sft` on tiny random models (byte tokenizer) over gloo: the loss it reports is the HF
model's token-mean NLL of the solutions given the prompts, training lowers it, the output is an HF
directory that loads, data parallelism changes no numbers, and bad input is one clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests._dist import run_distributed
from tests._tiny import tiny_setup

pytestmark = pytest.mark.megatron  # version-sensitive: CI's py3.12 + megatron-core 0.19 leg runs it


def _overrides(student: Path, data: dict[str, Path], **extra: str) -> list[str]:
    base = {"model.hf_path": str(student), "data.train_path": str(data["train"]), "optim.lr": "1e-3",
            "train.micro_batch_size": "2", "parallel.backend": "gloo"}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _sft(rank: int, world: int, overrides: list[str], out: str, steps: int, batch: int) -> dict:
    from megatron_opd.config import load_config
    from megatron_opd.models.parallel import destroy_parallel
    from megatron_opd.trainer.sft import run_sft, sft_defaults

    try:
        return run_sft(load_config(None, overrides, defaults=sft_defaults(steps)), out, steps, batch,
                       log=lambda _: None)
    finally:
        destroy_parallel()


def _hf_nll(model_dir: Path, overrides: list[str], batch: int) -> float:
    """Token-mean NLL under HF of the first SFT batch (same sampler seed), solution tokens only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_opd.config import load_config
    from megatron_opd.data.prompts import load_prompts
    from megatron_opd.data.sampler import PromptSampler

    cfg = load_config(None, overrides)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    records = load_prompts(cfg.data.train_path, cfg.data, tok, require_solution=True).records
    rows = PromptSampler(records, seed=cfg.train.seed, shuffle=cfg.data.shuffle, batch_size=batch).next_batch()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r.prompt_ids + r.solution_ids])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            n = len(r.prompt_ids)
            tgt = ids[0, n:]
            total -= float(logp[n - 1:, :].gather(1, tgt[:, None]).sum())
            count += len(r.solution_ids)
    return total / count


def test_sft_loss_is_the_solution_nll_and_training_lowers_it(tmp_path: Path) -> None:
    _root, student, _teacher, data = tiny_setup(tmp_path)
    ov = _overrides(student, data)
    out = tmp_path / "sft"
    [summary] = run_distributed(_sft, 1, ov, str(out), 8, 4)
    assert summary["nll_first"] == pytest.approx(_hf_nll(student, ov, 4), rel=1e-4)
    assert summary["nll_last"] < summary["nll_first"] - 0.05
    assert json.loads((out / "sft_meta.json").read_text())["steps"] == 8
    # the output is an HF directory the stack reads: the tuned weights moved, the tokenizer came along
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = AutoModelForCausalLM.from_pretrained(str(student), dtype=torch.float32)
    b = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(str(out)).get_vocab() == AutoTokenizer.from_pretrained(str(student)).get_vocab()
    moved = [n for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()) if not torch.equal(p, q)]
    assert len(moved) == len(list(a.parameters()))
    # the tuned model's NLL on the first batch is lower under HF too (what the loss said is what was saved)
    assert _hf_nll(out, ov, 4) < summary["nll_first"]


def test_sft_data_parallel_matches_one_rank(tmp_path: Path) -> None:
    _root, student, _teacher, data = tiny_setup(tmp_path)
    ov = _overrides(student, data, **{"optim.warmup_steps": "1"})
    [one] = run_distributed(_sft, 1, ov, str(tmp_path / "one"), 3, 4)
    two = run_distributed(_sft, 2, ov, str(tmp_path / "two"), 3, 4)
    assert two[0]["nll_first"] == pytest.approx(one["nll_first"], rel=1e-5)
    assert two[0]["nll_last"] == pytest.approx(one["nll_last"], rel=1e-4)
    from safetensors.torch import load_file

    w1, w2 = load_file(str(tmp_path / "one" / "model.safetensors")), load_file(str(tmp_path / "two" / "model.safetensors"))
    assert w1.keys() == w2.keys()
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-5


def test_config_defaults_lose_to_yaml_and_overrides(tmp_path: Path) -> None:
    from megatron_opd.config import load_config

    y = tmp_path / "c.yaml"
    y.write_text("optim:\n  lr: 0.25\n")
    assert load_config(None, [], defaults=["optim.lr=0.5"]).optim.lr == 0.5
    assert load_config(y, [], defaults=["optim.lr=0.5"]).optim.lr == 0.25
    assert load_config(y, ["optim.lr=0.125"], defaults=["optim.lr=0.5"]).optim.lr == 0.125


def test_sft_cli_errors_name_the_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from megatron_opd.trainer.sft import main

    _root, student, _teacher, data = tiny_setup(tmp_path)
    assert main(["--out", str(tmp_path / "o"), f"model.hf_path={tmp_path / 'nope'}", f"data.train_path={data['train']}"]) == 2
    assert "model.hf_path" in capsys.readouterr().err
    no_sol = tmp_path / "nosol.jsonl"
    no_sol.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    assert main(["--out", str(tmp_path / "o"), f"model.hf_path={student}", f"data.train_path={no_sol}"]) == 2
    assert "solution" in capsys.readouterr().err
    assert main(["--out", str(tmp_path / "o"), "--steps", "0", f"model.hf_path={student}",
                 f"data.train_path={data['train']}"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_sft_refuses_an_existing_out_before_training_and_short_runs_need_no_warmup_flag(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """An existing --out is refused before the first step (it was refused after all of them), and the SFT
    warmup default (5 steps) shrinks for runs of <= 5 steps instead of failing `--steps 2`."""
    from megatron_opd.trainer import sft

    _root, student, _teacher, data = tiny_setup(tmp_path)
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep.txt").write_text("user's file")
    stepped = []
    real_train = sft.build_batch
    monkeypatch.setattr(sft, "build_batch", lambda *a, **k: stepped.append(1) or real_train(*a, **k))
    args = ["--steps", "2", "--batch-size", "2", "--max-response-tokens", "8", f"model.hf_path={student}",
            f"data.train_path={data['train']}", "parallel.backend=gloo"]
    assert sft.main(["--out", str(tmp_path / "o"), *args]) == 2
    assert "already exists" in capsys.readouterr().err and not stepped
    assert (tmp_path / "o" / "keep.txt").read_text() == "user's file"
    assert sft.main(["--out", str(tmp_path / "o2"), *args]) == 0, capsys.readouterr().err
    assert len(stepped) == 2 and (tmp_path / "o2" / "config.json").is_file()
    assert [d for d in sft.sft_defaults(2) if "warmup" in d] == ["optim.warmup_steps=1"]
    assert [d for d in sft.sft_defaults(100) if "warmup" in d] == ["optim.warmup_steps=5"]
