"""Multi-node torchrun without Slurm (the README's recipe for clusters without it): two `torchrun --nnodes 2`
agents on 127.0.0.1 meet by c10d rendezvous and run the real trainer (examples/slurm_cpu.yaml: the student
pipeline-parallel over the two "nodes", the megatron teacher in its own layout). Under --max-restarts 1 a
worker SIGKILLed mid-run is restarted by the agents and resumes from the last checkpoint; the run ends with
the same metrics as an uninterrupted one."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _proc import log_tail, run
from megatron_opd.trainer.logger import read_metrics

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # ~100 s: the slow CI leg runs it

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("torchrun_inputs")
    run([sys.executable, "-m", "megatron_opd.cli", "demo", "--tiny", "--inputs-only", "--out", root],
        timeout=600, cwd=ROOT)
    return root


def _agents(inputs: Path, out: Path, restarts: int) -> list[subprocess.Popen]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # the README's recipe: a fresh store per restart attempt
    port = _free_port()
    overrides = [f"model.hf_path={inputs}/models/student", f"teacher.hf_path={inputs}/models/teacher",
                 f"data.train_path={inputs}/data/arith_train.jsonl",
                 f"data.eval_paths=[arith={inputs}/data/arith_eval.jsonl]", f"train.steps={STEPS}",
                 f"logging.out_dir={out}"]
    out.mkdir(parents=True)
    return [subprocess.Popen(
        [str(TORCHRUN), "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
         f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=opd-{port}", f"--max-restarts={restarts}",
         "-m", "megatron_opd.cli", "train", "--config", "examples/slurm_cpu.yaml", *overrides],
        cwd=ROOT, env=env, stdout=open(out / f"agent{i}.log", "w"), stderr=subprocess.STDOUT,
        start_new_session=True) for i in range(2)]


def _wait(agents: list[subprocess.Popen], timeout: float = 300) -> list[int]:
    try:
        return [a.wait(timeout=timeout) for a in agents]
    finally:
        for a in agents:  # a hung run: its workers (torchrun gives them their own sessions) and the agent
            if a.poll() is None:
                for pid in _worker_pids(a):
                    os.kill(pid, signal.SIGKILL)
                os.killpg(a.pid, signal.SIGKILL)


def _worker_pids(agent: subprocess.Popen) -> list[int]:
    res = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True)
    return [int(p) for p in res.stdout.split()]


def _rank_of(pid: int) -> int:
    env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
    return int(env[b"RANK"])


def _rows(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out)}


@pytest.fixture(scope="module")
def uninterrupted(inputs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("torchrun_full") / "run"
    codes = _wait(_agents(inputs, out, restarts=0))
    assert codes == [0, 0], log_tail(*(out / f"agent{i}.log" for i in range(2)))
    return out


def test_two_agents_train_over_c10d_rendezvous(uninterrupted):
    assert sorted(_rows(uninterrupted)) == list(range(1, STEPS + 1))
    assert (uninterrupted / "hf" / "config.json").is_file()


def test_killed_worker_restarts_and_resumes(inputs, uninterrupted, tmp_path):
    out = tmp_path / "run"
    agents = _agents(inputs, out, restarts=1)
    deadline = time.time() + 300
    while not ((out / "metrics.jsonl").exists() and any(r["step"] >= 2 for r in read_metrics(out))):
        assert time.time() < deadline, "no step 2 after 300 s"
        time.sleep(0.2)
    victims = [p for a in agents for p in _worker_pids(a) if _rank_of(p) == 1]
    assert len(victims) == 1, victims
    os.kill(victims[0], signal.SIGKILL)
    codes = _wait(agents)
    logs = "".join((out / f"agent{i}.log").read_text(errors="replace") for i in range(2))
    assert codes == [0, 0], logs[-4000:]
    assert re.search(r"resumed from .* at step [1-9]", logs), "the restarted workers did not resume"
    a, b = _rows(uninterrupted), _rows(out)
    assert sorted(b) == list(range(1, STEPS + 1))
    for step, row in a.items():
        for key in ("loss/pg_loss", "loss/kl", "loss/golden_loss", "logp/teacher_mean", "loss/grad_norm"):
            assert b[step][key] == pytest.approx(row[key], rel=1e-6, abs=1e-8), (step, key)


def test_agent_store_gets_a_prefix_per_attempt(monkeypatch, caplog):
    """Under torchrun's shared agent store, init_parallel keys each restart attempt apart (and warns on the
    multi-node case it cannot make safe); elsewhere it leaves the store to torch."""
    import torch.distributed as dist

    from megatron_opd.models.parallel import _elastic_store

    port = _free_port()
    master = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert _elastic_store(2, dist.constants.default_pg_timeout) is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    for attempt in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        _elastic_store(2, dist.constants.default_pg_timeout).set("k", f"from attempt {attempt}")
    assert master.get("megatron_opd/attempt_0/k") == b"from attempt 0"
    assert master.get("megatron_opd/attempt_1/k") == b"from attempt 1"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    with caplog.at_level("WARNING", logger="megatron_opd.parallel"):
        _elastic_store(2, dist.constants.default_pg_timeout)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in caplog.text
