"""Per-GPU memory and per-step time of a run's layout, predicted before anything is allocated.

A job that waits hours in a queue and then dies of OOM is the costliest failure our users have. The
planner reads a trainer config and a cluster shape and says, per rank type (trainer rank, rollout GPU,
teacher GPU), what each component needs, whether it fits, and, when not, which layouts would.

Every number is a formula over the architecture (`Arch`) and the config, stated beside it; the
constants that are not formulas (CUDA context, NCCL buffers, MFU) are named and stated. On the CPU the
same formulas are checked against measured runs (`benchmarks/bench_plan.py`, docs/scaling.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from megatron_opd.config import Config
from megatron_opd.trainer.mixture import golden_count

GB = 1e9

# Stated constants (not formulas): what a process holds before any tensor of ours, per GPU.
CUDA_CONTEXT_GB = 0.6  # CUDA context + cuBLAS/cuDNN workspaces of one process
NCCL_GB = 0.5  # NCCL communicator buffers, per process (a few channels x 4 MB x peers)
ALLOCATOR_SLACK = 0.05  # PyTorch caching-allocator fragmentation, a fraction of the tensors
MFU = 0.35  # model FLOPs utilisation assumed for training and teacher scoring (bf16, Megatron-LM scale)


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: float
    hbm_gbps: float  # memory bandwidth, GB/s
    bf16_tflops: float  # dense
    link_gbps: float  # inter-node bandwidth per GPU, GB/s (weight sync to a rollout server on another node)


GPUS = {
    "h100-80gb": GPU("h100-80gb", 80.0, 3350.0, 989.0, 50.0),
    "h200-141gb": GPU("h200-141gb", 141.0, 4800.0, 989.0, 50.0),
}


def gpu_from_name(name: str) -> GPU:
    """A known GPU, or `<N>` / `<N>gb`: an H100-class GPU with N GB (memory only differs)."""
    key = name.strip().lower()
    if key in GPUS:
        return GPUS[key]
    num = key[:-2] if key.endswith("gb") else key
    try:
        gb = float(num)
    except ValueError:
        raise ValueError(f"--gpu: unknown GPU {name!r} (known: {', '.join(GPUS)}, or a size in GB such as 40)") from None
    if not 1 <= gb <= 2000:
        raise ValueError(f"--gpu: {gb:g} GB is not a GPU memory size")
    return replace(GPUS["h100-80gb"], name=f"{gb:g}gb", memory_gb=gb)


@dataclass(frozen=True)
class Arch:
    """The numbers the formulas need, from an HF config.json or, for a path that is not on this machine,
    the published configs of the models our examples name (KNOWN_ARCHS)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool = False

    @property
    def layer_params(self) -> int:
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return q + kv + o + bias + 3 * self.hidden * self.ffn + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        head = 0 if self.tied else self.embedding_params
        return self.layers * self.layer_params + self.embedding_params + head + self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V of every layer for one token (SGLang's KV cache)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    def flops_per_token(self, context: int) -> float:
        """Forward FLOPs per token: 2 x the matmul parameters (LM head included) + attention over `context`."""
        matmul = self.layers * (self.layer_params - 2 * self.hidden) + self.embedding_params
        return 2.0 * matmul + 4.0 * self.layers * self.heads * self.head_dim * context


KNOWN_ARCHS = {a.name.lower(): a for a in (
    Arch("Qwen2.5-Math-1.5B", 28, 1536, 12, 2, 128, 8960, 151936, True, True),
    Arch("Qwen2.5-Math-7B", 28, 3584, 28, 4, 128, 18944, 152064, False, True),
    Arch("OpenThinker3-7B", 28, 3584, 28, 4, 128, 18944, 152064, False, True),
    Arch("DeepSeek-R1-Distill-Qwen-7B", 28, 3584, 28, 4, 128, 18944, 152064, False, True),
    Arch("Llama-3.1-8B-Instruct", 32, 4096, 32, 8, 128, 14336, 128256, False),
    Arch("Llama-3.3-70B-Instruct", 80, 8192, 64, 8, 128, 28672, 128256, False),
    Arch("SmolLM2-135M-Instruct", 30, 576, 9, 3, 64, 1536, 49152, True),
)}


def arch_from(path: Optional[str], what: str) -> Arch:
    """The architecture of `path`: its config.json when the directory is here, else a known model whose
    name is the directory's last part (the examples' placeholder paths)."""
    if not path:
        raise ValueError(f"{what}: no hf_path in the config")
    cfg_file = Path(path) / "config.json"
    if cfg_file.is_file():
        try:
            c = json.loads(cfg_file.read_text())
            heads = int(c["num_attention_heads"])
            return Arch(Path(path).name, int(c["num_hidden_layers"]), int(c["hidden_size"]), heads,
                        int(c.get("num_key_value_heads") or heads), int(c.get("head_dim") or c["hidden_size"] // heads),
                        int(c["intermediate_size"]), int(c["vocab_size"]), bool(c.get("tie_word_embeddings", False)),
                        c.get("model_type") == "qwen2")
        except KeyError as e:
            raise ValueError(f"{what}: {cfg_file} has no {e.args[0]}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"{what}: {cfg_file} is not a usable model config ({e})") from None
    known = KNOWN_ARCHS.get(Path(path).name.lower())
    if known is None:
        raise ValueError(f"{what}: {cfg_file} not found and {Path(path).name!r} is not a known model "
                         f"({', '.join(a.name for a in KNOWN_ARCHS.values())}); copy its config.json there")
    return known


def dtype_bytes(name: str, gpu: bool = True) -> int:
    if name == "auto":
        return 2 if gpu else 4
    return {"float32": 4, "bfloat16": 2, "float16": 2}[name]


@dataclass
class Cluster:
    """GPUs per role. trainer: the training world (TP x PP x DP); rollout / teacher: server GPUs (0: none,
    i.e. colocated or in-process)."""

    gpu: GPU
    trainer: int
    rollout: int = 0
    teacher: int = 0


@dataclass
class Component:
    name: str
    gb: float
    formula: str


@dataclass
class RankPlan:
    role: str  # "trainer rank", "rollout GPU", "teacher GPU"
    components: list[Component] = field(default_factory=list)

    @property
    def total_gb(self) -> float:
        return sum(c.gb for c in self.components)

    def add(self, name: str, nbytes: float, formula: str) -> None:
        self.components.append(Component(name, nbytes / GB, formula))


@dataclass
class Layout:
    tp: int
    pp: int
    dp: int
    recompute: Any
    sequence_parallel: bool
    micro_tokens: int  # tokens per training micro-batch (prompt + response of its rows, or the token budget)
    row: int  # tokens of the longest row (prompt + response)
    rows: int  # rows per micro-batch
    teacher_inline: bool  # a megatron teacher on the trainer ranks


def _layout(cfg: Config, trainer_gpus: int) -> Layout:
    p, t = cfg.parallel, cfg.train
    mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    if trainer_gpus % mp:
        raise ValueError(f"parallel: TP x PP = {mp} does not divide the {trainer_gpus} trainer GPUs")
    row = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    dp = trainer_gpus // mp
    rows = rows_per_micro(cfg, dp)
    micro = min(t.max_tokens_per_microbatch, rows * row) if t.max_tokens_per_microbatch else rows * row
    rows = max(1, micro // row) if t.max_tokens_per_microbatch else rows
    return Layout(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, dp,
                  cfg.model.recompute_activations, p.sequence_parallel, micro, min(row, micro), rows,
                  cfg.teacher.backend == "megatron")


def stage_params(a: Arch, tp: int, pp: int, stage: str = "only") -> float:
    """Parameters of one TP rank of a pipeline stage ("only" with PP=1, "first", "last"): its layers, the
    embedding on the first stage, the final norm and LM head on the last (a tied head is the embedding,
    which the last stage then holds a copy of)."""
    layers = math.ceil(a.layers / pp) * a.layer_params
    emb = a.embedding_params
    head = a.hidden + (emb if not a.tied or stage == "last" else 0)
    n = layers + (emb if stage in ("only", "first") else 0) + (head if stage in ("only", "last") else 0)
    return n / tp


def activation_bytes(a: Arch, tokens: int, row: int, lay: Layout, e: int, flash: bool,
                     in_flight: bool = True) -> tuple[float, str]:
    """Activations kept for backward on the first pipeline stage (it holds PP micro-batches in flight under
    1F1B; the last stage one), for a micro-batch of `tokens` tokens in rows of `row`. Per layer and token, no dropout: 13 values
    of h (norm inputs and outputs, q/k/v after rotary, the attention output, the projection input) and 4 of
    the FFN width (gate+up, SiLU, product); without flash attention also the softmax probabilities, heads x
    row per token. Sharded by TP (the norm parts by sequence parallelism). Counted on megatron's local spec
    with autograd's saved-tensor hooks: 23.8 values of h per token at SmolLM2's shapes against 23.7 here,
    and the probabilities once."""
    layers = math.ceil(a.layers / lay.pp)
    in_flight = min(lay.pp, 8) if in_flight else 1
    if lay.recompute in (True, "full"):
        per_layer = 2.0 * tokens * a.hidden * e / (lay.tp if lay.sequence_parallel else 1)
        one = _layer_acts(a, tokens, row, lay, e, flash)
        return (in_flight * layers * per_layer + one,
                "2·s·h·e per layer (full recompute) + one layer's working set")
    return (in_flight * layers * _layer_acts(a, tokens, row, lay, e, flash),
            "per layer and token: (13·h + 4·ffn [+ heads·row without flash])·e / TP")


def _layer_acts(a: Arch, tokens: int, row: int, lay: Layout, e: int, flash: bool) -> float:
    h = a.hidden
    sp = lay.tp if lay.sequence_parallel else 1
    dense = tokens * e * (4.0 * h / sp + (9.0 * h + 4.0 * a.ffn) / lay.tp)
    attn = 0.0 if flash else a.heads * tokens * row * e / lay.tp
    return dense + attn


def rows_per_micro(cfg: Config, dp: int) -> int:
    """Rows in a training micro-batch: micro_batch_size, at most a rank's share of a minibatch (rollouts
    plus golden rows)."""
    n_prompts = cfg.train.prompts_per_step
    n_roll = n_prompts * cfg.rollout.n_samples_per_prompt if cfg.algo.mixture_ratio < 1 else 0
    gold = golden_count(n_roll, cfg.algo.mixture_ratio, n_prompts, parts=dp * max(1, cfg.algo.num_minibatches))
    share = math.ceil((n_roll + gold) / dp / max(1, cfg.algo.num_minibatches))
    return max(1, min(cfg.train.micro_batch_size, share))


def trainer_rank(cfg: Config, lay: Layout, student: Arch, teacher: Optional[Arch], gpu: Optional[GPU],
                 stage: str) -> RankPlan:
    """The memory of one trainer rank of pipeline stage `stage` ("only", "first", "last"). `gpu` None: the
    CPU (fp32 by default, the local spec's unfused attention, the in-process rollout engine, no CUDA
    context or caching allocator)."""
    on_gpu = gpu is not None
    role = "trainer rank" + ("" if stage == "only" else f" ({stage} stage)")
    tr = RankPlan(role)
    e = dtype_bytes(cfg.model.params_dtype, on_gpu)
    ref_dtype = cfg.model.ref_params_dtype if cfg.model.ref_params_dtype != "same" else cfg.model.params_dtype
    flash = on_gpu and cfg.model.layer_spec != "local"
    P = stage_params(student, lay.tp, lay.pp, stage)
    tr.add("student weights", P * e, f"{P / 1e9:.3g}B params/rank x {e} B")
    tr.add("gradients", P * 4, "fp32 grad buffer (megatron DDP) x params/rank")
    dp_shard = lay.dp if cfg.optim.use_distributed_optimizer else 1
    opt = (4 if e < 4 else 0) + 8
    tr.add("optimizer (fp32 main + Adam)" if e < 4 else "optimizer (Adam)", P * opt / dp_shard,
           f"{opt} B/param / DP {dp_shard}" + (" (distributed optimizer)" if dp_shard > 1 else ""))
    act, how = activation_bytes(student, lay.micro_tokens, lay.row, lay, e, flash, in_flight=stage != "last")
    tr.add("activations", act, f"{lay.micro_tokens} tokens/micro-batch; {how}")
    beta = cfg.algo.beta_kl
    if stage in ("only", "last"):
        n_resp = min(lay.micro_tokens, lay.rows * cfg.rollout.max_new_tokens)
        v = student.vocab / lay.tp
        full_kl = beta > 0 and cfg.algo.kl_estimator == "full"
        copies = 3 if full_kl else 2
        chunk = min(cfg.algo.kl_chunk_size, n_resp)
        tr.add("logits (response rows)", copies * n_resp * v * e + (3 if full_kl else 1) * chunk * v * 4,
               f"{copies}·n·V/TP·e + fp32 chunk scratch (n = {n_resp} response tokens)")
    if beta > 0:
        tr.add("reference weights", P * dtype_bytes(ref_dtype, on_gpu), "frozen copy of the student (reference KL)")
    if lay.teacher_inline and teacher is not None:
        t = cfg.teacher
        tp_t, pp_t = t.tensor_model_parallel_size, t.pipeline_model_parallel_size
        st = stage if (tp_t, pp_t) == (lay.tp, lay.pp) else ("only" if pp_t == 1 else "first")
        Pt = stage_params(teacher, tp_t, pp_t, st)
        tr.add("teacher weights (in-process)", Pt * dtype_bytes(t.params_dtype, on_gpu),
               f"teacher TP{tp_t} x PP{pp_t} on the trainer ranks")
    if not on_gpu and cfg.rollout.backend == "local" and stage in ("only", "first"):
        if lay.tp * lay.pp == 1:
            qkv = student.layers * student.hidden * (student.heads + 2 * student.kv_heads) * student.head_dim
            tr.add("rollout engine (local, shares the weights)", qkv * e,
                   "rank 0: its own q/k/v (megatron stores them fused)")
        else:
            tr.add("rollout engine (local, own copy)", student.params * e, "rank 0: the whole student, gathered")
    if on_gpu and cfg.rollout.colocate and cfg.rollout.backend == "sglang":
        tr.add("rollout engine (colocated SGLang)", cfg.rollout.mem_fraction_static * gpu.memory_gb * GB,
               "rollout.mem_fraction_static x GPU memory")
    if on_gpu:
        tensors = tr.total_gb * GB
        tr.add("allocator slack", ALLOCATOR_SLACK * tensors, f"{ALLOCATOR_SLACK:.0%} of the above")
        tr.add("CUDA context + NCCL", (CUDA_CONTEXT_GB + NCCL_GB) * GB, "stated constants")
    return tr


def plan_run(cfg: Config, cluster: Cluster, student: Arch, teacher: Optional[Arch], device: str = "cuda") -> dict[str, Any]:
    """The per-rank memory tables, the verdict and the time estimate of `cfg` on `cluster` (`device` "cpu":
    the trainer ranks as they run on a CPU, for `benchmarks/bench_plan.py`)."""
    gpu = cluster.gpu
    lay = _layout(cfg, cluster.trainer)
    stages = ["only"] if lay.pp == 1 else ["first", "last"]
    ranks = [trainer_rank(cfg, lay, student, teacher, gpu if device != "cpu" else None, st) for st in stages]
    if cluster.rollout and cfg.rollout.backend == "sglang" and not cfg.rollout.colocate:
        ranks.append(_server("rollout GPU", student, cluster.rollout, cfg.rollout.mem_fraction_static, gpu))
    if cluster.teacher and teacher is not None and cfg.teacher.backend == "sglang":
        tp_t = cfg.teacher.tensor_model_parallel_size * cfg.teacher.pipeline_model_parallel_size
        ranks.append(_server("teacher GPU", teacher, tp_t,
                             float(cfg.teacher.sglang_args.get("mem_fraction_static", 0.85)), gpu))
    verdicts = [_verdict(r, gpu) for r in ranks]
    return {"gpu": asdict(gpu), "layout": asdict(lay), "student": asdict(student),
            "teacher": asdict(teacher) if teacher else None,
            "ranks": [{"role": r.role, "total_gb": r.total_gb, "components": [asdict(c) for c in r.components]}
                      for r in ranks],
            "verdicts": verdicts, "fits": all(v["fits"] for v in verdicts),
            "time": estimate_time(cfg, cluster, student, teacher, lay)}


def _server(role: str, a: Arch, tp: int, fraction: float, gpu: GPU) -> RankPlan:
    r = RankPlan(role)
    w = a.params * 2 / tp
    r.add("weights (bf16)", w, f"{a.params / 1e9:.3g}B params x 2 B / TP {tp}")
    kv = max(0.0, fraction * gpu.memory_gb * GB - w)
    r.add("KV cache", kv, f"mem_fraction_static {fraction} x GPU - weights = "
                          f"{kv / (a.kv_bytes_per_token / tp) / 1e6:.2f}M tokens")
    r.add("CUDA context + NCCL", (CUDA_CONTEXT_GB + NCCL_GB) * GB, "stated constants")
    if w > fraction * gpu.memory_gb * GB:
        r.components[1] = Component("KV cache", 0.0, "none: the weights alone exceed mem_fraction_static")
        r.components.append(Component("weights over mem_fraction_static", (w - fraction * gpu.memory_gb * GB) / GB,
                                      "SGLang refuses to start"))
    return r


def _verdict(r: RankPlan, gpu: GPU) -> dict[str, Any]:
    over = r.total_gb - gpu.memory_gb
    if over <= 0:
        return {"role": r.role, "fits": True, "text": f"fits ({r.total_gb:.1f} of {gpu.memory_gb:g} GB)"}
    worst = max(r.components, key=lambda c: c.gb)
    return {"role": r.role, "fits": False, "over_gb": over,
            "text": f"does not fit by {over:.1f} GB ({worst.name}: {worst.gb:.1f} GB)"}


def estimate_time(cfg: Config, cluster: Cluster, student: Arch, teacher: Optional[Arch], lay: Layout) -> dict[str, Any]:
    """Seconds per step, each phase from a stated model: decode memory-bound, scoring and training at MFU,
    weight sync over the link. An estimate, not a measurement."""
    gpu = cluster.gpu
    n_seq = cfg.train.prompts_per_step * cfg.rollout.n_samples_per_prompt
    resp = cfg.rollout.max_new_tokens
    ctx = cfg.data.max_prompt_tokens + resp
    tokens = n_seq * ctx
    rollout_gpus = cluster.rollout or cluster.trainer
    # decode: every step streams the weights once per batch plus each sequence's KV
    w_bytes = student.params * 2
    kv_avg = student.kv_bytes_per_token * ctx / 2
    decode_s = resp * (w_bytes + n_seq * kv_avg) / (rollout_gpus * gpu.hbm_gbps * GB)
    peak = gpu.bf16_tflops * 1e12 * MFU
    train_flops = 3 * student.flops_per_token(ctx // 2) * tokens * cfg.algo.ppo_epochs
    if cfg.algo.beta_kl > 0:
        train_flops += student.flops_per_token(ctx // 2) * tokens * cfg.algo.ppo_epochs
    train_s = train_flops / (cluster.trainer * peak)
    score_s = 0.0
    if teacher is not None:
        score_gpus = cluster.teacher or cluster.trainer
        score_s = teacher.flops_per_token(ctx // 2) * tokens / (score_gpus * peak)
    sync_s = w_bytes / (gpu.link_gbps * GB)
    step = decode_s + score_s + train_s + sync_s
    return {"rollout_s": decode_s, "teacher_score_s": score_s, "train_s": train_s, "weight_sync_s": sync_s,
            "step_s": step, "tokens_per_step": tokens, "tokens_per_s_per_gpu":
                tokens / step / (cluster.trainer + cluster.rollout + cluster.teacher),
            "assumptions": f"decode memory-bound at {gpu.hbm_gbps:g} GB/s (weights + half-context KV per token); "
                           f"scoring and training at MFU {MFU:.0%} of {gpu.bf16_tflops:g} TFLOP/s; "
                           f"sync at {gpu.link_gbps:g} GB/s; responses at the full budget"}


def alternatives(cfg: Config, cluster: Cluster, student: Arch, teacher: Optional[Arch], limit: int = 5) -> list[str]:
    """Layouts of the same GPUs that fit when this one does not: TP (dividing heads and KV heads, within a
    node of 8) x PP (dividing layers), with and without full recompute, a megatron teacher moved to SGLang
    servers; fewest model-parallel GPUs first, then no recompute."""
    out: list[str] = []
    found: list[tuple[int, int, str]] = []
    for tp in (1, 2, 4, 8):
        if student.heads % tp or student.kv_heads % tp:
            continue
        for pp in (1, 2, 4, 8):
            if student.layers % pp or cluster.trainer % (tp * pp):
                continue
            for rec in (cfg.model.recompute_activations, "full"):
                c = _with(cfg, tp, pp, rec)
                if plan_run(c, cluster, student, teacher)["fits"]:
                    found.append((tp * pp, rec == "full", f"TP{tp} x PP{pp} x DP{cluster.trainer // (tp * pp)}"
                                  + (", model.recompute_activations=full" if rec == "full" and rec != cfg.model.recompute_activations else "")
                                  + (", parallel.sequence_parallel=true" if tp > 1 else "")))
                    break
    for _, _, text in sorted(found)[:limit]:
        out.append(text)
    if cfg.teacher.backend == "megatron" and teacher is not None and not out:
        out.append("teacher.backend=sglang on its own GPUs (the in-process teacher's weights leave the trainer ranks)")
    return out


def _with(cfg: Config, tp: int, pp: int, recompute: Any) -> Config:
    return replace(cfg, parallel=replace(cfg.parallel, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                         sequence_parallel=tp > 1),
                   model=replace(cfg.model, recompute_activations=recompute))


# Published throughput, for scale beside the estimate (tokens/s/GPU)
ANCHORS = [
    ("NeMo-RL, Llama-3.1-8B on-policy GRPO at 4k, 16 x H100", 1581.0),
    ("Megatron-Bridge, Llama3-70B pretraining", 1602.0),
]


def format_plan(p: dict[str, Any], alts: list[str]) -> str:
    lines = [f"GPU {p['gpu']['name']} ({p['gpu']['memory_gb']:g} GB); student {p['student']['name']} "
             f"TP{p['layout']['tp']} x PP{p['layout']['pp']} x DP{p['layout']['dp']}, "
             f"{p['layout']['micro_tokens']} tokens per micro-batch"]
    for r in p["ranks"]:
        lines += ["", f"| {r['role']} | GB | how |", "|---|---|---|"]
        lines += [f"| {c['name']} | {c['gb']:.2f} | {c['formula']} |" for c in r["components"]]
        lines.append(f"| **total** | **{r['total_gb']:.2f}** | |")
    lines.append("")
    for v in p["verdicts"]:
        lines.append(f"{v['role']}: {v['text']}")
    t = p["time"]
    lines += ["", f"step time (estimate): {t['step_s']:.0f} s = rollout {t['rollout_s']:.0f} + teacher scoring "
                  f"{t['teacher_score_s']:.0f} + training {t['train_s']:.0f} + weight sync {t['weight_sync_s']:.1f}; "
                  f"{t['tokens_per_s_per_gpu']:.0f} tokens/s/GPU ({t['assumptions']})"]
    lines += [f"  for scale (published, not this run): {name}: {v:.0f} tokens/s/GPU" for name, v in ANCHORS]
    if not p["fits"]:
        lines += ["", "layouts that fit:" if alts else "no layout of these GPUs fits; add GPUs or a larger GPU"]
        lines += [f"  - {a}" for a in alts]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import argparse
    import sys

    from megatron_opd.config import ConfigError, load_config

    ap = argparse.ArgumentParser(prog="megatron-opd plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="trainer YAML (examples/)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, as for train")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu", default="h100-80gb", help=f"{', '.join(GPUS)} or a memory size in GB (e.g. 40)")
    ap.add_argument("--rollout-gpus", type=int, default=None,
                    help="GPUs of the SGLang rollout server (one replica, TP = this); default: the launchers' split")
    ap.add_argument("--teacher-gpus", type=int, default=None,
                    help="GPUs of the SGLang teacher replicas; default: the launchers' split")
    ap.add_argument("--json", default=None, help="write the plan here ('-': stdout only, as JSON)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a rank does not fit (default: warn, exit 0)")
    a = ap.parse_args(argv)
    try:
        cfg = load_config(a.config, a.overrides)
        gpu = gpu_from_name(a.gpu)
        cluster = default_cluster(cfg, gpu, a.nodes, a.gpus_per_node, a.rollout_gpus, a.teacher_gpus)
        student = arch_from(cfg.model.hf_path, "model.hf_path")
        teacher = arch_from(cfg.teacher.hf_path, "teacher.hf_path") if cfg.teacher.hf_path else None
        p = plan_run(cfg, cluster, student, teacher)
    except (ConfigError, ValueError) as e:
        print(f"plan: {e}", file=sys.stderr)
        return 2
    alts = alternatives(cfg, cluster, student, teacher) if not p["fits"] else []
    p["cluster"] = {"gpu": gpu.name, "trainer_gpus": cluster.trainer, "rollout_gpus": cluster.rollout,
                    "teacher_gpus": cluster.teacher}
    p["alternatives"] = alts
    if a.json == "-":
        print(json.dumps(p, indent=1))
    else:
        print(format_plan(p, alts))
        if a.json:
            Path(a.json).write_text(json.dumps(p, indent=1))
    if not p["fits"]:
        print("plan: WARNING: " + "; ".join(v["role"] + " " + v["text"] for v in p["verdicts"] if not v["fits"]),
              file=sys.stderr)
        return 1 if a.strict else 0
    return 0


def default_cluster(cfg: Config, gpu: GPU, nodes: int, per_node: int, rollout: Optional[int],
                    teacher: Optional[int]) -> Cluster:
    """Trainer / rollout / teacher GPUs: as given, else as the launchers split them (scripts/slurm): on one
    node a quarter each to the rollout and teacher servers; on two, half a node each; on more, a node each
    (the 70B teacher: two)."""
    if nodes < 1 or per_node < 1:
        raise ValueError("--nodes and --gpus-per-node must be >= 1")
    total = nodes * per_node
    servers_r = cfg.rollout.backend == "sglang" and not cfg.rollout.colocate
    servers_t = cfg.teacher.backend == "sglang"
    if rollout is None:
        rollout = 0 if not servers_r else (per_node // 4 if nodes == 1 else per_node // 2 if nodes == 2 else per_node)
    if teacher is None:
        t_size = cfg.teacher.tensor_model_parallel_size * cfg.teacher.pipeline_model_parallel_size
        teacher = 0 if not servers_t else (per_node // 4 if nodes == 1 else per_node // 2 if nodes == 2
                                           else max(per_node, t_size))
    trainer = total - rollout - teacher
    if trainer < 1:
        raise ValueError(f"--rollout-gpus {rollout} + --teacher-gpus {teacher} leave no trainer GPU of {total}")
    if servers_r and rollout < 1:
        raise ValueError("rollout.backend=sglang (not colocated) needs --rollout-gpus >= 1")
    t_size = cfg.teacher.tensor_model_parallel_size * cfg.teacher.pipeline_model_parallel_size
    if servers_t and teacher % t_size:
        raise ValueError(f"--teacher-gpus {teacher} is not a multiple of the teacher's TP x PP = {t_size}")
    return Cluster(gpu, trainer, rollout, teacher)
