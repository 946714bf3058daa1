"""The trainer uses the SGLang it is configured for (issue 8, section 2 and the network part of section 6).

SGLang cannot be installed on this CPU test machine, so the server side is `tests/sglang_standin.py`: a
subprocess HTTP server (NOT SGLang) that speaks SGLang's weight-sync API with SGLang 0.5.23's rules
(API key on every path but /health, weight updates only inside a begin/end_weight_update session) and
joins a real gloo process group with the trainer for `update_weights_from_distributed`. What is mocked,
and only because it cannot run here: SGLang's MultiprocessingSerializer (replaced by a JSON encoding the
stand-in decodes, `fake_serializer`), and, where a test checks that *no* server is spawned or which
command *would* be spawned, `subprocess.Popen` / `ServerProcess.start`.
"""

from __future__ import annotations

import base64
import json
import sys
import threading
import time
import types
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from megatron_opd.config import ConfigError, RolloutConfig, load_config
from megatron_opd.rollout import make_rollout_engine, release_engine_memory, sync_weights
from megatron_opd.rollout.base import SamplingParams
from megatron_opd.rollout.keyed_launch import KEY_ENV
from megatron_opd.rollout.server import ServerError, ServerProcess, http_json
from megatron_opd.rollout.sglang_engine import SGLangEngine
from megatron_opd.teacher.sglang import SGLangTeacher

STANDIN = Path(__file__).with_name("sglang_standin.py")
ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = [("model.embed_tokens.weight", torch.arange(12, dtype=torch.float32).reshape(3, 4)),
           ("model.norm.weight", torch.full((4,), 0.5)),
           ("lm_head.weight", torch.ones(3, 4, dtype=torch.bfloat16))]


def _expected_sums(scale: float = 1.0) -> dict[str, float]:
    return {n: float((t.double() * scale).sum()) for n, t in WEIGHTS}


def _weights(scale: float = 1.0):
    return ((n, (t.float() * scale).to(t.dtype)) for n, t in WEIGHTS)


@pytest.fixture
def standin(tmp_path):
    """start(mode="ok", api_key=None, dp_size=1) -> (ServerProcess, log reader)."""
    from _dist import free_port

    procs = []

    def start(mode: str = "ok", api_key: str | None = None, dp_size: int = 1):
        port = free_port()
        log = tmp_path / f"requests_{port}.jsonl"
        cmd = [sys.executable, STANDIN, "--port", port, "--log", log, "--mode", mode, "--dp-size", dp_size]
        if api_key:
            cmd += ["--api-key", api_key]
        srv = ServerProcess(cmd, port=port, startup_timeout=60, log_path=tmp_path / f"standin_{port}.log",
                            env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, api_key=api_key).start()
        procs.append(srv)

        def calls(full: bool = False) -> list:
            """Paths the stand-in was asked for, in order (/health polls left out); full: the log entries."""
            entries = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
            entries = [e for e in entries if e["path"] != "/health"]
            return entries if full else [e["path"] for e in entries]
        return srv, calls

    yield start
    for p in procs:
        p.shutdown()


@pytest.fixture
def fake_serializer(monkeypatch):
    """SGLang's MultiprocessingSerializer (torch IPC handles) cannot run without sglang: a JSON stand-in."""
    class MultiprocessingSerializer:
        @staticmethod
        def serialize(obj, output_str=False):
            data = {n: t.double().flatten().tolist() for n, t in obj}
            return base64.b64encode(json.dumps(data).encode()).decode()

    utils = types.ModuleType("sglang.srt.utils")
    utils.MultiprocessingSerializer = MultiprocessingSerializer
    for name, mod in (("sglang", types.ModuleType("sglang")), ("sglang.srt", types.ModuleType("sglang.srt")),
                      ("sglang.srt.utils", utils)):
        monkeypatch.setitem(sys.modules, name, mod)
    import torch.multiprocessing as mp

    before = mp.get_sharing_strategy()
    yield
    mp.set_sharing_strategy(before)


def _cfg(url: str | None, **kw) -> RolloutConfig:
    return RolloutConfig(backend="sglang", sglang_mode="server", server_url=url, **kw)


def _engine(url: str, **kw) -> SGLangEngine:
    return make_rollout_engine(_cfg(url, **kw), "/nonexistent-model", eos_token_ids=[31])


def _received(srv) -> dict[str, float]:
    return http_json(srv.url + "/_weights", api_key=srv.api_key)


# ------------------------------------------------------------------------------------- factory


def test_factory_attaches_to_server_url_and_spawns_nothing(standin, monkeypatch):
    """rollout.server_url given: that URL is the one contacted, host/port are not, and no process starts."""
    srv, calls = standin()
    import megatron_opd.rollout.server as server_mod

    def no_spawn(*a, **k):
        raise AssertionError(f"a server was spawned although rollout.server_url is set: {a}")

    monkeypatch.setattr(server_mod.subprocess, "Popen", no_spawn)
    eng = _engine(srv.url + "/", host="10.255.255.1", port=1)  # host/port must be ignored
    assert eng.server is None and eng.url == srv.url
    samples = eng.generate([[1, 2]], SamplingParams(max_new_tokens=3))
    assert len(samples) == 1 and calls() == ["/generate"]


def test_factory_launches_server_from_rollout_keys_with_api_key(monkeypatch, tmp_path):
    """No server_url: launch_server bound to rollout.host:port with mem_fraction_static and an API key
    (generated when $rollout.api_key_env is unset), given through keyed_launch in the server's environment,
    never on its command line. Starting it is mocked: sglang is not installed here."""
    started = []
    monkeypatch.setattr(ServerProcess, "start", lambda self: started.append(self) or self)
    monkeypatch.delenv("SGLANG_API_KEY", raising=False)
    eng = _engine(None, host="127.0.0.9", port=31234, mem_fraction_static=0.42)
    (srv,) = started
    cmd = srv.cmd
    assert cmd[1:5] == ["-m", "megatron_opd.rollout.keyed_launch", "-m", "sglang.launch_server"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.9" and cmd[cmd.index("--port") + 1] == "31234"
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.42"
    key = srv.env[KEY_ENV]
    assert len(key) >= 32 and srv.api_key == key == eng.api_key and eng.url == "http://127.0.0.9:31234"
    assert "--api-key" not in cmd and key not in " ".join(cmd)
    monkeypatch.setenv("MY_KEY", "k-from-env")
    started.clear()
    _engine(None, api_key_env="MY_KEY")
    assert started[0].env[KEY_ENV] == "k-from-env" and "k-from-env" not in started[0].cmd


# ------------------------------------------------------------------------------------- API key


def test_api_key_required_by_server_and_sent_by_clients(standin, monkeypatch):
    srv, calls = standin(api_key="s3cret-key")
    monkeypatch.delenv("SGLANG_API_KEY", raising=False)
    with pytest.raises(ServerError, match=r"HTTP 401.*api_key_env"):
        _engine(srv.url).generate([[1]], SamplingParams(max_new_tokens=2))
    monkeypatch.setenv("SGLANG_API_KEY", "wrong")
    with pytest.raises(ServerError, match="HTTP 401.*refused"):
        _engine(srv.url).generate([[1]], SamplingParams(max_new_tokens=2))
    monkeypatch.setenv("SGLANG_API_KEY", "s3cret-key")
    assert _engine(srv.url).generate([[1]], SamplingParams(max_new_tokens=2))
    # the teacher by URL sends it too; without it the server refuses (4xx is not retried)
    with pytest.raises(ServerError, match="HTTP 401"):
        SGLangTeacher(srv.url, eos_token_ids=[2], backoff=0.01)._post({"x": 1})
    gens = [e["authorized"] for e in calls(full=True) if e["path"] == "/generate"]
    assert gens == [False, False, True, False]


# ------------------------------------------------------------------------------------- weight sync


def test_disaggregated_sync_takes_distributed_path(standin):
    """rollout.colocate=false: init_weights_update_group once, then per version begin ->
    update_weights_from_distributed (real gloo broadcasts) -> end; never the tensor path."""
    srv, calls = standin()
    eng = _engine(srv.url, colocate=False, sync_bucket_mb=0.00002)  # ~20 bytes: one tensor per bucket
    n = sync_weights(eng, _weights(), 1, _cfg(srv.url, colocate=False, sync_bucket_mb=0.00002), "auto")
    assert n == 3 and eng.weight_version == 1 and eng._group_backend == "gloo"  # no CUDA here
    assert calls() == ["/get_server_info", "/init_weights_update_group", "/begin_weight_update",
                       *["/update_weights_from_distributed"] * 3, "/end_weight_update"]
    assert _received(srv) == pytest.approx(_expected_sums())
    sync_weights(eng, _weights(2.0), 2, _cfg(srv.url, colocate=False), "gloo")  # the group is reused
    assert calls()[-3:] == ["/begin_weight_update", "/update_weights_from_distributed", "/end_weight_update"]
    assert calls().count("/init_weights_update_group") == 1 and "/update_weights_from_tensor" not in calls()
    assert _received(srv) == pytest.approx(_expected_sums(2.0)) and eng.weight_version == 2


@pytest.mark.parametrize("mode,match", [("refuse_update", "update_weights_from_distributed failed: .*refuses"),
                                        ("refuse_init", "init_weights_update_group failed: .*refuses")])
def test_refused_distributed_update_is_an_error_not_a_hang(standin, mode, match):
    srv, calls = standin(mode=mode)
    eng = _engine(srv.url, colocate=False, weight_sync_timeout=60.0)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=match):
        sync_weights(eng, _weights(), 1, _cfg(srv.url, colocate=False), "gloo")
    assert time.monotonic() - t0 < 30  # the refusal is noticed at once, not after the timeout
    assert eng.weight_version < 1
    if mode == "refuse_update":  # the session opened for the update is closed again
        assert calls()[-1] == "/end_weight_update"


def test_distributed_rendezvous_timeout(standin, monkeypatch):
    """An engine that never joins the weight group: an error after rollout.weight_sync_timeout."""
    srv, _ = standin()
    eng = _engine(srv.url, colocate=False, weight_sync_timeout=2.0)
    never = threading.Event()
    monkeypatch.setattr(eng, "_post", lambda path, *a, **k: never.wait(30) if path == "/init_weights_update_group"
                        else {"tp_size": 1, "pp_size": 1, "dp_size": 1})
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="weight group|did not join|rendezvous"):
        eng.init_weight_group("127.0.0.1", __import__("_dist").free_port(), backend="gloo")
    assert time.monotonic() - t0 < 20
    never.set()


def test_distributed_sync_refuses_multi_replica_server(standin):
    srv, _ = standin(dp_size=2)
    with pytest.raises(RuntimeError, match="one replica per server"):
        sync_weights(_engine(srv.url, colocate=False), _weights(), 1, _cfg(srv.url, colocate=False))


def test_colocated_sync_tensor_path_release_resume_order(standin, fake_serializer):
    """rollout.colocate=true: memory released while training, resumed before the tensor update, inside a
    begin/end session (SGLang 0.5.23 answers 400 to an update outside one), with file_system sharing."""
    import torch.multiprocessing as mp

    srv, calls = standin()
    cfg = _cfg(srv.url, colocate=True)
    eng = _engine(srv.url, colocate=True)
    eng.memory_saver = True  # the factory turns it on only with CUDA (torch_memory_saver)
    assert release_engine_memory(eng, cfg) and calls() == ["/release_memory_occupation"]
    sync_weights(eng, _weights(), 1, cfg)
    assert calls() == ["/release_memory_occupation", "/resume_memory_occupation", "/begin_weight_update",
                       "/update_weights_from_tensor", "/end_weight_update"]
    assert mp.get_sharing_strategy() == "file_system"
    assert _received(srv) == pytest.approx(_expected_sums()) and eng.weight_version == 1
    eng.generate([[1]], SamplingParams(max_new_tokens=2))
    assert not release_engine_memory(eng, replace(cfg, colocate=False))  # disaggregated: never released


def test_server_without_session_routes_is_updated_sessionless(standin, fake_serializer):
    srv, calls = standin(mode="no_session_routes")
    eng = _engine(srv.url)
    sync_weights(eng, _weights(), 1, _cfg(srv.url))
    sync_weights(eng, _weights(), 2, _cfg(srv.url))
    assert calls() == ["/begin_weight_update", "/update_weights_from_tensor", "/update_weights_from_tensor"]
    assert eng.weight_version == 2


def test_trainer_builds_engine_and_syncs_through_the_factory(standin, tmp_path, monkeypatch):
    """The rollout stage (trainer/rollouts.py) on a configured server_url, disaggregated: the engine is built
    through the factory, nothing is released, and the stand-in is the server contacted and receives the
    student's weights over the weight group. (A whole Trainer is not built: only the rollout stage.)"""
    from megatron_opd.trainer.rollouts import Rollouts

    srv, calls = standin()
    cfg = load_config(None, ["rollout.backend=sglang", "rollout.sglang_mode=server", "rollout.colocate=false",
                             f"rollout.server_url={srv.url}", "rollout.port=1", "parallel.backend=gloo",
                             "rollout.sync_bucket_mb=1", f"logging.out_dir={tmp_path}"])
    import megatron_opd.trainer.rollouts as rollouts_mod

    real = rollouts_mod.make_rollout_engine
    monkeypatch.setattr(rollouts_mod, "make_rollout_engine",  # no model dir here: give the EOS ids
                        lambda c, path, **k: real(c, path, **{**k, "eos_token_ids": [31]}))
    student = types.SimpleNamespace(iter_hf_weights=lambda: _weights(3.0), dtype=torch.float32)
    t = Rollouts(cfg, rank=0, dp_parts=1, tokenizer=None, pad_id=0, sampler=None, student=student, out_dir=tmp_path)
    assert isinstance(t.engine, SGLangEngine) and t.engine.url == srv.url and t.engine.server is None
    t.start_next(0)  # disaggregated: nothing to release
    t.sync()
    assert calls() == ["/get_server_info", "/init_weights_update_group", "/begin_weight_update",
                       "/update_weights_from_distributed", "/end_weight_update"]
    assert _received(srv) == pytest.approx(_expected_sums(3.0)) and t.engine.weight_version == 1


# ------------------------------------------------------------------------------------- teacher by URL


class _Flaky(BaseHTTPRequestHandler):
    fails = 0
    seen = []

    def log_message(self, *a):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).seen.append(self.headers.get("Authorization"))
        if len(type(self).seen) <= type(self).fails:
            self.send_response(503)
            self.end_headers()
            return
        body = json.dumps([{"output_ids": [], "meta_info": {"input_token_logprobs": [[None, 5, None], [-0.5, 7, None]]}}]).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_teacher_by_url_retries_5xx_with_backoff_then_succeeds():
    _Flaky.fails, _Flaky.seen = 2, []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        t = SGLangTeacher(f"http://127.0.0.1:{httpd.server_port}", eos_token_ids=[2], retries=3, backoff=0.01,
                          api_key="tk")
        (score,) = t.score([[5]], [[7]])
        assert score.logprobs.tolist() == [-0.5]
        assert _Flaky.seen == ["Bearer tk"] * 3  # two 503s retried, the key sent every time
    finally:
        httpd.shutdown()


def test_teacher_by_url_gives_up_with_clear_error():
    from _dist import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    t = SGLangTeacher(url, eos_token_ids=[2], retries=2, backoff=0.05)
    t0 = time.monotonic()
    with pytest.raises(ServerError, match=rf"SGLang teacher {url}/generate: no successful answer after 3 attempt"):
        t.score([[5]], [[7]])
    assert time.monotonic() - t0 >= 0.05 + 0.1  # backoff 0.05 then 0.1 between the three attempts


def test_teacher_without_url_is_refused():
    with pytest.raises(ValueError, match="teacher.server_url"):
        SGLangTeacher(None, eos_token_ids=[2])


# ------------------------------------------------------------------------------------- config


def test_config_keys_for_sglang_wiring():
    cfg = load_config(None, ["rollout.api_key_env=ROLLOUT_KEY", "teacher.api_key_env=", "teacher.retries=0",
                             "rollout.weight_sync_timeout=5"])
    assert (cfg.rollout.api_key_env, cfg.teacher.api_key_env, cfg.teacher.retries,
            cfg.rollout.weight_sync_timeout) == ("ROLLOUT_KEY", "", 0, 5.0)
    assert load_config().rollout.api_key_env == "SGLANG_API_KEY" == load_config().teacher.api_key_env
    for override, key in (("rollout.api_key_env=sk-123abc", "rollout.api_key_env"),
                          ("teacher.api_key_env=1BAD", "teacher.api_key_env"),
                          ("teacher.retries=-1", "teacher.retries"),
                          ("rollout.weight_sync_timeout=0", "rollout.weight_sync_timeout"),
                          ("rollout.server_url=gpu-a17:30000", "rollout.server_url"),
                          ("teacher.server_url=ftp://x", "teacher.server_url")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [override])


def test_server_url_in_engine_mode_is_refused():
    """engine mode starts an in-process sgl.Engine whatever rollout.server_url says: a URL there would be
    silently ignored (and a second SGLang started), so the combination is a config error naming the key."""
    with pytest.raises(ConfigError, match=r"rollout.server_url: .*sglang_mode=server"):
        load_config(None, ["rollout.backend=sglang", "rollout.colocate=false",
                           "rollout.server_url=http://gpu-a17:30000"])
    assert load_config(None, ["rollout.server_url=http://gpu-a17:30000"]).rollout.backend == "local"  # not sglang


def test_colocate_with_a_remote_server_is_refused_and_attached_servers_never_released(monkeypatch):
    """Tensor sync sends same-machine handles: colocate=true with a server on another host is a config
    error; and an attached server (not started by us, maybe without --enable-memory-saver) is never
    asked to release its memory, even on CUDA."""
    remote = ["rollout.backend=sglang", "rollout.sglang_mode=server", "rollout.server_url=http://gpu-a17:30000"]
    with pytest.raises(ConfigError, match="rollout.colocate"):
        load_config(None, remote)
    assert not load_config(None, remote + ["rollout.colocate=false"]).rollout.colocate
    assert load_config(None, remote[:2] + ["rollout.server_url=http://127.0.0.1:30000"]).rollout.colocate
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = load_config(None, remote[:2] + ["rollout.server_url=http://127.0.0.1:9"])
    eng = make_rollout_engine(cfg.rollout, "unused-model-path", eos_token_ids=[2])
    assert eng.memory_saver is False and not release_engine_memory(eng, cfg.rollout)


def test_trainer_launches_teacher_server_with_api_key(tmp_path, monkeypatch):
    """teacher.backend=sglang without teacher.server_url: the trainer serves teacher.hf_path itself, with a
    generated API key its client sends, given to the server through keyed_launch (not in its arguments).
    sglang cannot run here, so `sglang_server_cmd` is swapped for the stand-in's command line."""
    from _dist import free_port  # noqa: F401 - the stand-in needs the tests dir on sys.path (it is)

    import megatron_opd.trainer.scoring as scoring_mod
    from megatron_opd.trainer.scoring import Scorer

    seen = {}

    def standin_cmd(model_path, host="127.0.0.1", port=30000, extra_args=(), python=sys.executable):
        seen.update(model=str(model_path), extra=list(extra_args))
        return [python, str(STANDIN), "--host", host, "--port", str(port), "--log", str(tmp_path / "t.jsonl"),
                *extra_args]

    monkeypatch.setattr(scoring_mod, "sglang_server_cmd", standin_cmd)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.delenv("SGLANG_API_KEY", raising=False)
    t = object.__new__(Scorer)
    t.cfg = load_config(None, ["teacher.backend=sglang", "teacher.hf_path=/models/teacher"])
    t.out_dir = tmp_path
    srv = t.launch_teacher_server()
    try:
        key = srv.api_key
        assert seen["model"] == "/models/teacher" and len(key) >= 32 and "--api-key" not in seen["extra"]
        teacher = SGLangTeacher(srv, eos_token_ids=[2])
        assert teacher.api_key == key
        assert http_json(srv.url + "/get_server_info", api_key=key)["tp_size"] == 1
        with pytest.raises(ServerError, match="HTTP 401"):
            http_json(srv.url + "/get_server_info")
        assert key not in "\n".join(srv.last_log().splitlines())
    finally:
        srv.shutdown()


@pytest.mark.megatron
@pytest.mark.parametrize("colocate", [False, True])
def test_trainer_end_to_end_against_stand_in_server(standin, tmp_path, monkeypatch, request, colocate):
    """A whole `Trainer` (tiny student, HF teacher) with rollout.backend=sglang attached by rollout.server_url
    to the stand-in: it generates there and spawns no server. Disaggregated: after each step the student's
    weights go over a real gloo weight group inside a begin/end session (group created once). Colocated:
    the engine's memory is released after each rollout and resumed before a tensor update (the memory
    saver is forced on: on CPU the factory leaves it off; the serializer is the JSON stand-in)."""
    if colocate:
        request.getfixturevalue("fake_serializer")
    from megatron_opd.data.builtin.arithmetic import write_builtin_jsonl
    from megatron_opd.demo import _tiny_models
    from megatron_opd.models.weight_mapping import load_hf_state_dict
    from megatron_opd.trainer.logger import read_metrics
    from megatron_opd.trainer.loop import Trainer

    srv, calls = standin()
    import megatron_opd.rollout.server as server_mod

    monkeypatch.setattr(server_mod.subprocess, "Popen",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError(f"spawned {a}")))
    student, teacher = _tiny_models(tmp_path / "models")
    data = write_builtin_jsonl(tmp_path / "data", n_train=8, n_eval=2)
    out = tmp_path / "run"
    cfg = load_config(None, [
        "algo.preset=opd", f"model.hf_path={student}", f"teacher.hf_path={teacher}", "teacher.backend=hf",
        f"data.train_path={data['train']}", "train.steps=2", "train.prompts_per_step=2",
        "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=6", f"logging.out_dir={out}",
        "logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.save_every=10",
        "rollout.backend=sglang", "rollout.sglang_mode=server", f"rollout.server_url={srv.url}",
        f"rollout.colocate={str(colocate).lower()}", "rollout.port=1", "parallel.backend=gloo",
        "rollout.parity_check=off"])  # the stand-in server's log-probs are made up
    trainer = Trainer(cfg)
    try:
        assert trainer.engine.url == srv.url and trainer.engine.server is None
        trainer.engine.memory_saver = colocate
        trainer.train()
    finally:
        trainer.close()
    c = calls()
    assert c.count("/generate") == 2 and c.count("/begin_weight_update") == c.count("/end_weight_update") == 2
    if colocate:
        step = ["/generate", "/release_memory_occupation", "/resume_memory_occupation", "/begin_weight_update",
                "/update_weights_from_tensor", "/end_weight_update"]
        assert c == step * 2
    else:
        assert c.count("/init_weights_update_group") == 1 and "/update_weights_from_tensor" not in c
        assert c.count("/update_weights_from_distributed") >= 2
    got = _received(srv)
    assert got and set(got) <= set(load_hf_state_dict(student))
    assert [r["train/weight_version"] for r in read_metrics(out)] == [1.0, 2.0]


def test_timeout_is_an_error_at_once_not_retried():
    """A request that outlives its timeout is not resent (the server may still be busy with it):
    one request reaches the server, and the error comes after ~timeout, not retries x timeout."""
    from megatron_opd.rollout.server import http_json_retry

    seen = []

    class Slow(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            seen.append(self.path)
            time.sleep(3.0)

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}/generate"
    t0 = time.monotonic()
    try:
        with pytest.raises(ServerError, match=r"no answer within 0.5 s \(not retried\)"):
            http_json_retry(url, {"x": 1}, timeout=0.5, retries=3, backoff=0.01)
    finally:
        srv.shutdown()
    assert time.monotonic() - t0 < 2.5 and seen == ["/generate"]
