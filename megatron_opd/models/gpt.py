"""Build megatron-core ``GPTModel`` instances from an HF config.

Why GPTModel: megatron-core 0.19 deprecates GPTModel in favour of HybridModel, but we support 0.16.x
(the newest that runs on python 3.11), which has no HybridModel, through 0.19, and HybridModel has
no CPU (non-TE) stack spec and no Llama-3 RoPE scaling (docs/design.md, "GPTModel and HybridModel").
GPTModel exactly matches Qwen2/Llama; 0.19's deprecation notice is dropped while we build one.
Layer spec: the local (pure megatron-core) spec on CPU, the Transformer Engine spec on GPU (TE is
imported lazily: it does not build without CUDA). FP8 is TE-only and opt-in.

Call ``init_parallel`` first: the model's TP/PP shards come from megatron's parallel state.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Literal, Optional

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                      get_gpt_layer_with_transformer_engine_spec)

from megatron_opd.models.hf_config import transformer_config_from_hf

LayerSpec = Literal["auto", "local", "te"]

# megatron-core 0.19 logs this (WARNING, logger of megatron/core/models/gpt/gpt_model.py) at every
# GPTModel construction. We build GPTModel on purpose, so the record is dropped, and only while
# build_gpt_model constructs the model; every other record of that logger passes.
_GPT_LOGGER = "megatron.core.models.gpt.gpt_model"
_GPT_DEPRECATION = "GPTModel IS DEPRECATED"


class _DropGPTModelDeprecation(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_GPT_DEPRECATION)


@contextlib.contextmanager
def _quiet_gptmodel_deprecation() -> Iterator[None]:
    logger = logging.getLogger(_GPT_LOGGER)
    drop = _DropGPTModelDeprecation()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def resolve_layer_spec(layer_spec: LayerSpec, fp8: Optional[str] = None) -> Literal["local", "te"]:
    """'auto' -> TE on GPU, local on CPU. TE without CUDA, or FP8 without TE, is an error."""
    if layer_spec == "auto":
        layer_spec = "te" if torch.cuda.is_available() else "local"
    if layer_spec not in ("local", "te"):
        raise ValueError(f"model.layer_spec: must be auto, local or te, got {layer_spec!r}")
    if layer_spec == "te" and not torch.cuda.is_available():
        raise ValueError("model.layer_spec=te needs CUDA (Transformer Engine); use local on CPU")
    if fp8 is not None and layer_spec != "te":
        raise ValueError("model.fp8 needs the Transformer Engine layer spec (model.layer_spec=te|auto on GPU)")
    return layer_spec


def layer_spec_for(config: Any, layer_spec: Literal["local", "te"]) -> Any:
    """The megatron ModuleSpec for one decoder layer."""
    if layer_spec == "te":
        try:
            import transformer_engine  # noqa: F401
        except ImportError as e:
            raise ImportError("model.layer_spec=te needs transformer_engine installed") from e
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    return get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization=config.normalization)


def build_gpt_model(
    hf_config: Any,
    *,
    tp: Optional[int] = None,
    pp: Optional[int] = None,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    layer_spec: LayerSpec = "auto",
    params_dtype: Optional[torch.dtype] = None,
    fp8: Optional[str] = None,
    sequence_parallel: bool = False,
    recompute_activations: bool | str = False,
    make_vocab_size_divisible_by: Optional[int] = None,
    config_overrides: Optional[dict[str, Any]] = None,
    layout: Optional[Any] = None,
) -> Any:
    """This rank's GPTModel shard for ``hf_config`` (randomly initialised; load weights separately).

    ``tp``/``pp`` default to (and must match) the initialised parallel state; ``pre_process`` /
    ``post_process`` default to whether this rank is the first / last pipeline stage. With ``layout``
    (`models.parallel.ModelLayout`, e.g. a teacher laid out differently from the student) the model uses
    that layout's sizes and process groups instead of megatron's global ones.
    The model is on the current CUDA device on GPU, on CPU otherwise. Its vocabulary is padded
    (``model.vocab_size``); ``model.hf_vocab_size`` is the real one.
    """
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("megatron parallel state is not initialised: call "
                           "megatron_opd.models.parallel.init_parallel(tp, pp) first")
    if layout is not None:
        cur_tp, cur_pp = layout.tp, layout.pp
    else:
        cur_tp = parallel_state.get_tensor_model_parallel_world_size()
        cur_pp = parallel_state.get_pipeline_model_parallel_world_size()
    tp = cur_tp if tp is None else tp
    pp = cur_pp if pp is None else pp
    if (tp, pp) != (cur_tp, cur_pp):
        raise ValueError(f"build_gpt_model(tp={tp}, pp={pp}) does not match the initialised parallel state "
                         f"(tp={cur_tp}, pp={cur_pp})")
    spec_name = resolve_layer_spec(layer_spec, fp8)
    config, gpt_kwargs = transformer_config_from_hf(
        hf_config, tp=tp, pp=pp, params_dtype=params_dtype, fp8=fp8, sequence_parallel=sequence_parallel,
        recompute_activations=recompute_activations, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        overrides=config_overrides)
    if pre_process is None:
        pre_process = layout.is_first_stage if layout is not None else parallel_state.is_pipeline_first_stage(
            ignore_virtual=True)
    if post_process is None:
        post_process = layout.is_last_stage if layout is not None else parallel_state.is_pipeline_last_stage(
            ignore_virtual=True)
    extra = {"pg_collection": layout.groups} if layout is not None else {}
    with _quiet_gptmodel_deprecation():
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec_for(config, spec_name),
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=True,
            **gpt_kwargs,
            **extra,
        )
    if config.params_dtype in (torch.bfloat16, torch.float16):
        _to_params_dtype(model, config.params_dtype)
    # The real vocabulary: logits columns >= this index are padding (see logprobs.py).
    model.hf_vocab_size = int(hf_config["vocab_size"] if isinstance(hf_config, dict) else hf_config.vocab_size)
    if torch.cuda.is_available():
        model = model.cuda(torch.cuda.current_device())
    return model


def _to_params_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every float parameter in `dtype`, as megatron's Float16Module makes them (megatron's training loop wraps
    half-precision models in it; we build the GPTModel directly). Without it the local spec's norms
    (WrappedTorchNorm: torch.nn.RMSNorm / LayerNorm, made in the default dtype) stayed fp32 in a bf16 model, and
    megatron's Float16OptimizerWithFloat16Params, which maps optimizer state to model tensors through its fp16
    groups only, failed every checkpoint save without the distributed optimizer ("Optimizer shape ((896,) does
    not match model shape ((1152,))", the Qwen2.5 0.5B at its first save). Transformer Engine's norms are made in
    params_dtype already."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype == torch.float32:
            p.data = p.data.to(dtype)


def build_forward_only_model(hf_config: Any, **kwargs: Any) -> Any:
    """A GPTModel for scoring only (reference policy, megatron teacher): eval mode, no grads.

    Same arguments as ``build_gpt_model``. Parameters have ``requires_grad=False`` so no grad buffers
    or optimizer state are ever allocated for them.
    """
    model = build_gpt_model(hf_config, **kwargs)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def no_init(tp_size: int) -> Optional[dict[str, bool]]:
    """TransformerConfig overrides for a model whose every weight is loaded from an HF checkpoint right after
    it is built (a missing one is an error): megatron's random init would only cost time (19 s for the 1.5B
    teacher on a 2-core CPU) and an fp32 master copy of each weight. Only at TP=1: megatron-core sets a
    tensor-parallel weight's `tensor_model_parallel` / `partition_dim` attributes inside its init functions
    (`_initialize_affine_weight_cpu/gpu`), so without them a TP>1 shard would count as a duplicate in the
    gradient norm (tests/test_trainer_dist.py caught it)."""
    return {"perform_initialization": False} if tp_size == 1 else None


def num_parameters(model: torch.nn.Module) -> int:
    """Parameters held by this rank (shared embedding/output weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


__all__ = ["build_forward_only_model", "build_gpt_model", "layer_spec_for", "no_init", "num_parameters",
           "resolve_layer_spec"]
