"""TEST SUPPORT ONLY: a stand-in for `sgl_kernel` so that real SGLang 0.5.23 runs on a CPU test machine.

PyPI has no CPU build of sgl-kernel. With SGLANG_USE_CPU_ENGINE=1, SGLang imports a few `sgl_kernel` names
at module level (these 8 names); a logging stand-in showed that none is called for dense Llama/Qwen2 with
attention_backend=torch_native. `assign_req_to_token_pool_cpu`, the one on the CPU allocation path, is
implemented in pure torch anyway (the semantics of SGLang's Triton kernel `assign_req_to_token_pool`); every
other name raises NotImplementedError if called. tests/sglang_cpu.py puts this folder on the path only on machines without
CUDA and without a real sgl_kernel; it must never shadow a real one.
"""

__version__ = "0.0.0+megatron-opd-cpu-test-standin"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len=None):
    """req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = the i-th consecutive slice of
    out_cache_loc (slices laid out back to back in batch order)."""
    pos = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        req_to_token[req, start:end] = out_cache_loc[pos:pos + n].to(req_to_token.dtype)
        pos += n


def _not_on_cpu(name):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: not available in megatron-opd's CPU test stand-in "
                                  "(tests/support/sgl_kernel_cpu); install a real sgl-kernel")
    fn.__name__ = name
    return fn


# imported at module level by SGLang 0.5.23's CPU engine (KV-cache copy, speculative decoding); never called
# for dense models without speculative decoding
for _name in ("copy_all_layer_kv_cache_cpu", "assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",
              "build_tree_kernel_efficient_cpu", "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu",
              "verify_tree_greedy_cpu"):
    globals()[_name] = _not_on_cpu(_name)
del _name
