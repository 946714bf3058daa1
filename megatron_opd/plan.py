"""Per-GPU memory and per-step time of a run's layout, predicted before anything is allocated.

A job that waits hours in a queue and then dies of OOM is the costliest failure our users have. The
planner reads a trainer config and a cluster shape and says, per rank type (trainer rank, rollout GPU,
teacher GPU), what each component needs, whether it fits, and, when not, which layouts would.

Every number is a formula over the architecture (`Arch`) and the config, stated beside it; the
constants that are not formulas (CUDA context, NCCL buffers, MFU) are named and stated. On the CPU the
same formulas are checked against measured runs (`benchmarks/bench_plan.py`, docs/scaling.md), and
`--gpu cpu` plans a CPU run against this machine's RAM.

A rank's memory is what it holds throughout (weights, gradients, optimizer state) plus the largest of
what its phases hold only while they run: rollout (the local engine's KV cache), training (activations,
logits) and a checkpoint save (the distributed optimizer's gather); the phases never overlap in a step.
Host RAM (the HF checkpoint read at start, the save's gathered optimizer state) is its own table.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from megatron_opd.config import Config
from megatron_opd.models.dtype import auto_dtype
from megatron_opd.models.lowp_adam import moment_bytes
from megatron_opd.trainer.mixture import golden_count

GB = 1e9

# Stated constants (not formulas): what a process holds before any tensor of ours, per GPU.
CUDA_CONTEXT_GB = 0.6  # CUDA context + cuBLAS/cuDNN workspaces of one process
NCCL_GB = 0.5  # NCCL communicator buffers, per process (a few channels x 4 MB x peers)
ALLOCATOR_SLACK = 0.05  # PyTorch caching-allocator fragmentation, a fraction of the tensors
MFU = 0.35  # model FLOPs utilisation assumed for training and teacher scoring (bf16, Megatron-LM scale)
# Measured here: the resident set of a process that imported torch, transformers, megatron-core and the
# trainer, before any model (0.47 GB on this CPU; CUDA libraries add their own on a GPU node, not counted).
HOST_RUNTIME_GB = 0.5
LOCAL_ENGINE_ROWS = 64  # LocalEngine's max_batch_size: rows decoded together (the trainer keeps the default)


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


def host_ram_gb() -> float:
    """This machine's RAM as a process may use it: /proc/meminfo's MemTotal, or the cgroup's memory.max
    when that is lower (a container's limit is what the OOM killer enforces)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for f in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            limit = Path(f).read_text().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total / GB


def cpu_device(memory_gb: Optional[float] = None) -> GPU:
    """The CPU as a plan's device: its memory is host RAM (`memory_gb`, else this machine's)."""
    return GPU("cpu", memory_gb if memory_gb is not None else host_ram_gb(), 0.0, 0.0, 0.0)


def gpu_from_name(name: str) -> GPU:
    """A known GPU, `cpu` (this machine's RAM; `cpu:<N>` for N GB), or `<N>` / `<N>gb`: an H100-class GPU
    with N GB (memory only differs)."""
    key = name.strip().lower()
    if key in GPUS:
        return GPUS[key]
    if key == "cpu" or key.startswith("cpu:"):
        if key == "cpu":
            return cpu_device()
        try:
            gb = float(key[4:].removesuffix("gb"))
        except ValueError:
            raise ValueError(f"--gpu: {name!r}: expected cpu or cpu:<GB of RAM>") from None
        if not 0.1 <= gb <= 100000:
            raise ValueError(f"--gpu: {gb:g} GB is not a RAM size")
        return cpu_device(gb)
    num = key[:-2] if key.endswith("gb") else key
    try:
        gb = float(num)
    except ValueError:
        raise ValueError(f"--gpu: unknown GPU {name!r} (known: {', '.join(GPUS)}, cpu, or a size in GB such as 40)"
                         ) from None
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
    ckpt_bytes: int = 2  # bytes per weight of the HF checkpoint on disk (config.json's torch_dtype; bf16 if unsaid)

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
                        c.get("model_type") == "qwen2",
                        4 if str(c.get("torch_dtype") or c.get("dtype") or "") == "float32" else 2)
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
    if name == "auto":  # on a CPU: what `auto` resolves to on this host (models/dtype.py)
        return 2 if gpu else auto_dtype().dtype.itemsize
    return {"float32": 4, "bfloat16": 2, "float16": 2}[name]


@dataclass
class Cluster:
    """GPUs per role. trainer: the training world (TP x PP x DP); rollout / teacher: server GPUs (0: none,
    i.e. colocated or in-process)."""

    gpu: GPU
    trainer: int
    rollout: int = 0
    teacher: int = 0
    nodes: int = 1
    host_ram_gb: Optional[float] = None  # per node; None: not judged (a GPU cluster's nodes are not this machine)
    trainer_nodes: int = 1  # nodes the trainer ranks are spread over


PHASES = ("startup", "rollout", "training", "save")


@dataclass
class Component:
    name: str
    gb: float
    formula: str
    phase: str = ""  # "": held throughout; one of PHASES: only while that phase runs
    rank0: bool = False  # only rank 0 holds it (the local rollout engine, an HF teacher)


@dataclass
class RankPlan:
    role: str  # "trainer rank", "rollout GPU", "teacher GPU", "host RAM ..."
    components: list[Component] = field(default_factory=list)

    def phase_gb(self, phase: str, rank0: bool = True) -> float:
        return sum(c.gb for c in self.components if c.phase == phase and (rank0 or not c.rank0))

    def peak(self, phases: tuple[str, ...] = PHASES, rank0: bool = True) -> tuple[float, str]:
        """(GB, phase): what is held throughout plus the largest of `phases`' own parts (`rank0` False:
        as a rank other than 0 holds it)."""
        held = self.phase_gb("", rank0)
        worst = max(phases, key=lambda ph: self.phase_gb(ph, rank0), default="")
        extra = self.phase_gb(worst, rank0) if worst else 0.0
        return held + extra, worst if extra > 0 else ""

    @property
    def total_gb(self) -> float:
        return self.peak()[0]

    def add(self, name: str, nbytes: float, formula: str, phase: str = "", rank0: bool = False) -> None:
        assert phase in ("", *PHASES), phase
        self.components.append(Component(name, nbytes / GB, formula, phase, rank0))


@dataclass
class Layout:
    tp: int
    pp: int
    dp: int
    recompute: Any
    sequence_parallel: bool
    micro_tokens: int  # tokens per training micro-batch (its rows x the longest row, or up to the token budget)
    row: int  # the longest attended sequence: a row (prompt + response), or a packed sequence of the budget
    rows: int  # rows per micro-batch
    teacher_inline: bool  # a megatron teacher on the trainer ranks
    resp_tokens: int = 0  # response tokens of the micro-batch at its worst (the [n, V] logits rows)


def _layout(cfg: Config, trainer_gpus: int) -> Layout:
    """The training micro-batch at its worst: `micro_batch_size` rows of `max_prompt_tokens +
    max_new_tokens`, or with a token budget as many rows as fit it, and never less than one whole row: a
    row longer than `train.max_tokens_per_microbatch` is forwarded whole (`models.packing.budget_groups`)."""
    p, t = cfg.parallel, cfg.train
    mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    if trainer_gpus % mp:
        raise ValueError(f"parallel: TP x PP = {mp} does not divide the {trainer_gpus} trainer GPUs")
    row = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    dp = trainer_gpus // mp
    if t.max_tokens_per_microbatch:
        micro = max(min(t.max_tokens_per_microbatch, minibatch_rows(cfg, dp) * row), row)
        rows = max(1, micro // row)
        attended = micro if t.pack_sequences else row
        # rows with short prompts fill the budget with responses: up to the budget, not rows x max_new_tokens
        resp = min(micro, minibatch_rows(cfg, dp) * cfg.rollout.max_new_tokens)
    else:
        rows = rows_per_micro(cfg, dp)
        micro, attended = rows * row, row
        resp = rows * cfg.rollout.max_new_tokens
    return Layout(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, dp,
                  cfg.model.recompute_activations, p.sequence_parallel, micro, attended, rows,
                  cfg.teacher.backend == "megatron", resp)


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


def minibatch_rows(cfg: Config, dp: int) -> int:
    """Rows of one data-parallel rank's share of a minibatch (rollouts plus golden rows)."""
    n_prompts = cfg.train.prompts_per_step
    n_roll = n_prompts * cfg.rollout.n_samples_per_prompt if cfg.algo.mixture_ratio < 1 else 0
    gold = golden_count(n_roll, cfg.algo.mixture_ratio, n_prompts, parts=dp * max(1, cfg.algo.num_minibatches))
    return max(1, math.ceil((n_roll + gold) / dp / max(1, cfg.algo.num_minibatches)))


def rows_per_micro(cfg: Config, dp: int) -> int:
    """Rows in a training micro-batch: micro_batch_size, at most a rank's share of a minibatch."""
    return max(1, min(cfg.train.micro_batch_size, minibatch_rows(cfg, dp)))


def trainer_rank(cfg: Config, lay: Layout, student: Arch, teacher: Optional[Arch], gpu: Optional[GPU],
                 stage: str) -> RankPlan:
    """The memory of one trainer rank of pipeline stage `stage` ("only", "first", "last"); the parts only
    rank 0 holds (the local rollout engine, an HF teacher) are marked `rank0` and counted here. `gpu` None:
    the CPU (fp32 by default, the local spec's unfused attention, no CUDA context or caching allocator;
    host RAM is the device, so the HF checkpoints read at start and a save's gather are phases here)."""
    on_gpu = gpu is not None
    role = "trainer rank" + ("" if stage == "only" else f" ({stage} stage)")
    tr = RankPlan(role)
    e = dtype_bytes(cfg.model.params_dtype, on_gpu)
    ref_dtype = cfg.model.ref_params_dtype if cfg.model.ref_params_dtype != "same" else cfg.model.params_dtype
    ref_e = dtype_bytes(ref_dtype, on_gpu)
    flash = on_gpu and cfg.model.layer_spec != "local"
    P = stage_params(student, lay.tp, lay.pp, stage)
    tr.add("student weights", P * e, f"{P / 1e9:.3g}B params/rank x {e} B")
    tr.add("gradients", P * 4, "fp32 grad buffer (megatron DDP) x params/rank")
    dp_shard = lay.dp if cfg.optim.use_distributed_optimizer else 1
    moments = moment_bytes(cfg.optim.exp_avg_dtype, cfg.optim.exp_avg_sq_dtype)
    opt = (4 if e < 4 else 0) + moments
    tr.add("optimizer (fp32 main + Adam)" if e < 4 else "optimizer (Adam)", P * opt / dp_shard,
           f"{opt} B/param / DP {dp_shard}" + (" (distributed optimizer)" if dp_shard > 1 else "")
           + (f"; Adam moments {moments} B/param" if moments != 8 else ""))
    act, how = activation_bytes(student, lay.micro_tokens, lay.row, lay, e, flash, in_flight=stage != "last")
    tr.add("activations", act, f"{lay.micro_tokens} tokens/micro-batch; {how}", "training")
    beta = cfg.algo.beta_kl
    full_kl = beta > 0 and cfg.algo.kl_estimator == "full"
    if full_kl and lay.pp > 1:
        wire = max(1, ref_e // e)
        sp = lay.tp if lay.sequence_parallel else 1
        n_buf = min(lay.pp, 8) if stage == "first" else 1
        tr.add("reference hidden states (in the student's pipeline)",
               n_buf * wire * lay.micro_tokens * student.hidden * e / sp,
               f"{n_buf} micro-batch(es) x {wire}·s·h·e/{'TP' if sp > 1 else '1'}: the reference runs inside the "
               "student's 1F1B schedule, its stage outputs sent beside the student's", "training")
    if stage in ("only", "last"):
        n_resp = min(lay.micro_tokens, lay.resp_tokens or lay.rows * cfg.rollout.max_new_tokens)
        v = student.vocab / lay.tp
        chunk = min(cfg.algo.kl_chunk_size, n_resp)
        scratch = (3 if full_kl else 1) * chunk * v * 4
        if full_kl and cfg.rollout.temperature != 1.0:
            tr.add("logits (response rows)", n_resp * v * (2 * e + 12) + scratch,
                   f"n·V/TP·(2·e + 3·4): the student's rows + gradient, their fp32 copy / T + its gradient and "
                   f"the reference's rows, fp32 at temperature {cfg.rollout.temperature:g} + fp32 chunk scratch "
                   f"(n = {n_resp} response tokens)", "training")
        else:
            copies = 3 if full_kl else 2
            tr.add("logits (response rows)", copies * n_resp * v * e + scratch,
                   f"{copies}·n·V/TP·e + fp32 chunk scratch (n = {n_resp} response tokens)", "training")
    if beta > 0:
        tr.add("reference weights", P * ref_e, "frozen copy of the student (reference KL)")
    t = cfg.teacher
    if lay.teacher_inline and teacher is not None:
        tp_t, pp_t = t.tensor_model_parallel_size, t.pipeline_model_parallel_size
        st = stage if (tp_t, pp_t) == (lay.tp, lay.pp) else ("only" if pp_t == 1 else "first")
        Pt = stage_params(teacher, tp_t, pp_t, st)
        tr.add("teacher weights (in-process)", Pt * dtype_bytes(t.params_dtype, on_gpu),
               f"teacher TP{tp_t} x PP{pp_t} on the trainer ranks")
    if t.backend == "hf" and teacher is not None and stage in ("only", "first"):
        tr.add("teacher (HF, rank 0)", teacher.params * dtype_bytes(t.params_dtype, on_gpu),
               "rank 0: the whole teacher as an HF model", rank0=True)
    for k, tk in enumerate(cfg.teachers[1:], 1):  # `teachers:` beyond the first (which is cfg.teacher)
        if tk.hf_path is None or tk.backend == "sglang":
            continue
        ak = arch_from(tk.hf_path, f"teachers[{k}].hf_path")
        if tk.backend == "megatron":
            tp_k, pp_k = tk.tensor_model_parallel_size, tk.pipeline_model_parallel_size
            st = stage if (tp_k, pp_k) == (lay.tp, lay.pp) else ("only" if pp_k == 1 else "first")
            tr.add(f"teacher {tk.name!r} weights (in-process)",
                   stage_params(ak, tp_k, pp_k, st) * dtype_bytes(tk.params_dtype, on_gpu),
                   f"teacher TP{tp_k} x PP{pp_k} on the trainer ranks")
        elif stage in ("only", "first"):
            tr.add(f"teacher {tk.name!r} (HF, rank 0)", ak.params * dtype_bytes(tk.params_dtype, on_gpu),
                   "rank 0: the whole teacher as an HF model", rank0=True)
    if cfg.rollout.backend == "local" and stage in ("only", "first"):
        _local_engine(tr, cfg, lay, student, e, on_gpu)
    if on_gpu and cfg.rollout.colocate and cfg.rollout.backend == "sglang":
        tr.add("rollout engine (colocated SGLang)", cfg.rollout.mem_fraction_static * gpu.memory_gb * GB,
               "rollout.mem_fraction_static x GPU memory", rank0=True)
    if cfg.optim.use_distributed_optimizer:
        if on_gpu:
            tr.add("checkpoint save: optimizer gather buffers", 4 * P * (2 + 1 / lay.dp),
                   "fully_reshardable save: each fp32 state all-gathered over DP on the GPU, one at a time: the "
                   "received parts (4·P), the collective's flat buffer (4·P) and its own shard (4·P/DP)", "save")
        else:
            tr.add("checkpoint save: optimizer state gathered", save_host_bytes(P, lay.dp, gather_in_host=True),
                   SAVE_HOW + "; on the CPU the all-gather's flat buffer too (4·P)", "save")
    if not on_gpu:
        tr.add("HF checkpoints read whole (startup)", startup_host_bytes(cfg, student), STARTUP_HOW,
               "startup")
        tr.add("Adam moments, not yet allocated (startup)", -moments * P / dp_shard,
               "torch's Adam allocates exp_avg and exp_avg_sq at the first step", "startup")
    if on_gpu:
        tensors, _ = tr.peak()
        tr.add("allocator slack", ALLOCATOR_SLACK * tensors * GB, f"{ALLOCATOR_SLACK:.0%} of the peak above")
        tr.add("CUDA context + NCCL", (CUDA_CONTEXT_GB + NCCL_GB) * GB, "stated constants")
    return tr


SAVE_HOW = ("fully_reshardable save without its memory-efficient flag: every rank all-gathers the "
            "DP-sharded fp32 main weights and Adam moments into host RAM (3·4·P) plus one state's gather "
            "and concatenation in flight (2·4·P) and its own shards (3·4·P/DP)")
STARTUP_HOW = ("the larger of: the student's HF checkpoint read whole in its build dtype; a local engine's "
               "from_pretrained mapping the checkpoint file (ckpt bytes + its own weights)")


def save_host_bytes(P: float, dp: int, gather_in_host: bool = False) -> float:
    """Host bytes of one rank during a checkpoint save with the distributed optimizer (megatron-core's
    `get_parameter_state_dp_zero(return_on_all_ranks=True)`, what `fully_reshardable` without
    `distrib_optim_fully_reshardable_mem_efficient` runs): the world tensors of param, exp_avg and
    exp_avg_sq (fp32, every parameter of this rank's TP/PP shard), this rank's three DP shards, and for the
    state being gathered its received parts and their concatenation; `gather_in_host` (gloo, the CPU)
    also the flat buffer torch's all_gather of a list receives into. Measured on the CPU at DP1: 36.0 B per
    parameter against 36 here (tests/test_plan.py)."""
    return 12 * P + 12 * P / dp + 8 * P + (4 * P if gather_in_host else 0)


def startup_host_bytes(cfg: Config, student: Arch, on_gpu: bool = False) -> float:
    """Host bytes a trainer rank holds only while it builds its models, at their largest: the student's HF
    checkpoint, read whole in the dtype it is built in (`load_hf_state_dict(dtype=)`; the checkpoint's own
    unless the reference wants no more precision) and kept until the reference is built from it; later, a
    local rollout engine's `from_pretrained`, which maps the student's checkpoint file (its pages count as
    RSS) while it builds its own weights (dropped for the student's when it shares them). An in-process
    megatron teacher streams its checkpoint into its weights a layer at a time
    (`load_hf_into_megatron(consume=True)`): nothing of it beyond its weights. Measured on the Qwen2.5 pair
    (benchmarks/bench_step.py --pair qwen): startup peak 15.2 GB against 15.4 planned."""
    m = cfg.model
    e = dtype_bytes(m.params_dtype, on_gpu)
    ref_e = e if m.ref_params_dtype == "same" else dtype_bytes(m.ref_params_dtype, on_gpu)
    n = student.params * (e if ref_e <= e else student.ckpt_bytes)
    if cfg.rollout.backend == "local":
        eng_e = e if cfg.rollout.dtype == "auto" else dtype_bytes(cfg.rollout.dtype, on_gpu)
        n = max(n, student.params * (student.ckpt_bytes + eng_e))
    return n


def _local_engine(tr: RankPlan, cfg: Config, lay: Layout, a: Arch, e: int, on_gpu: bool) -> None:
    """The in-process rollout engine (`rollout.backend=local`, rank 0, on the GPU when there is one): its
    weights in `rollout.dtype`, shared with a TP=PP=1 student of that dtype except q/k/v (megatron stores
    them fused) unless `rollout.overlap`; and, while it decodes, the KV cache of up to LOCAL_ENGINE_ROWS rows
    at the full context."""
    r = cfg.rollout
    eng_e = e if r.dtype == "auto" else dtype_bytes(r.dtype, on_gpu)
    if lay.tp * lay.pp == 1 and not r.overlap and eng_e == e:
        qkv = a.layers * a.hidden * (a.heads + 2 * a.kv_heads) * a.head_dim
        tr.add("rollout engine (local, shares the weights)", qkv * eng_e,
               "rank 0: its own q/k/v (megatron stores them fused)", rank0=True)
    else:
        why = "TP x PP > 1" if lay.tp * lay.pp > 1 else "rollout.overlap" if r.overlap else "rollout.dtype differs"
        tr.add("rollout engine (local, own copy)", a.params * eng_e,
               f"rank 0: the whole student in {eng_e} B ({why})", rank0=True)
    n_roll = cfg.train.prompts_per_step * r.n_samples_per_prompt if cfg.algo.mixture_ratio < 1 else 0
    if r.pack_weights and not on_gpu and eng_e in (2, 4) and n_roll:  # fp32 / bf16 on a CPU: rollout/packed.py
        packed = a.layers * (a.layer_params - 2 * a.hidden) + a.embedding_params
        tr.add("rollout engine packed weights", packed * eng_e,
               "rank 0, while it decodes: a oneDNN-packed copy of every linear weight and the LM head "
               "(rollout.pack_weights, rollout/packed.py; rollout/lean.py packs the same)", "rollout", rank0=True)
    elif r.lean_decode and n_roll:
        fused = a.layers * a.hidden * ((a.heads + 2 * a.kv_heads) * a.head_dim + 2 * a.ffn)
        tr.add("rollout engine fused weights", fused * eng_e,
               "rank 0, while it decodes: [q; k; v] and [gate; up] concatenated (rollout.lean_decode, "
               "rollout/lean.py)", "rollout", rank0=True)
    rows = min(LOCAL_ENGINE_ROWS, n_roll)
    ctx = cfg.data.max_prompt_tokens + r.max_new_tokens
    kv = 2 * a.layers * a.kv_heads * a.head_dim * eng_e
    if rows:
        tr.add("rollout engine KV cache", rows * ctx * kv,
               f"rank 0: {rows} rows x {ctx} tokens x {kv} B (2·layers·kv_heads·head_dim·e)", "rollout", rank0=True)


def plan_run(cfg: Config, cluster: Cluster, student: Arch, teacher: Optional[Arch], device: str = "cuda") -> dict[str, Any]:
    """The per-rank memory tables, the host RAM table, the verdicts and the time estimate of `cfg` on
    `cluster` (`device` "cpu", or a cluster of `cpu_device()`: the trainer ranks as they run on a CPU, all
    in host RAM, judged together against it)."""
    gpu = cluster.gpu
    cpu = device == "cpu" or gpu.name == "cpu"
    lay = _layout(cfg, cluster.trainer)
    stages = ["only"] if lay.pp == 1 else ["first", "last"]
    ranks = [trainer_rank(cfg, lay, student, teacher, None if cpu else gpu, st) for st in stages]
    if not cpu and cluster.rollout and cfg.rollout.backend == "sglang" and not cfg.rollout.colocate:
        ranks.append(_server("rollout GPU", student, cluster.rollout, cfg.rollout.mem_fraction_static, gpu))
    if not cpu and cluster.teacher and teacher is not None and cfg.teacher.backend == "sglang":
        tp_t = cfg.teacher.tensor_model_parallel_size * cfg.teacher.pipeline_model_parallel_size
        ranks.append(_server("teacher GPU", teacher, tp_t,
                             float(cfg.teacher.sglang_args.get("mem_fraction_static", 0.85)), gpu))
    host, per_node = host_plan(cfg, cluster, lay, student, teacher, ranks, cpu)
    if cpu:
        verdicts = [_verdict(per_node, gpu.memory_gb)]
    else:
        verdicts = [_verdict(r, gpu.memory_gb) for r in ranks]
        if cluster.host_ram_gb:
            verdicts.append(_verdict(per_node, cluster.host_ram_gb))
    out = {"gpu": asdict(gpu), "device": "cpu" if cpu else "cuda", "layout": asdict(lay), "student": asdict(student),
           "teacher": asdict(teacher) if teacher else None,
           "ranks": [_rank_json(r) for r in ranks], "host": [_rank_json(r) for r in (host, per_node) if r is not None],
           "verdicts": verdicts, "fits": all(v["fits"] for v in verdicts),
           "time": None if cpu else estimate_time(cfg, cluster, student, teacher, lay)}
    return out


def _rank_json(r: RankPlan) -> dict[str, Any]:
    total, phase = r.peak()
    return {"role": r.role, "total_gb": total, "peak_phase": phase, "components": [asdict(c) for c in r.components]}


def host_plan(cfg: Config, cluster: Cluster, lay: Layout, student: Arch, teacher: Optional[Arch],
              ranks: list[RankPlan], cpu: bool) -> tuple[Optional[RankPlan], RankPlan]:
    """(one trainer rank's host RAM, a node's). On GPUs a rank's host RAM is its runtime, the HF
    checkpoints it reads at start and a save's gathered optimizer state (the phases never overlap); on the
    CPU everything of a rank is host RAM (its plan is the rank table: no table of its own). A node holds
    its share of the trainer ranks (rank 0 with the local engine)."""
    per_node = max(1, math.ceil(cluster.trainer / max(1, cluster.trainer_nodes)))
    trainers = [r for r in ranks if r.role.startswith("trainer")]
    host = None
    if not cpu:
        host = RankPlan("host RAM per trainer rank")
        P = max(stage_params(student, lay.tp, lay.pp, st) for st in (["only"] if lay.pp == 1 else ["first", "last"]))
        host.add("HF checkpoints read whole (startup)", startup_host_bytes(cfg, student, on_gpu=True), STARTUP_HOW,
                 "startup")
        if cfg.optim.use_distributed_optimizer:
            host.add("checkpoint save: optimizer state gathered", save_host_bytes(P, lay.dp), SAVE_HOW, "save")
        host.add("process runtime", HOST_RUNTIME_GB * GB, "python + torch + transformers + megatron-core (measured, CPU)")
    node = RankPlan(f"host RAM per node ({per_node} trainer rank{'s' if per_node > 1 else ''}"
                    + (", this machine)" if cpu and cluster.host_ram_gb is None else ")"))
    # rank 0 and the others, by stage: ranks are laid out TP first, then DP, PP last (megatron's order)
    stage_of = (lambda k: trainers[0]) if len(trainers) == 1 else (
        lambda k: trainers[0] if k < cluster.trainer // lay.pp * (lay.pp - 1) or lay.pp == 1 else trainers[-1])
    counts: dict[tuple[str, bool], int] = {}
    for k in range(per_node):
        r = stage_of(k)
        counts[(r.role, k == 0)] = counts.get((r.role, k == 0), 0) + 1
    for (role, is0), n in counts.items():
        r = next(t for t in trainers if t.role == role)
        gb = r.peak(rank0=is0)[0] if cpu else host.peak()[0] - HOST_RUNTIME_GB
        node.add(("rank 0: " if is0 else f"{n} other rank{'s' if n > 1 else ''}: ") + role, n * gb * GB,
                 f"{n} x {gb:.2f} GB ({'its peak' if cpu else 'the host table above'})")
    node.add("process runtime", per_node * HOST_RUNTIME_GB * GB, f"{per_node} x {HOST_RUNTIME_GB} GB")
    return host, node


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


def _verdict(r: RankPlan, memory_gb: float) -> dict[str, Any]:
    total, phase = r.peak()
    when = f", at its {phase} peak" if phase else ""
    over = total - memory_gb
    if over <= 0:
        return {"role": r.role, "fits": True, "text": f"fits ({total:.1f} of {memory_gb:.4g} GB{when})"}
    worst = max((c for c in r.components if c.phase in ("", phase)), key=lambda c: c.gb)
    return {"role": r.role, "fits": False, "over_gb": over,
            "text": f"does not fit by {over:.1f} GB ({worst.name}: {worst.gb:.1f} GB{when})"}


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
    algo = cfg.algo
    fwd = student.flops_per_token(ctx // 2) * tokens
    forwards = {"forward + backward": 3.0 * algo.ppo_epochs}
    if cfg.model.recompute_activations in (True, "full"):
        forwards["full recompute"] = 1.0 * algo.ppo_epochs  # backward reruns every layer's forward
    if separate_old_logp(cfg):
        forwards["pi_old scoring"] = 1.0
    if algo.beta_kl > 0:  # the full KL reruns the reference in every epoch; the others score it once
        forwards["reference"] = float(algo.ppo_epochs) if algo.kl_estimator == "full" else 1.0
    train_flops = fwd * sum(forwards.values())
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
            "train_forwards": forwards,
            "assumptions": f"decode memory-bound at {gpu.hbm_gbps:g} GB/s (weights + half-context KV per token); "
                           f"scoring and training at MFU {MFU:.0%} of {gpu.bf16_tflops:g} TFLOP/s, training = "
                           + " + ".join(f"{v:g} {k}" for k, v in forwards.items()) + " forward-equivalents; "
                           f"sync at {gpu.link_gbps:g} GB/s; responses at the full budget"}


def separate_old_logp(cfg: Config) -> bool:
    """Whether a step scores pi_old in a forward of its own (`Learner.reuse_old_logp`): not off-policy
    (rollout.overlap takes the engine's log-probs), and not one update per step with reuse on, no
    adv_normalize (dropout, which the plan does not know, also forces it)."""
    a = cfg.algo
    if cfg.rollout.overlap:
        return False
    return not (cfg.train.reuse_old_logp and a.ppo_epochs == 1 and a.num_minibatches == 1 and not a.adv_normalize)


def alternatives(cfg: Config, cluster: Cluster, student: Arch, teacher: Optional[Arch], limit: int = 5) -> list[str]:
    """Layouts of the same GPUs that fit when this one does not: TP (dividing heads and KV heads, within a
    node of 8) x PP (dividing layers), with and without full recompute, a megatron teacher moved to SGLang
    servers; fewest model-parallel GPUs first, then no recompute."""
    if cluster.gpu.name == "cpu":
        return cpu_alternatives(cfg, cluster, student, teacher)
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


def cpu_alternatives(cfg: Config, cluster: Cluster, student: Arch, teacher: Optional[Arch]) -> list[str]:
    """Settings of the same CPU run that fit its RAM: full recompute, half the rows or tokens per
    micro-batch, a bf16 reference beside an fp32 student, no distributed optimizer (its save gathers the
    optimizer state into RAM); each alone, then all together."""
    t, m = cfg.train, cfg.model
    knobs: list[tuple[str, Any]] = []
    if m.recompute_activations not in (True, "full"):
        knobs.append(("model.recompute_activations=full",
                      lambda c: replace(c, model=replace(c.model, recompute_activations="full"))))
    if t.max_tokens_per_microbatch:
        half = max(1, t.max_tokens_per_microbatch // 2)
        knobs.append((f"train.max_tokens_per_microbatch={half}",
                      lambda c: replace(c, train=replace(c.train, max_tokens_per_microbatch=half))))
    elif t.micro_batch_size > 1:
        half = max(1, t.micro_batch_size // 2)
        knobs.append((f"train.micro_batch_size={half}", lambda c: replace(c, train=replace(c.train, micro_batch_size=half))))
    if cfg.algo.beta_kl > 0 and dtype_bytes(m.params_dtype, False) == 4 and m.ref_params_dtype in ("same", "auto"):
        knobs.append(("model.ref_params_dtype=bfloat16",
                      lambda c: replace(c, model=replace(c.model, ref_params_dtype="bfloat16"))))
    if cfg.optim.use_distributed_optimizer:  # no save-time gather into host RAM (unsharded over DP, if DP > 1)
        knobs.append(("optim.use_distributed_optimizer=false",
                      lambda c: replace(c, optim=replace(c.optim, use_distributed_optimizer=False))))
    tries = [(name, [f]) for name, f in knobs]
    if len(knobs) > 1:
        tries.append((" ".join(name for name, _ in knobs), [f for _, f in knobs]))
    out = []
    for name, fns in tries:
        c = cfg
        for f in fns:
            c = f(c)
        p = plan_run(c, cluster, student, teacher)
        if p["fits"]:
            out.append(f"{name} (host RAM {p['host'][-1]['total_gb']:.1f} GB)")
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


def _table(r: dict[str, Any]) -> list[str]:
    lines = ["", f"| {r['role']} | phase | GB | how |", "|---|---|---|---|"]
    summed = r["role"].startswith("host RAM per node")  # each line a rank's own peak
    lines += [f"| {c['name']} | {c['phase'] or ('its peak' if summed else 'always')} | {c['gb']:.2f} | {c['formula']} |"
              for c in r["components"]]
    phases = sorted({c["phase"] for c in r["components"] if c["phase"]})
    how = (f"always + {r['peak_phase']}, the largest of {', '.join(phases)}" if r["peak_phase"]
           else "always" if phases else "")
    lines.append(f"| **peak** | | **{r['total_gb']:.2f}** | {how} |")
    return lines


def format_plan(p: dict[str, Any], alts: list[str]) -> str:
    lay = p["layout"]
    if p["device"] == "cpu":
        where = f"CPU ({p['gpu']['memory_gb']:.1f} GB of host RAM)"
    else:
        where = f"GPU {p['gpu']['name']} ({p['gpu']['memory_gb']:g} GB)"
    cl = p.get("cluster")
    nodes = f"{cl['nodes']} node(s){' (' + cl['nodes_from'] + ')' if cl.get('nodes_from') else ''}; " if cl else ""
    lines = [f"{where}; {nodes}student {p['student']['name']} TP{lay['tp']} x PP{lay['pp']} x DP{lay['dp']}, "
             f"{lay['micro_tokens']} tokens per micro-batch"]
    for r in p["ranks"]:
        lines += _table(r)
    for r in p["host"]:
        lines += _table(r)
    lines.append("")
    for v in p["verdicts"]:
        lines.append(f"{v['role']}: {v['text']}")
    t = p["time"]
    if t is None:
        lines += ["", "step time: not estimated on a CPU (benchmarks/bench_step.py measures it)"]
    else:
        lines += ["", f"step time (estimate): {t['step_s']:.0f} s = rollout {t['rollout_s']:.0f} + teacher scoring "
                      f"{t['teacher_score_s']:.0f} + training {t['train_s']:.0f} + weight sync {t['weight_sync_s']:.1f}; "
                      f"{t['tokens_per_s_per_gpu']:.0f} tokens/s/GPU ({t['assumptions']})"]
        lines += [f"  for scale (published, not this run): {name}: {v:.0f} tokens/s/GPU" for name, v in ANCHORS]
    if not p["fits"]:
        if p["device"] == "cpu":
            lines += ["", "settings that fit:" if alts else "no single setting tried fits; more RAM, or a smaller model"]
        else:
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
    ap.add_argument("--nodes", type=int, default=None,
                    help="default: the #SBATCH --nodes of the launcher the config names ('Launch: scripts/slurm/"
                         "X.sbatch'), else 1")
    ap.add_argument("--gpus-per-node", type=int, default=None,
                    help="default 8; with --gpu cpu the trainer processes per node, default TP x PP")
    ap.add_argument("--gpu", default="h100-80gb",
                    help=f"{', '.join(GPUS)}, a memory size in GB (e.g. 40), or cpu (this machine's RAM; cpu:<GB>)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="cpu: the same as --gpu cpu")
    ap.add_argument("--host-ram-gb", type=float, default=None,
                    help="RAM per node: judge the host RAM table against it (with --gpu cpu: instead of this machine's)")
    ap.add_argument("--rollout-gpus", type=int, default=None,
                    help="GPUs of the SGLang rollout server (one replica, TP = this); default: the launchers' split")
    ap.add_argument("--teacher-gpus", type=int, default=None,
                    help="GPUs of the SGLang teacher replicas; default: the launchers' split")
    ap.add_argument("--json", default=None, help="write the plan here ('-': stdout only, as JSON)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a rank does not fit (default: warn, exit 0)")
    a = ap.parse_args(argv)
    try:
        cfg = load_config(a.config, a.overrides)
        gpu_name = "cpu" if a.device == "cpu" and not a.gpu.lower().startswith("cpu") else a.gpu
        gpu = gpu_from_name(gpu_name)
        if gpu.name == "cpu" and a.host_ram_gb is not None:
            gpu = cpu_device(a.host_ram_gb)
        nodes, nodes_from = a.nodes, ""
        if nodes is None:
            found = launcher_nodes(a.config) if gpu.name != "cpu" else None
            nodes, nodes_from = found if found else (1, "")
        per_node = a.gpus_per_node or (cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size
                                       if gpu.name == "cpu" else 8)
        try:
            cluster = default_cluster(cfg, gpu, nodes, per_node, a.rollout_gpus, a.teacher_gpus)
        except ValueError as e:
            need = None if a.nodes is not None else min_nodes(cfg, gpu, per_node, a.rollout_gpus, a.teacher_gpus)
            if need is None:
                raise
            raise ValueError(f"{e} on {nodes} node(s) of {per_node} GPUs; the launchers' split needs "
                             f"{need}: pass --nodes {need}") from None
        if a.host_ram_gb is not None and gpu.name != "cpu":
            cluster.host_ram_gb = a.host_ram_gb
        student = arch_from(cfg.model.hf_path, "model.hf_path")
        teacher = arch_from(cfg.teacher.hf_path, "teacher.hf_path") if cfg.teacher.hf_path else None
        p = plan_run(cfg, cluster, student, teacher)
    except (ConfigError, ValueError) as e:
        print(f"plan: {e}", file=sys.stderr)
        return 2
    alts = alternatives(cfg, cluster, student, teacher) if not p["fits"] else []
    p["cluster"] = {"gpu": gpu.name, "nodes": nodes, "nodes_from": nodes_from, "trainer_gpus": cluster.trainer,
                    "rollout_gpus": cluster.rollout, "teacher_gpus": cluster.teacher}
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


def launcher_nodes(config_path: str) -> Optional[tuple[int, str]]:
    """(nodes, where from) of the sbatch script a config names in a `Launch: scripts/slurm/X.sbatch` comment
    (the examples do): its `#SBATCH --nodes`. Looked up beside the config's directory and from here."""
    try:
        text = Path(config_path).read_text()
    except OSError:
        return None
    m = re.search(r"Launch:\s*(\S+\.sbatch)", text)
    if not m:
        return None
    for base in (Path(config_path).resolve().parent.parent, Path.cwd()):
        script = base / m.group(1)
        if script.is_file():
            n = re.search(r"^#SBATCH\s+--nodes[= ](\d+)", script.read_text(), re.M)
            if n:
                return int(n.group(1)), f"{m.group(1)}'s #SBATCH --nodes"
    return None


def min_nodes(cfg: Config, gpu: GPU, per_node: int, rollout: Optional[int], teacher: Optional[int],
              limit: int = 64) -> Optional[int]:
    """The fewest nodes of `per_node` GPUs the launchers' split can place this config on."""
    for n in range(1, limit + 1):
        try:
            default_cluster(cfg, gpu, n, per_node, rollout, teacher)
            return n
        except ValueError:
            continue
    return None


def default_cluster(cfg: Config, gpu: GPU, nodes: int, per_node: int, rollout: Optional[int],
                    teacher: Optional[int]) -> Cluster:
    """Trainer / rollout / teacher GPUs: as given, else as the launchers split them (scripts/slurm): on one
    node a quarter each to the rollout and teacher servers; on two, half a node each; on more, a node each
    (the 70B teacher: two). On two nodes or fewer the trainer ranks spread over all of them, on more they
    have nodes of their own. A CPU plan has no servers (the local engine and an in-process teacher)."""
    if nodes < 1 or per_node < 1:
        raise ValueError("--nodes and --gpus-per-node must be >= 1")
    total = nodes * per_node
    if gpu.name == "cpu":
        return Cluster(gpu, total, 0, 0, nodes, gpu.memory_gb, nodes)
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
    trainer_nodes = nodes if nodes <= 2 else max(1, math.ceil(trainer / per_node))
    return Cluster(gpu, trainer, rollout, teacher, nodes, None, trainer_nodes)


def fit_warning(cfg: Config, world: Optional[int] = None, local: Optional[int] = None,
                memory_gb: Optional[float] = None) -> Optional[str]:
    """One line for `megatron-opd train` to print at start when the plan says this run cannot fit this
    machine: a trainer rank over the GPU's memory (CUDA), or the ranks on this machine over its RAM (CPU),
    before the OOM killer says it hours later. None when it fits or cannot be planned (a model whose
    config.json is not here, a layout the plan does not know): the warning is advice, never an error.
    `world` / `local`: the trainer ranks in all and on this machine (default WORLD_SIZE /
    LOCAL_WORLD_SIZE); `memory_gb`: instead of this machine's GPU memory or RAM."""
    try:
        import torch

        world = world or int(os.environ.get("WORLD_SIZE") or 1)
        local = local or int(os.environ.get("LOCAL_WORLD_SIZE") or world)
        student = arch_from(cfg.model.hf_path, "model.hf_path")
        teacher = arch_from(cfg.teacher.hf_path, "teacher.hf_path") if cfg.teacher.hf_path else None
        if torch.cuda.is_available():
            gb = memory_gb or torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GB
            gpu = gpu_from_name(f"{gb:.2f}")
            p = plan_run(cfg, Cluster(gpu, trainer=world), student, teacher)
            bad = [v for v in p["verdicts"] if v["role"].startswith("trainer") and not v["fits"]]
            where = f"--gpu {gb:.0f}"
        else:
            dev = cpu_device(memory_gb)
            nodes = max(1, world // max(1, local))
            p = plan_run(cfg, Cluster(dev, world, 0, 0, nodes, dev.memory_gb, nodes), student, teacher)
            bad = [v for v in p["verdicts"] if not v["fits"]]
            where = f"--gpu cpu:{dev.memory_gb:.0f}" + (f" --gpus-per-node {local}" if local > 1 else "")
    except Exception:  # noqa: BLE001 - advice only: a plan that cannot be made says nothing
        return None
    if not bad:
        return None
    return ("plan: WARNING: this run is not expected to fit this machine's memory: "
            + "; ".join(f"{v['role']} {v['text']}" for v in bad)
            + f" (megatron-opd plan --config <this config> {where} for the table and settings that fit)")
