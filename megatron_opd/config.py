"""Typed run configuration: one dataclass per concern, loaded from YAML with dotted CLI overrides.

Why hand-rolled instead of Hydra/OmegaConf: the whole schema is a few dataclasses, and we want every
mistake (unknown key, wrong type, inconsistent values) to fail with one message naming the dotted key.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args, get_origin, get_type_hints
from urllib.parse import urlparse

import yaml

from megatron_opd.metrics.collapse import CollapseConfig
from megatron_opd.metrics.health import HealthConfig


class ConfigError(ValueError):
    """A configuration problem; the message names the offending dotted key."""


@dataclass
class ModelConfig:
    """The student (and, by default, the reference = initial student)."""

    hf_path: Optional[str] = None  # HF directory: config.json + *.safetensors (+ tokenizer)
    family: Literal["auto", "qwen2", "qwen3", "llama"] = "auto"
    layer_spec: Literal["auto", "local", "te"] = "auto"  # auto: TE on GPU, local on CPU
    # auto: bf16 on GPU; on a CPU bf16 where its bf16 GEMMs measure faster, else fp32 (models/dtype.py); bf16 on
    # a trainable model is mixed precision: fp32 main weights, gradients and Adam
    params_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # the frozen reference pi_ref: "same" as params_dtype, or its own (bfloat16 halves its memory and, on
    # GPUs and CPUs with bf16 GEMMs, its time; its log-softmax is fp32 either way)
    ref_params_dtype: Literal["same", "auto", "float32", "bfloat16", "float16"] = "same"
    megatron_ckpt: Optional[str] = None  # removed (was never read); kept so old runs' config.yaml load; must be null
    fp8: Optional[Literal["delayed", "tensorwise", "mxfp8", "blockwise"]] = None  # TE FP8 recipe; GPU only
    # optional: declared to validate the TP/PP layout without reading the model (a login node); checked
    # against model.hf_path's config.json before the run starts. The model's own values are what it uses.
    num_attention_heads: Optional[int] = None
    num_query_groups: Optional[int] = None
    num_layers: Optional[int] = None
    # activation recompute in training: false; "full" (or true) keeps only each layer's input and reruns the
    # layer in backward (~1/3 more compute, like TRL's default gradient checkpointing); "selective" reruns
    # only the core attention (saves the unfused attention scores of the local spec; little with flash)
    recompute_activations: Union[bool, Literal["selective", "full"]] = False


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl with CUDA, gloo otherwise


@dataclass
class TeacherConfig:
    # the teacher's name in `teachers:` (teacher_route maps prompt records to it; metrics `<key>/<name>`); the
    # single `teacher:` block is the one teacher named "default"
    name: str = "default"
    hf_path: Optional[str] = None
    backend: Literal["megatron", "sglang", "hf"] = "megatron"
    # backend=megatron: equal to the student's parallel sizes, the teacher shares megatron's groups; different
    # (their product dividing the world), it gets its own layout over the same ranks (docs/design.md)
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    server_url: Optional[str] = None  # SGLang teacher server, e.g. http://127.0.0.1:30001
    # a teacher given only by server_url: a local copy of its tokenizer + config files, for the preflight
    tokenizer_path: Optional[str] = None
    top_k: int = 0  # >0: also return the teacher's top-k log-probs (for forward-KL golden loss)
    # sequences per teacher forward; null: train.micro_batch_size for a megatron teacher in the student's
    # layout (it scores beside the student's micro-batches), 8 for the others
    micro_batch_size: Optional[int] = None
    # an in-process (megatron or hf) teacher's weights (auto: as model.params_dtype's auto); log-softmax is fp32 either way
    params_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # an in-process megatron teacher's weights wait in host memory between scoring phases (colocated GPUs:
    # frees 2·P/(TP·PP) bytes per GPU for training and rollout, for one host<->device copy per step)
    offload: bool = False
    api_key_env: str = "SGLANG_API_KEY"  # env var holding the SGLang server's --api-key ("" / unset: none)
    retries: int = 4  # SGLang teacher by URL: retries (exponential backoff) on connection errors / HTTP 5xx
    # Extra SGLang ServerArgs for a teacher server the trainer launches (no teacher.server_url), e.g.
    # {tp_size: 2} or, on a CPU machine, {device: cpu, attention_backend: torch_native, dtype: float32,
    # disable_cuda_graph: true, mem_fraction_static: 0.05}; passed as --key-with-dashes value (true: bare flag).
    sglang_args: dict[str, Any] = field(default_factory=dict)
    # at train start (teacher/fidelity.py): tokenizers, special tokens, chat template, EOS ids and the golden
    # data's end token of student and teacher must agree; "error" stops before any model loads, "warn" logs.
    preflight: Literal["error", "warn", "off"] = "error"
    # the teacher's log-probs are those of softmax(logits / temperature) (1: its own distribution); in-process
    # teachers (megatron, hf) only: an SGLang server's prefill log-probs are at temperature 1
    temperature: float = 1.0
    # a teacher whose tokenizer is not the student's (backend hf or sglang): each response is re-rendered in the
    # teacher's chat template and tokens, aligned into chunks by bytes, and each chunk's teacher log-prob spread
    # over its student tokens (teacher/cross_tokenizer.py); the preflight then checks that the templates render
    cross_tokenizer: bool = False


@dataclass
class TeacherRouteConfig:
    """Which of `teachers:` scores a prompt: the prompt record's `field` (e.g. `teacher: math`), its value
    mapped by `map` (value -> teacher name; a value absent from `map` is itself a teacher name), else `default`."""

    field: Optional[str] = None
    map: dict[str, Any] = dataclasses.field(default_factory=dict)
    default: Optional[str] = None


@dataclass
class RolloutConfig:
    backend: Literal["local", "sglang"] = "local"
    sglang_mode: Literal["engine", "server"] = "engine"
    server_url: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = 30000
    mem_fraction_static: float = 0.5
    n_samples_per_prompt: int = 4
    max_new_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # top_p < 1 / top_k > 0 sample from a truncated distribution the trainer cannot reproduce (its
    # pi_old / pi_theta are softmax(logits / temperature) over the whole vocabulary): rejected unless
    # this is true, which then only warns.
    allow_truncated_sampling: bool = False
    seed: int = 1234
    # backend=local: torch threads while decoding, restored afterwards. 0 (auto): torch's own, dropping to
    # one thread when a decode step stalls (> 3x the call's fastest: another process took a core; two threads
    # then ran 5-10x slower than one on a 2-core host); rollout/local.py STALL_*
    # step 1: the engine's behaviour log-probs against the trainer's pi_old on the same tokens; a mean
    # |difference| above max_engine_logp_absdiff is an error / a warning (dtype, unsynced weights, sampling)
    parity_check: Literal["error", "warn", "off"] = "error"
    max_engine_logp_absdiff: float = 0.1
    num_threads: int = 0
    # backend=local on a CPU: decode from oneDNN-packed copies of the weights (rollout/packed.py): 1.6x faster
    # decode on the Qwen2.5 0.5B student (docs/benchmarks.md). Off by default: with it, the 2-node torchrun
    # kill-and-resume test (tests/test_torchrun_multinode.py) ended with metrics ~1e-4 off the uninterrupted
    # run's in 6 of 16 runs (never in 7 without it; cause not found), so runs are not bitwise repeatable
    pack_weights: bool = False
    # backend=local, HF Llama / Qwen2 students: decode with rollout/lean.py's step (the HF forward's math in a
    # quarter of its ops: fused q/k/v and gate/up GEMMs, a preallocated KV cache, one SDPA per layer) instead
    # of HF's forward; prefill stays HF's. HF's tokens, its log-probs to fp32 rounding (bit for bit on torch
    # 2.13 + transformers 5.24; tested). An unsupported model is an error naming this key. Off by default
    # (setting D of the reproduction was fixed without it); measured in docs/benchmarks.md
    lean_decode: bool = False
    # One-step off-policy: generate step t+1's rollouts on a background thread (weights of step t) while step t
    # trains, as slime/verl's async modes do. pi_old for those rollouts is the engine's behaviour log-probs, so
    # the clipped importance ratio corrects the one-step staleness (rollout/staleness reports it). Pays off
    # when generation and training do not share compute (GPUs, a server engine); measured on CPU in the README.
    overlap: bool = False
    # backend=local: the engine's weights. "auto": the student's params_dtype. bfloat16 with an fp32 student
    # decodes ~2x faster on CPUs with bf16 GEMMs and on GPUs; sampling and log-probs stay fp32, pi_old is
    # the trainer's, and rollout/engine_trainer_logp_absdiff reports the gap
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    sync_bucket_mb: int = 512
    colocate: bool = True
    api_key_env: str = "SGLANG_API_KEY"  # env var holding the SGLang server's --api-key ("" / unset: none)
    weight_sync_timeout: float = 600.0  # s; bound on each weight-group rendezvous / broadcast (refusal -> error)
    # Extra SGLang ServerArgs for an engine / server the trainer starts (not used with rollout.server_url):
    # sglang.Engine keyword arguments in engine mode, --key-with-dashes value in server mode (true: bare flag).
    # E.g. {tp_size: 2}; on a CPU machine {device: cpu, attention_backend: torch_native, dtype: float32,
    # disable_cuda_graph: true}. rollout.mem_fraction_static is passed separately.
    sglang_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class AlgoConfig:
    """Stable-OPD objective. See docs/algorithm.md for the exact formulas."""

    preset: Literal["opd", "opd_kl", "stable_opd", "custom"] = "stable_opd"
    # advantage A_t = logp_teacher - logp_old
    adv_clip: Optional[float] = None  # clamp |A_t| <= adv_clip
    adv_normalize: bool = False  # whiten over valid rollout tokens
    adv_gamma: Optional[float] = None  # None: per-token; else discounted sum of future A
    mask_truncated: bool = False  # zero the policy loss of samples without EOS
    # PPO
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: Optional[float] = None  # e.g. 3.0; must be > 1
    loss_agg_mode: Literal["token_mean", "seq_mean_token_mean", "seq_sum_const"] = "token_mean"
    loss_agg_constant: Optional[float] = None  # normaliser for seq_sum_const; default max response length
    ppo_epochs: int = 1
    num_minibatches: int = 1
    # reference KL
    beta_kl: float = 0.0
    kl_estimator: Literal["full", "k1", "k2", "k3", "k3+"] = "full"  # grads: docs/algorithm.md (k2, k3+: of KL(pi||ref))
    kl_chunk_size: int = 1024
    kl_clamp: float = 10.0
    # mixture distillation
    lambda_gold: float = 0.0
    mixture_ratio: float = 0.0  # fraction of samples in each minibatch that are golden solutions
    golden_loss: Literal["sft", "fkl_topk"] = "sft"


@dataclass
class DataConfig:
    train_path: Optional[str] = None  # JSONL / Parquet / local HF dataset dir
    prompt_key: str = "problem"
    answer_key: str = "answer"
    solution_key: str = "solution"
    # the golden assistant turn: {solution} is the solution field, {answer} the answer field, any other {name} a
    # field of the row. Solutions that never state their answer as the prompt asks (GSM8K's rationales end in a
    # sentence, not a box) get it appended, e.g. "{solution}\nThe answer is $\\boxed{{{answer}}}$."
    solution_template: str = "{solution}"
    prompt_template: str = "{problem}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}."
    apply_chat_template: bool = True
    max_prompt_tokens: int = 512
    on_bad_record: Literal["skip", "error"] = "skip"
    eval_paths: list[str] = field(default_factory=list)
    # the first N problems of each eval set, in file order (null: all): a held-out check every few steps that
    # costs minutes, not the hours a full GSM8K test pass takes on a CPU
    eval_limit: Optional[int] = None
    shuffle: bool = True


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    warmup_steps: int = 0  # optimizer steps: train.steps x algo.ppo_epochs x algo.num_minibatches in a run
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = True
    # Adam's moments stored in bf16 and updated in fp32, 4 B/param less (models/lowp_adam.py): the memory lever
    # of a host where megatron runs torch's AdamW (no TE/apex, e.g. a CPU). Under TE's FusedAdam this is
    # megatron's use_precision_aware_optimizer, not wired here: bfloat16 there is an error naming the key
    exp_avg_dtype: Literal["float32", "bfloat16"] = "float32"
    exp_avg_sq_dtype: Literal["float32", "bfloat16"] = "float32"


@dataclass
class LoggingConfig:
    out_dir: str = "runs/default"
    tensorboard: bool = True
    jsonl: bool = True
    log_every: int = 1
    sample_every: int = 10
    progress_bar: bool = True


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # default: <logging.out_dir>/checkpoints
    save_every: int = 50
    keep_last: int = 3
    resume: Literal["auto", "never"] = "auto"
    # at the end of a run: the student as an HF directory, <logging.out_dir>/hf (for eval, serving, the next run)
    export_hf: bool = True


@dataclass
class TrainConfig:
    steps: int = 100
    prompts_per_step: int = 32
    micro_batch_size: int = 4
    # dynamic batching: micro-batches (training, and the student/reference/teacher scoring passes) are
    # formed by length up to this many padded tokens (rows x longest row) instead of micro_batch_size rows;
    # the loss normalisation is unchanged (null: fixed micro_batch_size; docs/scaling.md)
    max_tokens_per_microbatch: Optional[int] = None
    # packing: rows share sequences of up to max_tokens_per_microbatch tokens, attention kept within each row
    # (THD on Transformer Engine, a block-diagonal causal mask on the local spec); training and the student,
    # reference and teacher scoring passes (docs/scaling.md)
    pack_sequences: bool = False
    # pi_old from the training forward (detached) when a step makes exactly one update: ppo_epochs=1, one
    # minibatch, no adv_normalize, no dropout (trainer/learner.py `reuse_old_logp`); saves a student forward
    reuse_old_logp: bool = True
    seed: int = 42
    eval_every: int = 0  # evaluate every N steps and after the last step (0: off)
    # with eval_every > 0: evaluate the initial student too, logged at step 0 (the starting point of every curve)
    eval_before_train: bool = True
    collapse_action: Literal["warn", "stop", "raise_beta_kl", "rollback"] = "warn"
    max_rollbacks: int = 3  # collapse_action=rollback: one more collapse after this many stops the run
    # the collapse detector's thresholds and windows (megatron_opd/metrics/collapse.py documents each rule)
    collapse: CollapseConfig = field(default_factory=CollapseConfig)
    # the repetition detectors' thresholds (megatron_opd/metrics/health.py): the defaults are the paper's, made
    # for responses of thousands of tokens; short length budgets need them scaled (docs/reproduction.md)
    health: HealthConfig = field(default_factory=HealthConfig)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    # several teachers, each prompt scored by the one teacher_route picks (docs/usage.md "Several teachers");
    # exclusive with `teacher:`. When set, `teacher` is teachers[0] (code that knows one teacher sees the first)
    teachers: list[TeacherConfig] = field(default_factory=list)
    teacher_route: TeacherRouteConfig = field(default_factory=TeacherRouteConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def all_teachers(self) -> list[TeacherConfig]:
        """The teachers of this run: `teachers:`, or the one `teacher:` block."""
        return list(self.teachers) if self.teachers else [self.teacher]

    def teacher_key(self, i: int) -> str:
        """The dotted config key of teacher i, for messages: `teachers[i]` or `teacher`."""
        return f"teachers[{i}]" if self.teachers else "teacher"


PRESETS: dict[str, dict[str, Any]] = {
    # The paper's ablation rows. Values are the defaults a preset fills in; explicit keys win.
    "opd": {"beta_kl": 0.0, "lambda_gold": 0.0, "mixture_ratio": 0.0},
    "opd_kl": {"beta_kl": 0.01, "lambda_gold": 0.0, "mixture_ratio": 0.0},
    "stable_opd": {"beta_kl": 0.01, "lambda_gold": 1.0, "mixture_ratio": 0.25},
}


# ---------------------------------------------------------------------------------------------
# type checking / coercion


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in get_args(tp))
    if origin is Literal:
        return f"one of {list(get_args(tp))}"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return `value` as type `tp` or raise ConfigError naming `key`. Ints are accepted for floats."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        choices = get_args(tp)
        if isinstance(value, bool) and ("off" if value is False else "on") in choices:
            value = "off" if value is False else "on"  # YAML 1.1 reads a bare off / on as a boolean
        if value not in choices:
            raise ConfigError(f"{key}: must be one of {list(choices)}, got {value!r}")
        return value
    if origin is list:
        (item_tp,) = get_args(tp) or (Any,)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        # dotted overrides into a mapping (rollout.sglang_args.tp_size=2) arrive as _RawOverride values
        return {k: (v.parsed if isinstance(v, _RawOverride) else v) for k, v in value.items()}
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):  # an entry of a list of sections (teachers:)
        obj = tp()
        _apply(obj, value.parsed if isinstance(value, _RawOverride) else value, key + ".")
        return obj
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected bool (true/false), got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected int, got {value!r}")
    if tp is float:
        if isinstance(value, str):
            # PyYAML (YAML 1.1) reads `1e-6` (no dot) as a string; accept numeric strings for float fields.
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected float, got {value!r}") from None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if math.isnan(value):
                raise ConfigError(f"{key}: expected a number, got NaN")
            return float(value)
        raise ConfigError(f"{key}: expected float, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected str, got {value!r}")
    raise ConfigError(f"{key}: unsupported field type {_type_name(tp)}")


def _section_types(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _apply(obj: Any, data: dict[str, Any], prefix: str) -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or '<root>'}: expected a mapping, got {data!r}")
    hints = _section_types(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if k not in names:
            raise ConfigError(f"{key}: unknown key (known: {', '.join(sorted(names))})")
        tp = hints[k]
        current = getattr(obj, k)
        if dataclasses.is_dataclass(current):
            _apply(current, v.parsed if isinstance(v, _RawOverride) else v, key + ".")
        else:
            if isinstance(v, _RawOverride):
                v = v.raw if _accepts_str(tp) and _str_wanted(tp, v.parsed) else v.parsed
            if isinstance(v, _Unparsable):
                raise ConfigError(f"{key}: cannot parse value {v.text!r}: {v.error}")
            setattr(obj, k, _expand_user(k, _coerce(v, tp, key)))


# path keys whose `~` / `~user` is the home directory, as in a shell (the example configs name the model cache)
PATH_KEYS = {"hf_path", "tokenizer_path", "train_path", "eval_paths", "out_dir", "dir"}


def _expand_user(key: str, value: Any) -> Any:
    if key not in PATH_KEYS:
        return value
    if isinstance(value, str):
        return os.path.expanduser(value)
    if isinstance(value, list):
        return [os.path.expanduser(v) if isinstance(v, str) else v for v in value]
    return value


@dataclass
class _Unparsable:
    text: str
    error: str


@dataclass
class _RawOverride:
    """A CLI value as typed and as YAML-parsed: a str field takes the text as typed (so a prompt
    template like `{problem}` is not read as a YAML mapping)."""

    raw: str
    parsed: Any


def _accepts_str(tp: Any) -> bool:
    if tp is str:
        return True
    return get_origin(tp) in (Union, types.UnionType) and str in get_args(tp)


def _str_wanted(tp: Any, parsed: Any) -> bool:
    """A str field typed `123`, `2024`, `true` or `{problem}` on the command line means that text (a path, a
    template), unless the field also takes that parsed type."""
    if isinstance(parsed, (dict, list, _Unparsable)):
        return True
    if parsed is None or isinstance(parsed, str):
        return False
    args = get_args(tp) if get_origin(tp) in (Union, types.UnionType) else (tp,)
    return not any(isinstance(a, type) and isinstance(parsed, a) for a in args if a not in (str, type(None)))


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value, e.g. algo.beta_kl=0.01")
    key, raw = item.split("=", 1)
    key = key.strip().lstrip("-")
    if not key:
        raise ConfigError(f"override {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else ""
    except yaml.YAMLError as e:
        value = _Unparsable(raw, str(e).splitlines()[0])
    return key.split("."), _RawOverride(raw, value)


def _nest(path: list[str], value: Any) -> dict[str, Any]:
    out: dict[str, Any] = value
    for part in reversed(path):
        out = {part: out}
    return out


def _deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        prev = out.get(k)
        if isinstance(prev, _RawOverride) and isinstance(prev.parsed, dict) and isinstance(v, dict):
            prev = prev.parsed  # `x={a: 1}` then `x.b=2`: both keys
        if isinstance(v, dict) and isinstance(prev, dict):
            out[k] = _deep_merge(prev, v)
        else:
            out[k] = v
    return out


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """A YAML file whose top level is a mapping (an empty file is {}); ConfigError names the file otherwise."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p}: not found")
    try:
        loaded = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p}: invalid YAML: {e}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {p}: top level must be a mapping")
    return loaded


def load_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None,
                defaults: Optional[list[str]] = None) -> Config:
    """Build a Config from an optional YAML file plus dotted `key=value` overrides, then validate.

    The algorithm preset fills in its defaults for keys that neither the YAML nor an override set; a
    preset given as an override also replaces the YAML's values of its keys (only other overrides beat it).
    `defaults` (dotted `key=value`, a command's own defaults such as `sft`'s learning rate) sit below the YAML.
    """
    data: dict[str, Any] = read_yaml_mapping(path) if path is not None else {}
    cli: dict[str, Any] = {}
    for item in overrides or []:
        keys, value = _parse_override(item)
        cli = _deep_merge(cli, _nest(keys, value))
    for item in reversed(defaults or []):
        keys, value = _parse_override(item)
        data = _deep_merge(_nest(keys, value), data)
    if ("teacher" in data or "teacher" in cli) and ("teachers" in data or "teachers" in cli):
        raise ConfigError("teacher, teachers: give one teacher as `teacher:` or several as `teachers:`, not both")
    cfg = Config()
    cli_algo = cli.get("algo") if isinstance(cli.get("algo"), dict) else {}
    preset_on_cli = "preset" in cli_algo
    data = _deep_merge(data, cli) if not preset_on_cli else data
    algo = cli_algo if preset_on_cli else (data.get("algo") if isinstance(data.get("algo"), dict) else {})
    preset = algo.get("preset", cfg.algo.preset)
    preset = preset.parsed if isinstance(preset, _RawOverride) else preset
    if preset in PRESETS:
        if preset_on_cli:  # `algo.preset=opd` on the command line means opd, whatever the YAML's algo values
            data = _deep_merge(_deep_merge(data, {"algo": PRESETS[preset]}), cli)
        else:
            data = _deep_merge({"algo": PRESETS[preset]}, data)
    elif preset_on_cli:
        data = _deep_merge(data, cli)
    _apply(cfg, data, "")
    if cfg.teachers:
        cfg.teacher = cfg.teachers[0]
    validate(cfg)
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain data that `load_config` reads back: `teacher` or `teachers`, never both."""
    out = dataclasses.asdict(cfg)
    out.pop("teacher" if cfg.teachers else "teachers")
    return out


def validate(cfg: Config) -> None:
    """Cross-field checks. Each failure names the key; the first one found is raised."""

    def need(cond: bool, key: str, msg: str) -> None:
        if not cond:
            raise ConfigError(f"{key}: {msg}")

    a, r, p, o, t = cfg.algo, cfg.rollout, cfg.parallel, cfg.optim, cfg.train
    need(cfg.model.megatron_ckpt is None, "model.megatron_ckpt",
         "is not supported (it was never read): convert the checkpoint with `megatron-opd convert mcore-to-hf` "
         "and set model.hf_path")
    need(0.0 <= a.mixture_ratio <= 1.0, "algo.mixture_ratio", f"must be in [0, 1], got {a.mixture_ratio}")
    need(a.beta_kl >= 0, "algo.beta_kl", f"must be >= 0, got {a.beta_kl}")
    need(a.lambda_gold >= 0, "algo.lambda_gold", f"must be >= 0, got {a.lambda_gold}")
    need(a.clip_eps_low >= 0 and a.clip_eps_low < 1, "algo.clip_eps_low", f"must be in [0, 1), got {a.clip_eps_low}")
    need(a.clip_eps_high >= 0, "algo.clip_eps_high", f"must be >= 0, got {a.clip_eps_high}")
    need(a.dual_clip_c is None or a.dual_clip_c > 1, "algo.dual_clip_c", f"must be > 1, got {a.dual_clip_c}")
    need(a.adv_clip is None or a.adv_clip > 0, "algo.adv_clip", f"must be > 0, got {a.adv_clip}")
    need(a.adv_gamma is None or 0 <= a.adv_gamma <= 1, "algo.adv_gamma", f"must be in [0, 1], got {a.adv_gamma}")
    need(a.kl_chunk_size >= 1, "algo.kl_chunk_size", f"must be >= 1, got {a.kl_chunk_size}")
    need(a.kl_clamp > 0, "algo.kl_clamp", f"must be > 0, got {a.kl_clamp}")
    need(a.loss_agg_constant is None or a.loss_agg_constant > 0, "algo.loss_agg_constant", "must be > 0")
    need(a.ppo_epochs >= 1, "algo.ppo_epochs", f"must be >= 1, got {a.ppo_epochs}")
    need(a.num_minibatches >= 1, "algo.num_minibatches", f"must be >= 1, got {a.num_minibatches}")
    need(not (a.mixture_ratio > 0 and a.lambda_gold == 0), "algo.lambda_gold",
         "is 0 while algo.mixture_ratio > 0: golden samples would carry no loss")
    need(r.n_samples_per_prompt >= 1, "rollout.n_samples_per_prompt", "must be >= 1")
    need(r.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
    need(r.temperature > 0, "rollout.temperature", f"must be > 0, got {r.temperature}")
    need(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    need(r.top_k == -1 or r.top_k >= 1, "rollout.top_k", f"must be -1 (off) or >= 1, got {r.top_k}")
    truncated = [f"rollout.{k}={v}" for k, v, on in (("top_p", r.top_p, r.top_p < 1), ("top_k", r.top_k, r.top_k > 0))
                 if on]
    if truncated:
        msg = (f"{' and '.join(truncated)} samples from a truncated distribution, but the trainer's pi_old / "
               "pi_theta are the full softmax(logits / rollout.temperature): the PPO ratio, the advantage "
               "and the reference KL would be computed for a policy other than the behaviour policy")
        need(r.allow_truncated_sampling, truncated[0].split("=")[0],
             f"{msg}. Use top_p=1.0 and top_k=-1, or set rollout.allow_truncated_sampling=true to accept the mismatch")
        logging.getLogger("megatron_opd.config").warning("%s (accepted: rollout.allow_truncated_sampling=true)", msg)
    need(r.num_threads >= 0, "rollout.num_threads", f"must be >= 0 (0: auto), got {r.num_threads}")
    need(1 <= r.port <= 65535, "rollout.port", f"must be a TCP port, got {r.port}")
    need(r.max_engine_logp_absdiff > 0, "rollout.max_engine_logp_absdiff",
         f"must be > 0, got {r.max_engine_logp_absdiff}")
    need(0 < r.mem_fraction_static < 1, "rollout.mem_fraction_static", "must be in (0, 1)")
    for key, size in (("parallel.tensor_model_parallel_size", p.tensor_model_parallel_size),
                      ("parallel.pipeline_model_parallel_size", p.pipeline_model_parallel_size),
):
        need(size >= 1, key, f"must be >= 1, got {size}")
    m, tp = cfg.model, p.tensor_model_parallel_size
    if m.num_attention_heads is not None:
        need(m.num_attention_heads % tp == 0, "parallel.tensor_model_parallel_size",
             f"{tp} does not divide model.num_attention_heads={m.num_attention_heads}")
    if m.num_query_groups is not None:
        need(m.num_query_groups % tp == 0, "parallel.tensor_model_parallel_size",
             f"{tp} does not divide model.num_query_groups={m.num_query_groups}")
    if m.num_layers is not None:
        need(m.num_layers % p.pipeline_model_parallel_size == 0, "parallel.pipeline_model_parallel_size",
             f"{p.pipeline_model_parallel_size} does not divide model.num_layers={m.num_layers}")
    need(not (p.sequence_parallel and tp == 1), "parallel.sequence_parallel", "needs tensor_model_parallel_size > 1")
    need(m.fp8 is None or m.layer_spec != "local", "model.fp8", "needs the Transformer Engine layer spec (model.layer_spec=te|auto)")
    need(o.lr >= 0, "optim.lr", f"must be >= 0, got {o.lr}")
    need(0 <= o.min_lr <= max(o.lr, 0), "optim.min_lr", f"must be in [0, optim.lr], got {o.min_lr}")
    need(o.clip_grad >= 0, "optim.clip_grad", f"must be >= 0, got {o.clip_grad}")
    need(t.steps >= 0, "train.steps", f"must be >= 0, got {t.steps}")
    need(t.prompts_per_step >= 1, "train.prompts_per_step", "must be >= 1")
    need(t.micro_batch_size >= 1, "train.micro_batch_size", "must be >= 1")
    need(t.max_tokens_per_microbatch is None or t.max_tokens_per_microbatch >= 2, "train.max_tokens_per_microbatch",
         f"must be >= 2 (or null), got {t.max_tokens_per_microbatch}")
    need(not t.pack_sequences or t.max_tokens_per_microbatch is not None, "train.pack_sequences",
         "needs train.max_tokens_per_microbatch (the packed sequences' length)")
    need(t.max_rollbacks >= 0, "train.max_rollbacks", f"must be >= 0, got {t.max_rollbacks}")
    need(cfg.checkpoint.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")
    need(cfg.checkpoint.save_every >= 1, "checkpoint.save_every", "must be >= 1")
    need(cfg.logging.log_every >= 1, "logging.log_every", "must be >= 1")
    need(cfg.logging.sample_every >= 0, "logging.sample_every", "must be >= 0 (0: off)")
    need(t.eval_every >= 0, "train.eval_every", "must be >= 0 (0: off)")
    need("{solution}" in cfg.data.solution_template, "data.solution_template",
         f"must contain {{solution}} (the solution field), got {cfg.data.solution_template!r}")
    need(cfg.data.eval_limit is None or cfg.data.eval_limit >= 1, "data.eval_limit",
         f"must be >= 1 or null (all), got {cfg.data.eval_limit}")
    for section in ("collapse", "health"):
        sub = getattr(t, section)
        try:
            dataclasses.replace(sub)  # re-runs the section's own checks on the loaded values
        except ValueError as e:
            raise ConfigError(str(e).replace(f"{type(sub).__name__}.", f"train.{section}.", 1)) from None
    need(cfg.data.max_prompt_tokens >= 1, "data.max_prompt_tokens", "must be >= 1")
    need(not (r.backend == "sglang" and r.server_url is not None and r.sglang_mode == "engine"), "rollout.server_url",
         f"{r.server_url!r} is a server to attach to, but rollout.sglang_mode=engine starts an in-process engine: "
         "set rollout.sglang_mode=server (or drop rollout.server_url)")
    if r.backend == "sglang" and r.colocate and r.server_url is not None:
        host = urlparse(r.server_url).hostname
        need(host in ("127.0.0.1", "localhost", "::1"), "rollout.colocate",
             f"true syncs weights as same-machine tensor handles, but rollout.server_url={r.server_url!r} is on "
             "another host: set rollout.colocate=false (weights over init_weights_update_group)")
    for key, url in (("rollout.server_url", r.server_url),):
        need(url is None or url.startswith(("http://", "https://")), key, f"must be an http(s):// URL, got {url!r}")
    for key, var in (("rollout.api_key_env", r.api_key_env),):
        need(var == "" or (var.replace("_", "a").isalnum() and var.isascii() and not var[0].isdigit()), key,
             f"must name an environment variable (or be empty for no key), got {var!r}; keys are never put in configs")
    need(r.weight_sync_timeout > 0, "rollout.weight_sync_timeout", f"must be > 0 seconds, got {r.weight_sync_timeout}")
    bad = [k for k in r.sglang_args if not (isinstance(k, str) and k.replace("_", "a").isalnum())]
    need(not bad, "rollout.sglang_args", f"keys must be SGLang ServerArgs names (e.g. tp_size), got {bad}")
    need("mem_fraction_static" not in r.sglang_args, "rollout.sglang_args",
         "set rollout.mem_fraction_static instead of rollout.sglang_args.mem_fraction_static")
    for i, tc in enumerate(cfg.all_teachers()):
        _validate_teacher(cfg, tc, cfg.teacher_key(i), need)
    _validate_route(cfg, need)


def _validate_teacher(cfg: Config, t: TeacherConfig, pre: str, need: Any) -> None:
    """One teacher's checks; `pre` is its dotted key (`teacher` or `teachers[i]`)."""
    a = cfg.algo
    need(not (a.golden_loss == "fkl_topk" and a.lambda_gold > 0 and t.top_k <= 0), f"{pre}.top_k",
         "must be > 0 when algo.golden_loss=fkl_topk")
    need(not (t.offload and t.backend != "megatron"), f"{pre}.offload",
         f"parks an in-process megatron teacher's weights; {pre}.backend={t.backend} holds none here")
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        size = getattr(t, key)
        need(size >= 1, f"{pre}.{key}", f"must be >= 1, got {size}")
    need(t.top_k >= 0, f"{pre}.top_k", "must be >= 0")
    need(t.micro_batch_size is None or t.micro_batch_size >= 1, f"{pre}.micro_batch_size", "must be >= 1 (or null)")
    need(t.server_url is None or t.server_url.startswith(("http://", "https://")), f"{pre}.server_url",
         f"must be an http(s):// URL, got {t.server_url!r}")
    var = t.api_key_env
    need(var == "" or (var.replace("_", "a").isalnum() and var.isascii() and not var[0].isdigit()),
         f"{pre}.api_key_env",
         f"must name an environment variable (or be empty for no key), got {var!r}; keys are never put in configs")
    bad = [k for k in t.sglang_args if not (isinstance(k, str) and k.replace("_", "a").isalnum())]
    need(not bad, f"{pre}.sglang_args", f"keys must be SGLang ServerArgs names (e.g. tp_size), got {bad}")
    need(t.retries >= 0, f"{pre}.retries", f"must be >= 0, got {t.retries}")
    if t.backend == "sglang":
        need(t.server_url is not None or t.hf_path is not None, f"{pre}.server_url",
             f"{pre}.backend=sglang needs {pre}.server_url or {pre}.hf_path")
    need(t.temperature > 0, f"{pre}.temperature", f"must be > 0, got {t.temperature}")
    need(t.temperature == 1.0 or t.backend != "sglang", f"{pre}.temperature",
         f"{t.temperature} needs an in-process teacher (backend megatron or hf): an SGLang server's prefill "
         "log-probs are at temperature 1")
    if t.cross_tokenizer:
        need(t.backend in ("hf", "sglang"), f"{pre}.cross_tokenizer",
             f"needs {pre}.backend hf or sglang (a megatron teacher scores inside the student's batch, in the "
             f"student's ids), got {t.backend}")
        need(t.top_k == 0, f"{pre}.top_k", f"must be 0 with {pre}.cross_tokenizer: a teacher's top-k over another "
             "vocabulary has no student ids (algo.golden_loss=fkl_topk needs the student's tokenizer)")
        need(t.hf_path is not None or t.tokenizer_path is not None, f"{pre}.tokenizer_path",
             f"{pre}.cross_tokenizer needs the teacher's tokenizer: set {pre}.hf_path or {pre}.tokenizer_path")
    need(bool(t.name) and t.name.replace("_", "a").replace("-", "a").replace(".", "a").isalnum(), f"{pre}.name",
         f"must be a non-empty name of letters, digits, '_', '-', '.' (it names metrics), got {t.name!r}")


def _validate_route(cfg: Config, need: Any) -> None:
    """teachers: unique names; teacher_route: only with several teachers, naming teachers that exist."""
    names = [t.name for t in cfg.all_teachers()]
    dup = sorted({n for n in names if names.count(n) > 1})
    need(not dup, f"teachers[{len(names) - 1 - names[::-1].index(dup[0])}].name" if dup else "teachers",
         f"duplicate teacher name(s) {dup}: each teacher needs its own name")
    a = cfg.algo
    if a.golden_loss == "fkl_topk" and a.lambda_gold > 0:
        ks = [t.top_k for t in cfg.all_teachers()]
        need(len(set(ks)) == 1, f"teachers[{ks.index(max(ks))}].top_k",
             f"every teacher's top_k must be equal for algo.golden_loss=fkl_topk (one [B, T, K] target), got {ks}")
    route = cfg.teacher_route
    for value, name in route.map.items():
        need(isinstance(name, str) and name in names, f"teacher_route.map.{value}",
             f"names no teacher: {name!r} (teachers: {names})")
    need(route.default is None or route.default in names, "teacher_route.default",
         f"names no teacher: {route.default!r} (teachers: {names})")
    need(not route.map or route.field is not None, "teacher_route.field",
         "is not set, but teacher_route.map is: which prompt field holds the routed value?")
    need(len(names) == 1 or route.field is not None or route.default is not None, "teacher_route",
         f"{len(names)} teachers but no teacher_route.field or teacher_route.default: which teacher scores a prompt?")


def dump_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


__all__ = [
    "AlgoConfig", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "LoggingConfig", "ModelConfig",
    "OptimConfig", "PRESETS", "ParallelConfig", "RolloutConfig", "TeacherConfig", "TeacherRouteConfig", "TrainConfig",
    "config_to_dict", "dump_config", "load_config", "validate",
]
_ = typing  # keep import for get_type_hints on postponed annotations
