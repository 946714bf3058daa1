"""SGLang rollout backend: in-process `sglang.Engine` or a launched `sglang.launch_server` over HTTP.

sglang is imported lazily (it is not a dependency of the package). Token ids in, token ids out
(`skip_tokenizer_init`), so the trainer's tokenizer is the only one that matters.

Log-probs: `Sample.logprobs` are SGLang's `output_token_logprobs`. By default SGLang reports them
after temperature scaling and before top-k/top-p truncation (with SGLANG_RETURN_ORIGINAL_LOGPROB=1,
at temperature 1). They equal LocalEngine's `logprobs` when top-k/top-p are off. `raw_logprobs` is None.

Weight sync (HF-named tensors, bucketed, versioned like LocalEngine). Every update runs inside SGLang's
weight-update session (`begin_weight_update` ... `end_weight_update`; engine methods or POST /begin_weight_update
and /end_weight_update; a server without those routes answers 404 and is updated sessionless):
  * colocated, engine mode: `update_weights_from_tensor` per bucket; `release_memory()` / `resume_memory()`
    free and restore the KV cache and weights while the trainer runs (needs `memory_saver=True`, i.e.
    SGLang's enable_memory_saver; CUDA only).
  * colocated, server mode: POST /update_weights_from_tensor with SGLang's MultiprocessingSerializer (same
    machine only; the client switches torch.multiprocessing to the "file_system" sharing strategy, without
    which SGLang's scheduler fails with `AuthenticationError: digest received was wrong`).
  * disaggregated: `init_weight_group` + `update_weights(..., via="distributed")` broadcasts each bucket from
    the trainer over a dedicated process group {trainer rank 0} + the engine's TP ranks (NCCL on GPUs, gloo
    on CPU). SGLang ranks its side as 1 + tp_rank, so the engine must be one replica (dp=1, pp=1).
    Every rendezvous and broadcast is bounded by `weight_sync_timeout`: a refusal or a dead server is a
    RuntimeError, never a hang.
  * `update_weights_from_disk(path, version)`: reload from an HF directory (the fallback that works everywhere).

A launched server gets `--api-key` (generated when none is given) through rollout/keyed_launch.py: not on
its command line, and redacted from its log; every request carries it.
"""

from __future__ import annotations

import atexit
import datetime
import inspect
import logging
import os
import secrets
import threading
import time
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Optional

import torch
import torch.multiprocessing as mp
from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                default_pg_timeout, rendezvous)

from megatron_opd.rollout.base import Sample, SamplingParams, eos_ids_from, validate_sampling
from megatron_opd.rollout.server import ServerError, ServerProcess, http_json, sglang_server_cmd

logger = logging.getLogger("megatron_opd.rollout.sglang")


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
    """One SGLang /generate result -> Sample, enforcing the contract (stop token included, exact length).
    Truncated means no stop token at the end, as in LocalEngine: SGLang says finish_reason=length when the
    stop token is the budget's last token, and that response is complete ("stop")."""
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
    if reason == "length" and ids and ids[-1] in stop:
        reason = "stop"
    return Sample(prompt_index=prompt_index, prompt_ids=list(prompt), response_ids=ids, logprobs=[float(x) for x in lps],
                  finish_reason=reason, weight_version=version)


class SGLangEngine:
    """RolloutEngine over SGLang. mode="engine": in-process `sglang.Engine(**engine_kwargs)`;
    mode="server": launch `sglang.launch_server` (or attach to `server_url`) and talk HTTP."""

    def __init__(self, model_path: str | Path, mode: Literal["engine", "server"] = "engine",
                 eos_token_ids: Optional[list[int]] = None, server_url: Optional[str] = None, host: str = "127.0.0.1",
                 port: int = 30000, engine_kwargs: Optional[dict[str, Any]] = None,
                 server_args: Iterable[str] = (), startup_timeout: float = 900.0, request_timeout: float = 3600.0,
                 log_path: Optional[str] = None, weight_version: int = 0, api_key: Optional[str] = None,
                 memory_saver: bool = False, weight_sync_timeout: float = 600.0):
        self.model_path = str(model_path)
        self.mode = mode
        self.eos_token_ids = sorted(set(eos_token_ids)) if eos_token_ids is not None else eos_ids_from(model_path)
        self.weight_version = weight_version
        self._pending_version: Optional[int] = None
        self.engine: Any = None
        self.server: Optional[ServerProcess] = None
        self.url = server_url.rstrip("/") if server_url else None
        self.api_key = api_key
        self.request_timeout = request_timeout
        self.weight_sync_timeout = weight_sync_timeout
        self.memory_saver = memory_saver  # release_memory/resume_memory only work with SGLang's memory saver
        self._session: Optional[bool] = None  # server has /begin_weight_update (None: not asked yet)
        self._session_open = False
        self._group_name: Optional[str] = None
        self._group: Any = None
        self._group_backend = "gloo"
        if mode == "engine":
            sgl = import_sglang()
            kwargs = dict(engine_kwargs or {})
            if memory_saver:
                kwargs.setdefault("enable_memory_saver", True)
            before = {p.pid for p in _children()}
            self.engine = sgl.Engine(model_path=self.model_path, skip_tokenizer_init=True, **kwargs)
            self.engine_processes = [p for p in _children() if p.pid not in before and not _is_mp_helper(p.pid)]
        elif mode == "server":
            if server_url is None:
                # weight-update endpoints must not be open to anyone who can reach the port: always a key
                self.api_key = api_key or secrets.token_hex(24)
                args = [*server_args, *(["--enable-memory-saver"] if memory_saver else [])]
                self.server = ServerProcess(sglang_server_cmd(model_path, host, port, args), host=host,
                                            port=port, startup_timeout=startup_timeout,
                                            request_timeout=request_timeout, log_path=log_path,
                                            api_key=self.api_key, pass_key=True).start()
                self.url = self.server.url
        else:
            raise ValueError(f"rollout.sglang_mode: unknown {mode!r} (expected engine or server)")

    # ------------------------------------------------------------------------------------------
    def _post(self, path: str, payload: Optional[dict], retries: Optional[int] = None,
              timeout: Optional[float] = None) -> Any:
        """POST (GET when payload is None) to the server; the API key goes with it."""
        if self.server is not None:
            return self.server.request(path, payload, retries=retries, timeout=timeout)
        return http_json(self.url + path, payload, timeout=timeout or self.request_timeout, api_key=self.api_key)

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

    def _session_call(self, which: Literal["begin", "end"]) -> None:
        """Open / close SGLang's weight-update session (0.5.23 refuses updates outside one: HTTP 400)."""
        name = f"{which}_weight_update"
        if self.engine is not None:
            if hasattr(self.engine, name):
                _check_success(getattr(self.engine, name)(), name)
            return
        if self._session is False:
            return
        try:
            res = self._post(f"/{name}", {}, retries=0, timeout=self.weight_sync_timeout)
        except ServerError as e:
            if getattr(e, "status", None) == 404 and self._session is None:
                self._session = False  # an SGLang without sessions loads weights directly
                return
            raise
        self._session = True
        _check_success(res, name)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                       last_bucket: bool = True, via: Literal["tensor", "distributed"] = "tensor") -> None:
        """Load one bucket of HF-named tensors; weight_version becomes `version` after the last bucket.
        The first bucket of a version opens SGLang's weight-update session, the last one closes it."""
        bucket = [(n, t.detach()) for n, t in named_tensors]
        first = self._begin(version)
        try:
            if first:
                self._session_call("begin")
                self._session_open = True
            if via == "distributed":
                self._update_distributed(bucket, last_bucket)
            elif via != "tensor":
                raise ValueError(f"update_weights: via={via!r} (expected tensor or distributed)")
            elif self.engine is not None:
                res = self.engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=last_bucket)
                _check_success(res, "update_weights_from_tensor")
            else:
                from sglang.srt.utils import MultiprocessingSerializer  # same-machine handles only

                use_file_system_sharing()
                blob = MultiprocessingSerializer.serialize(bucket, output_str=True)
                res = self._post("/update_weights_from_tensor",
                                 {"serialized_named_tensors": [blob], "flush_cache": last_bucket}, retries=0,
                                 timeout=self.weight_sync_timeout)
                _check_success(res, "update_weights_from_tensor")
            if last_bucket:
                self._session_open = False
                self._session_call("end")
        except BaseException:
            self._pending_version = None
            self.weight_version = min(self.weight_version, -1)  # unknown weights: assert_fresh will catch it
            if self._session_open:
                self._session_open = False
                try:  # leave no session open behind a failure (best effort; the original error wins)
                    self._session_call("end")
                except Exception:
                    pass
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

    def server_layout(self) -> dict[str, int]:
        """tp/pp/dp sizes of the engine (GET /get_server_info, or the engine's server_args)."""
        if self.engine is not None:
            sa = getattr(self.engine, "server_args", None)
            info = {k: getattr(sa, k, None) for k in ("tp_size", "pp_size", "dp_size")} if sa is not None else {}
        else:
            info = self._post("/get_server_info", None, retries=2) or {}
        return {k: int(info.get(k) or 1) for k in ("tp_size", "pp_size", "dp_size")}

    @property
    def has_weight_group(self) -> bool:
        return self._group is not None

    def init_weight_group(self, master_address: str, master_port: int, engine_world_size: Optional[int] = None,
                          group_name: Optional[str] = None, backend: str = "nccl") -> None:
        """Disaggregated sync: a process group of {trainer rank 0} + the engine's ranks (rank_offset=1).
        `engine_world_size` defaults to the server's tp_size; a server with dp_size or pp_size > 1 is refused
        (SGLang ranks its side as 1 + tp_rank, so replicas would collide in the group)."""
        if engine_world_size is None:
            lay = self.server_layout()
            if lay["dp_size"] > 1 or lay["pp_size"] > 1:
                raise RuntimeError(f"SGLang at {self.url or 'in-process'}: distributed weight sync needs one replica "
                                   f"per server (dp_size=1, pp_size=1), got {lay}: serve the rollout model as one "
                                   "replica (--tp-size = its GPUs, --dp-size 1)")
            engine_world_size = lay["tp_size"]
        # torch keeps group names for the life of the process: a fresh one per group (a failed sync re-creates it)
        group_name = group_name or f"megatron_opd_weights_{secrets.token_hex(4)}"
        world = engine_world_size + 1
        payload = dict(master_address=master_address, master_port=master_port, rank_offset=1, world_size=world,
                       group_name=group_name, backend=backend)
        if self.engine is not None:
            call: Callable[[], Any] = lambda: self.engine.init_weights_update_group(**payload)
        else:
            call = lambda: self._post("/init_weights_update_group", payload, retries=0,
                                      timeout=self.weight_sync_timeout)
        th = _Call(call).start()  # the engine joins the rendezvous while we do
        rdv = _Call(lambda: init_custom_process_group(  # our side of the rendezvous, bounded in time
            backend=backend, init_method=f"tcp://{master_address}:{master_port}", world_size=world, rank=0,
            group_name=group_name, timeout=datetime.timedelta(seconds=self.weight_sync_timeout))).start()
        deadline = time.monotonic() + self.weight_sync_timeout
        while not rdv.done:
            if th.done and not th.ok:  # the engine refused / failed: do not wait for it to join
                raise RuntimeError(f"SGLang init_weights_update_group failed: {th.error_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"SGLang init_weights_update_group: the engine did not join the weight group "
                                   f"at tcp://{master_address}:{master_port} within {self.weight_sync_timeout:.0f}s")
            time.sleep(0.02)
        if rdv.error is not None:
            raise RuntimeError(f"weight group rendezvous at tcp://{master_address}:{master_port} failed: "
                               f"{rdv.error}") from rdv.error
        th.wait(max(deadline - time.monotonic(), 1.0), "init_weights_update_group")
        self._group, self._group_name, self._group_backend = rdv.result, group_name, backend

    def _update_distributed(self, bucket: list[tuple[str, torch.Tensor]], last_bucket: bool) -> None:
        if self._group is None:
            raise RuntimeError("update_weights(via='distributed'): call init_weight_group first")
        device = "cuda" if self._group_backend == "nccl" else "cpu"
        tensors = [t.to(device).contiguous() for _, t in bucket]
        payload = dict(names=[n for n, _ in bucket], dtypes=[str(t.dtype).replace("torch.", "") for _, t in bucket],
                       shapes=[list(t.shape) for _, t in bucket], group_name=self._group_name,
                       flush_cache=last_bucket)
        if self.engine is not None:
            call: Callable[[], Any] = lambda: self.engine.update_weights_from_distributed(**payload)
        else:
            call = lambda: self._post("/update_weights_from_distributed", payload, retries=0,
                                      timeout=self.weight_sync_timeout)
        th = _Call(call).start()
        deadline = time.monotonic() + self.weight_sync_timeout
        try:
            for t in tensors:
                work = torch.distributed.broadcast(t, src=0, group=self._group, async_op=True)
                while not work.is_completed():
                    if th.done and not th.ok:  # refused: the engine will never receive this broadcast
                        raise RuntimeError(f"SGLang update_weights_from_distributed failed: {th.error_text()}")
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"update_weights_from_distributed: broadcast not received within "
                                           f"{self.weight_sync_timeout:.0f}s (engine gone or refusing?)")
                    time.sleep(0.005)
                work.wait()
            th.wait(max(deadline - time.monotonic(), 1.0), "update_weights_from_distributed")
        except BaseException:
            self._group = None  # a half-done collective leaves the group unusable: re-create it next time
            raise

    def release_memory(self) -> None:
        """Colocated mode: free SGLang's weights + KV cache while the trainer uses the accelerator."""
        if self.engine is not None:
            self.engine.release_memory_occupation()
        else:
            _check_success(self._post("/release_memory_occupation", {}, retries=0), "release_memory_occupation")

    def resume_memory(self) -> None:
        if self.engine is not None:
            self.engine.resume_memory_occupation()
        else:
            _check_success(self._post("/resume_memory_occupation", {}, retries=0), "resume_memory_occupation")

    def shutdown(self) -> None:
        if self.engine is not None:
            _shutdown_engine_only(self.engine, getattr(self, "engine_processes", []))
            self.engine = None
        if self.server is not None:
            self.server.shutdown()
            self.server = None


def _children() -> list[Any]:
    import psutil  # an SGLang dependency

    return psutil.Process().children(recursive=False)


def _is_mp_helper(pid: int) -> bool:
    """multiprocessing's resource tracker, often started while the engine is built: not the engine's to kill
    (killing it leaks semaphores and makes multiprocessing warn and relaunch it)."""
    return getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None) == pid


def _shutdown_engine_only(engine: Any, own: list[Any]) -> None:
    """`sglang.Engine.shutdown()` ends with `kill_process_tree(os.getpid(), include_parent=False)`: it SIGKILLs
    *every* child of the calling process, i.e. of the trainer: a teacher server it launched, torch's
    shared-memory manager (after which tensor updates to a server fail with `Broken pipe`), data workers.
    Here that call is narrowed to the processes the engine started (`own`: psutil handles of the children
    that appeared while it was built, so a reused PID is never hit; their descendants go with them); every
    other kill_process_tree call is SGLang's own. The engine's atexit hook (the unnarrowed shutdown again)
    is removed. Where SGLang no longer makes that call, a warning says the workaround no longer applies."""
    try:
        import sglang.srt.entrypoints.engine as engine_mod
    except ImportError:
        engine_mod = None
    real = getattr(engine_mod, "kill_process_tree", None)
    if real is None or "kill_process_tree" not in getattr(type(engine).shutdown, "__code__", _NO_CODE).co_names:
        logger.warning("sglang.Engine.shutdown no longer calls kill_process_tree as 0.5.23 did: shutting the "
                       "engine down the SGLang way (it may kill other child processes of the trainer)")
        engine.shutdown()
    else:
        def kill_own(parent_pid: Any = None, include_parent: bool = True, *args: Any, **kwargs: Any) -> None:
            if parent_pid == os.getpid() and not include_parent:
                for proc in own:
                    if proc.is_running():  # psutil compares creation times: PID reuse is not "running"
                        real(proc.pid, True, *args, **kwargs)
                return
            real(parent_pid, include_parent, *args, **kwargs)

        engine_mod.kill_process_tree = kill_own
        try:
            engine.shutdown()
        finally:
            engine_mod.kill_process_tree = real
    atexit.unregister(engine.shutdown)


_NO_CODE = (lambda: None).__code__


def _check_success(res: Any, what: str) -> None:
    """SGLang answers (success, message) tuples from the engine and {"success": ..., "message": ...} over HTTP."""
    ok, msg = True, ""
    if isinstance(res, tuple) and len(res) >= 1 and isinstance(res[0], bool):
        ok, msg = res[0], (res[1] if len(res) > 1 else "")
    elif isinstance(res, dict) and "success" in res:
        ok, msg = bool(res["success"]), res.get("message", "")
    if not ok:
        raise RuntimeError(f"SGLang {what} failed: {msg}")


def use_file_system_sharing() -> None:
    """Tensor updates to an SGLang *server* pass tensors by torch.multiprocessing handles; with the default
    (file_descriptor) strategy the scheduler fails with `AuthenticationError: digest received was wrong`."""
    if mp.get_sharing_strategy() != "file_system":
        mp.set_sharing_strategy("file_system")


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout: Optional[datetime.timedelta] = None) -> Any:
    """A process group outside the default one ({trainer rank 0} + the engine's ranks), built the way
    SGLang's own `sglang.srt.utils.init_custom_process_group` builds its side (TCP rendezvous, store
    prefixed by the group name), so the two ends meet; it uses SGLang's when importable."""
    try:
        from sglang.srt.utils import init_custom_process_group as sgl_init
    except ImportError:
        sgl_init = None
    if sgl_init is not None:
        return sgl_init(backend=backend, init_method=init_method, world_size=world_size, rank=rank,
                        group_name=group_name, timeout=timeout)
    timeout = timeout or default_pg_timeout
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    opt = "backend_options" if "backend_options" in inspect.signature(_new_process_group_helper).parameters \
        else "pg_options"
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      timeout=timeout, **{opt: None})
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class _Call:
    """Run one blocking engine/HTTP call in a daemon thread; remember its result or error."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn, self.result, self.error, self.done = fn, None, None, False
        self._th = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            self.error = e
        self.done = True

    def start(self) -> "_Call":
        self._th.start()
        return self

    @property
    def ok(self) -> bool:
        if self.error is not None:
            return False
        try:
            _check_success(self.result, "")
        except RuntimeError:
            return False
        return True

    def error_text(self) -> str:
        if self.error is not None:
            return f"{type(self.error).__name__}: {self.error}"
        r = self.result
        return str(r.get("message", r)) if isinstance(r, dict) else str(r[1] if isinstance(r, tuple) and len(r) > 1 else r)

    def wait(self, timeout: float, what: str) -> None:
        self._th.join(timeout)
        if not self.done:
            raise RuntimeError(f"SGLang {what}: no answer within {timeout:.0f}s")
        if self.error is not None:
            raise RuntimeError(f"SGLang {what} failed: {self.error_text()}") from self.error
        _check_success(self.result, what)


__all__ = ["SGLangEngine", "SGLangOutputError", "import_sglang", "init_custom_process_group", "parse_sglang_output",
           "sglang_sampling_params", "use_file_system_sharing"]
