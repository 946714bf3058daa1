"""SGLang rollout backend: in-process `sglang.Engine` or a launched `sglang.launch_server` over HTTP.

sglang is imported lazily (it is not a dependency of the package). Token ids in, token ids out
(`skip_tokenizer_init`), so the trainer's tokenizer is the only one that matters.

Log-probs: `Sample.logprobs` are SGLang's `output_token_logprobs`. By default SGLang reports them
after temperature scaling and before top-k/top-p truncation (with SGLANG_RETURN_ORIGINAL_LOGPROB=1,
at temperature 1). They equal LocalEngine's `logprobs` when top-k/top-p are off. `raw_logprobs` is None.

Weight sync (HF-named tensors, bucketed, versioned like LocalEngine):
  * colocated, engine mode: `update_weights_from_tensor` per bucket, wrapped in
    `begin_weight_update()` / `end_weight_update()` where the SGLang version has them (0.5.23 needs it);
    `release_memory()` / `resume_memory()` free the KV cache and weights while the trainer runs.
  * colocated, server mode: POST /update_weights_from_tensor with SGLang's MultiprocessingSerializer
    (same machine only).
  * disaggregated: `init_weight_group` + `update_weights(..., via="distributed")` broadcasts each bucket from
    the trainer over a dedicated process group (NCCL on GPUs; gloo crashed SGLang 0.5.23's scheduler).
  * `update_weights_from_disk(path, version)`: reload from an HF directory (the fallback that works everywhere).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterable, Literal, Optional

import torch

from megatron_opd.rollout.base import Sample, SamplingParams, eos_ids_from, validate_sampling
from megatron_opd.rollout.server import ServerProcess, http_json, sglang_server_cmd


def import_sglang() -> Any:
    try:
        import sglang
    except ImportError as e:
        raise ImportError("rollout.backend=sglang needs the `sglang` package (pip install sglang); "
                          f"it is not importable here: {e}") from None
    return sglang


class SGLangOutputError(RuntimeError):
    """SGLang returned something that breaks the Sample contract (aborted, misaligned log-probs, ...)."""


def sglang_sampling_params(sp: SamplingParams, stop_ids: list[int], row_seed: Optional[int]) -> dict[str, Any]:
    out: dict[str, Any] = {"max_new_tokens": sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
                           "top_k": sp.top_k, "stop_token_ids": stop_ids, "no_stop_trim": True,
                           "skip_special_tokens": False}
    if row_seed is not None:
        out["sampling_seed"] = row_seed
    return out


def parse_sglang_output(out: dict, prompt_index: int, prompt: list[int], sp: SamplingParams, stop: set[int],
                        version: int) -> Sample:
    """One SGLang /generate result -> Sample, enforcing the contract (stop token included, exact length)."""
    ids = [int(t) for t in out.get("output_ids", [])]
    meta = out.get("meta_info", {})
    reason = (meta.get("finish_reason") or {}).get("type")
    lps = [x[0] for x in meta.get("output_token_logprobs") or []]
    where = f"SGLang output for prompt {prompt_index}"
    if reason not in ("stop", "length"):
        raise SGLangOutputError(f"{where}: finish_reason {meta.get('finish_reason')!r} (aborted or unknown)")
    if len(lps) != len(ids) or any(x is None for x in lps):
        raise SGLangOutputError(f"{where}: {len(lps)} log-probs for {len(ids)} tokens (or None entries)")
    if reason == "stop" and (not ids or ids[-1] not in stop):
        raise SGLangOutputError(f"{where}: finish_reason=stop but last token {ids[-1:]} is not a stop id {sorted(stop)}"
                                " (is no_stop_trim honoured / a stop *string* configured on the server?)")
    if reason == "length" and len(ids) != sp.max_new_tokens:
        raise SGLangOutputError(f"{where}: finish_reason=length with {len(ids)} tokens != max_new_tokens "
                                f"{sp.max_new_tokens} (context length limit?)")
    return Sample(prompt_index=prompt_index, prompt_ids=list(prompt), response_ids=ids, logprobs=[float(x) for x in lps],
                  finish_reason=reason, weight_version=version)


class SGLangEngine:
    """RolloutEngine over SGLang. mode="engine": in-process `sglang.Engine(**engine_kwargs)`;
    mode="server": launch `sglang.launch_server` (or attach to `server_url`) and talk HTTP."""

    def __init__(self, model_path: str | Path, mode: Literal["engine", "server"] = "engine",
                 eos_token_ids: Optional[list[int]] = None, server_url: Optional[str] = None, host: str = "127.0.0.1",
                 port: int = 30000, engine_kwargs: Optional[dict[str, Any]] = None,
                 server_args: Iterable[str] = (), startup_timeout: float = 900.0, request_timeout: float = 3600.0,
                 log_path: Optional[str] = None, weight_version: int = 0):
        self.model_path = str(model_path)
        self.mode = mode
        self.eos_token_ids = sorted(set(eos_token_ids)) if eos_token_ids is not None else eos_ids_from(model_path)
        self.weight_version = weight_version
        self._pending_version: Optional[int] = None
        self.engine: Any = None
        self.server: Optional[ServerProcess] = None
        self.url = server_url
        self.request_timeout = request_timeout
        self._group_name: Optional[str] = None
        self._group: Any = None
        if mode == "engine":
            sgl = import_sglang()
            self.engine = sgl.Engine(model_path=self.model_path, skip_tokenizer_init=True, **(engine_kwargs or {}))
        elif mode == "server":
            if server_url is None:
                self.server = ServerProcess(sglang_server_cmd(model_path, host, port, list(server_args)), host=host,
                                            port=port, startup_timeout=startup_timeout,
                                            request_timeout=request_timeout, log_path=log_path).start()
                self.url = self.server.url
        else:
            raise ValueError(f"rollout.sglang_mode: unknown {mode!r} (expected engine or server)")

    # ------------------------------------------------------------------------------------------
    def _post(self, path: str, payload: dict, retries: Optional[int] = None) -> Any:
        if self.server is not None:
            return self.server.request(path, payload, retries=retries)
        return http_json(self.url + path, payload, timeout=self.request_timeout)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Sample]:
        validate_sampling(sampling)
        if self._pending_version is not None:
            raise RuntimeError(f"SGLangEngine.generate: weight update to version {self._pending_version} in progress")
        stop = sorted(set(self.eos_token_ids) | set(sampling.stop_token_ids))
        rows = [(i, list(p)) for i, p in enumerate(prompts) for _ in range(sampling.n)]
        params = [sglang_sampling_params(sampling, stop, None if sampling.seed is None else sampling.seed + r)
                  for r in range(len(rows))]
        ids = [p for _, p in rows]
        if self.engine is not None:
            outs = self.engine.generate(input_ids=ids, sampling_params=params, return_logprob=True)
        else:
            outs = self._post("/generate", {"input_ids": ids, "sampling_params": params, "return_logprob": True},
                              retries=0)
        if not isinstance(outs, list) or len(outs) != len(rows):
            raise SGLangOutputError(f"SGLang returned {len(outs) if isinstance(outs, list) else type(outs).__name__} "
                                    f"outputs for {len(rows)} requests")
        return [parse_sglang_output(o, i, p, sampling, set(stop), self.weight_version) for (i, p), o in zip(rows, outs)]

    # ------------------------------------------------------------------------------------------
    # weights

    def _begin(self, version: int) -> bool:
        if self._pending_version is None:
            if version <= self.weight_version:
                raise ValueError(f"update_weights: version {version} must be > current weight_version "
                                 f"{self.weight_version}")
            self._pending_version = version
            return True
        if version != self._pending_version:
            raise ValueError(f"update_weights: bucket for version {version} while {self._pending_version} is in "
                             "progress")
        return False

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                       last_bucket: bool = True, via: Literal["tensor", "distributed"] = "tensor") -> None:
        """Load one bucket of HF-named tensors; weight_version becomes `version` after the last bucket."""
        bucket = [(n, t.detach()) for n, t in named_tensors]
        first = self._begin(version)
        try:
            if via == "distributed":
                self._update_distributed(bucket, last_bucket)
            elif self.engine is not None:
                if first and hasattr(self.engine, "begin_weight_update"):
                    self.engine.begin_weight_update()
                self.engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=last_bucket)
                if last_bucket and hasattr(self.engine, "end_weight_update"):
                    self.engine.end_weight_update()
            else:
                from sglang.srt.utils import MultiprocessingSerializer  # same-machine handles only

                blob = MultiprocessingSerializer.serialize(bucket, output_str=True)
                res = self._post("/update_weights_from_tensor",
                                 {"serialized_named_tensors": [blob], "flush_cache": last_bucket}, retries=0)
                _check_success(res, "update_weights_from_tensor")
        except BaseException:
            self._pending_version = None
            self.weight_version = min(self.weight_version, -1)  # unknown weights: assert_fresh will catch it
            raise
        if last_bucket:
            self.weight_version, self._pending_version = version, None

    def update_weights_from_disk(self, path: str | Path, version: int) -> None:
        self._begin(version)
        try:
            if self.engine is not None:
                res = self.engine.update_weights_from_disk(str(path))
            else:
                res = self._post("/update_weights_from_disk", {"model_path": str(path)}, retries=0)
            _check_success(res, "update_weights_from_disk")
        except BaseException:
            self._pending_version = None
            raise
        self.weight_version, self._pending_version = version, None

    def init_weight_group(self, master_address: str, master_port: int, engine_world_size: int,
                          group_name: str = "megatron_opd_weights", backend: str = "nccl") -> None:
        """Disaggregated sync: a process group of {trainer rank 0} + the engine's ranks (rank_offset=1)."""
        from sglang.srt.utils import init_custom_process_group

        world = engine_world_size + 1
        payload = dict(master_address=master_address, master_port=master_port, rank_offset=1, world_size=world,
                       group_name=group_name, backend=backend)
        result: dict[str, Any] = {}
        call = (lambda: result.update(r=self.engine.init_weights_update_group(**payload))) if self.engine is not None \
            else (lambda: result.update(r=self._post("/init_weights_update_group", payload, retries=0)))
        th = threading.Thread(target=call, daemon=True)
        th.start()  # the engine joins the rendezvous while we do
        self._group = init_custom_process_group(backend=backend, init_method=f"tcp://{master_address}:{master_port}",
                                                world_size=world, rank=0, group_name=group_name)
        th.join()
        _check_success(result.get("r"), "init_weights_update_group")
        self._group_name = group_name

    def _update_distributed(self, bucket: list[tuple[str, torch.Tensor]], last_bucket: bool) -> None:
        if self._group is None:
            raise RuntimeError("update_weights(via='distributed'): call init_weight_group first")
        payload = dict(names=[n for n, _ in bucket], dtypes=[str(t.dtype).replace("torch.", "") for _, t in bucket],
                       shapes=[list(t.shape) for _, t in bucket], group_name=self._group_name,
                       flush_cache=last_bucket)
        result: dict[str, Any] = {}
        call = (lambda: result.update(r=self.engine.update_weights_from_distributed(**payload))) \
            if self.engine is not None else (lambda: result.update(r=self._post("/update_weights_from_distributed",
                                                                                payload, retries=0)))
        th = threading.Thread(target=call, daemon=True)
        th.start()
        for _, t in bucket:
            torch.distributed.broadcast(t.contiguous(), src=0, group=self._group)
        th.join()
        _check_success(result.get("r"), "update_weights_from_distributed")

    def release_memory(self) -> None:
        """Colocated mode: free SGLang's weights + KV cache while the trainer uses the accelerator."""
        if self.engine is not None:
            self.engine.release_memory_occupation()
        else:
            self._post("/release_memory_occupation", {}, retries=0)

    def resume_memory(self) -> None:
        if self.engine is not None:
            self.engine.resume_memory_occupation()
        else:
            self._post("/resume_memory_occupation", {}, retries=0)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self.server is not None:
            self.server.shutdown()
            self.server = None


def _check_success(res: Any, what: str) -> None:
    """SGLang answers (success, message) tuples from the engine and {"success": ..., "message": ...} over HTTP."""
    ok, msg = True, ""
    if isinstance(res, tuple) and len(res) >= 1 and isinstance(res[0], bool):
        ok, msg = res[0], (res[1] if len(res) > 1 else "")
    elif isinstance(res, dict) and "success" in res:
        ok, msg = bool(res["success"]), res.get("message", "")
    if not ok:
        raise RuntimeError(f"SGLang {what} failed: {msg}")


__all__ = ["SGLangEngine", "SGLangOutputError", "import_sglang", "parse_sglang_output", "sglang_sampling_params"]
