"""The project's own sbatch scripts on a real Slurm cluster (`make test-slurm`): Debian's slurmctld and two
slurmd daemons on 127.0.0.1 with munge, brought up by scripts/slurm/local_cluster.sh. Nothing here is a
stand-in: real sbatch/srun/scancel/scontrol, real torchrun rendezvous across the two Slurm nodes, the real
trainer, converter and evaluator on the tiny CPU models (examples/slurm_cpu.yaml: PP=2 over the nodes, the
megatron teacher in its own layout, in-process generation). SGLang servers are not started here: the CPU
SGLang leg (make test-sglang) needs its own venv, so these jobs use ROLLOUT_BACKEND=local and
TEACHER_BACKEND=megatron.

Marked `slurm`: the default suite deselects them; they need SLURM_CONF of a running cluster, which
`make test-slurm` provides (and they fail, not skip, without it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _proc import explain, run
from megatron_opd.trainer.checkpoint import is_complete
from megatron_opd.trainer.logger import read_metrics

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "scripts" / "slurm"
STEPS = 8
# per-step metrics that depend on wall time or the machine's load, not on the computation
VOLATILE = re.compile(r"(time|/sec|per_s|throughput|mem|rss|_s$|elapsed|tokens_per)")


@pytest.fixture(scope="module")
def cluster() -> dict[str, str]:
    conf = os.environ.get("SLURM_CONF", "")
    if not conf or not Path(conf).is_file():
        pytest.fail("these tests need a running Slurm cluster: run `make test-slurm` (it starts "
                    "scripts/slurm/local_cluster.sh and sets SLURM_CONF)")
    res = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=30)
    idle = [line.split()[0] for line in res.stdout.splitlines() if line.split()[1:] == ["idle"]]
    assert len(idle) >= 2, f"the cluster needs two idle nodes: {res.stdout}{res.stderr}"
    return {"SLURM_CONF": conf}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """The tiny student/teacher and data the CPU profile reads, built by the documented command."""
    root = tmp_path_factory.mktemp("slurm_inputs")
    run([sys.executable, "-m", "megatron_opd.cli", "demo", "--tiny", "--inputs-only", "--out", root], timeout=600,
        cwd=ROOT)
    return {"student": root / "models" / "student", "teacher": root / "models" / "teacher",
            "train": root / "data" / "arith_train.jsonl", "eval": root / "data" / "arith_eval.jsonl"}


def _env(cluster, inputs, out: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "RANK", "WORLD_SIZE",
                                                                     "LOCAL_RANK"))}
    env.update(cluster, GPUS_PER_NODE="0", POLL_INTERVAL="1", CONFIG="examples/slurm_cpu.yaml",
               STUDENT=str(inputs["student"]), TEACHER=str(inputs["teacher"]), OUT=str(out),
               ROLLOUT_BACKEND="local", TEACHER_BACKEND="megatron", PYTHON=sys.executable)
    env.update(extra)
    return env


def _overrides(inputs) -> list[str]:
    return [f"data.train_path={inputs['train']}", f"data.eval_paths=[arith={inputs['eval']}]", f"train.steps={STEPS}"]


def _submit(env: dict[str, str], log: Path, *args: str, script: str = "opd_7b.sbatch") -> subprocess.CompletedProcess:
    return subprocess.run([str(SLURM / "submit.sh"), "--nodes=2", f"--output={log}", str(SLURM / script), *args],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)


def _job(env, job: str) -> dict[str, str]:
    res = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, explain(res)
    return dict(kv.split("=", 1) for kv in res.stdout.split() if "=" in kv)


def _wait(env, job: str, states: tuple[str, ...], timeout: float, log: Path) -> dict[str, str]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = _job(env, job)
        if info["JobState"] in states:
            return info
        time.sleep(1)
    subprocess.run(["scancel", job], env=env, timeout=30)
    raise AssertionError(f"job {job} not in {states} after {timeout}s: {info['JobState']}\n{_tail(log)}")


def _job_failure(env, info: dict[str, str], text: str) -> str:
    """What a failed job left: its state and reason, the end of its output and of the daemons' logs."""
    parts = [" ".join(f"{k}={info.get(k)}" for k in ("JobState", "Reason", "ExitCode", "Restarts", "NodeList")),
             "-- job output --", text[-3000:]]
    for daemon_log in sorted((Path(env["SLURM_CONF"]).parent / "log").glob("slurm*.log")):
        parts += [f"-- {daemon_log.name} --", daemon_log.read_text(errors="replace")[-1500:]]
    return "\n".join(parts)


def _tail(log: Path, n: int = 4000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else "(no job output)"


def _wait_for_step(out: Path, step: int, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if any(r["step"] >= step for r in read_metrics(out)):
                return
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"no metrics row for step {step} in {out} after {timeout}s")


def _metrics(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out)}  # the last row of a step wins (a resumed run re-logs it)


def _assert_same_run(ref: Path, other: Path) -> None:
    a, b = _metrics(ref), _metrics(other)
    assert sorted(b) == sorted(a) == list(range(1, STEPS + 1))
    compared = 0
    for step, row in a.items():
        for key, value in row.items():
            if VOLATILE.search(key) or not isinstance(value, (int, float)):
                continue
            assert b[step].get(key) == pytest.approx(value, rel=1e-6, abs=1e-8), (step, key)
            compared += 1
    assert compared > 20 * STEPS


@pytest.fixture(scope="module")
def full_job(cluster, inputs, tmp_path_factory):
    """(a): converter round trip at the training layout across both nodes, training, export, eval."""
    tmp = tmp_path_factory.mktemp("full")
    out, log = tmp / "run", tmp / "job.out"
    env = _env(cluster, inputs, out, CONVERT_CHECK="1", EVAL_ARGS=f"--benchmarks arith={inputs['eval']} --k 1 "
               "--temperature 0 --max-new-tokens 16 --no-chat-template")
    t0 = time.time()
    res = _submit(env, log, *_overrides(inputs))
    assert res.returncode == 0, explain(res)
    job = res.stdout.strip()
    info = _wait(env, job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 600, log)
    assert info["JobState"] == "COMPLETED", _tail(log)
    return {"out": out, "log": log, "job": job, "info": info, "seconds": time.time() - t0}


def test_full_job_converts_trains_exports_and_evaluates(full_job):
    out, text, info = full_job["out"], full_job["log"].read_text(errors="replace"), full_job["info"]
    assert info["NodeList"] == "n[1-2]" and info["NumNodes"] == "2"
    # check-config ran as the first step, on both nodes
    assert text.count("config ok:") == 2, text[:3000]
    # hf -> mcore with PP=2: one torchrun per node, so each pipeline stage on its own Slurm node
    assert re.search(r"wrote torch_dist checkpoint \S+ \(tp=1, pp=2", text), text[-3000:]
    assert (out / "logs" / "convert.node1.log").is_file()
    verify = json.loads(re.search(r"^verify-json: (.*)$", text, re.M).group(1))
    assert verify["ok"] and verify["max_abs_logit_diff"] <= 1e-3 and verify["argmax_agreement"] == 1.0
    # training over both nodes: rank 1's torchrun logged on node n2
    assert (out / "logs" / "train.node1.log").is_file()
    assert sorted(_metrics(out)) == list(range(1, STEPS + 1))
    assert json.loads((out / "hf" / "opd_meta.json").read_text())["step"] == STEPS
    results = json.loads((out / "eval" / "results.json").read_text())
    assert "arith" in json.dumps(results)
    print(f"full job: {full_job['seconds']:.0f} s")


def _wait_for_text(log: Path, text: str, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while text not in (log.read_text(errors="replace") if log.exists() else ""):
        assert time.time() < deadline, f"{text!r} not in the job output after {timeout}s:\n{_tail(log)}"
        time.sleep(0.2)


def test_preempted_job_requeues_and_ends_as_the_uninterrupted_run(cluster, inputs, full_job, tmp_path):
    """(b): USR1 to the batch shell while the job runs -> checkpoint at the end of the step, requeue, resume;
    the metrics equal the full job's. The signal goes in once check-config has passed on both nodes, i.e.
    while the trainer starts: a tiny step takes about a second, so a signal sent after a step is logged can
    land after the last one on a loaded machine; the request waits for the step boundary either way."""
    out, log = tmp_path / "run", tmp_path / "job.out"
    env = _env(cluster, inputs, out)
    res = _submit(env, log, *_overrides(inputs))
    assert res.returncode == 0, explain(res)
    job = res.stdout.strip()
    deadline = time.time() + 180
    while (log.read_text(errors="replace") if log.exists() else "").count("config ok:") < 2:
        assert time.time() < deadline, _tail(log)
        time.sleep(0.2)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=env, check=True, timeout=30)
    info = _wait(env, job, ("PENDING", "COMPLETED", "FAILED"), 180, log)
    assert info["JobState"] == "PENDING" and info["Restarts"] == "1", (info, _tail(log))
    marker = json.loads((out / "preempted.json").read_text())
    assert 1 <= marker["step"] < STEPS, marker
    # Slurm holds a requeued job until its revoked launch credential has expired (BeginTime, ~2 minutes). The
    # test shortens that but keeps a few seconds: a credential issued in the same second as the revocation
    # counts as revoked (second granularity), the relaunch fails on the node and the job ends FAILED.
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now+5"], env=env, check=True, timeout=30)
    info = _wait(env, job, ("COMPLETED", "FAILED", "CANCELLED"), 600, log)
    text = log.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED", _job_failure(env, info, text)
    assert f"checkpointed at step {marker['step']}" in text and "requeued" in text
    assert "requeued job (restart 1)" in text
    assert f"resumed from" in text and f"at step {marker['step']}" in text
    _assert_same_run(full_job["out"], out)


def test_preemption_before_training_starts_is_kept(cluster, inputs, tmp_path):
    """USR1 while the job is still converting (before the trainer loads): the request survives the trainer's
    start, training stops after its first step with a checkpoint, and the job requeues."""
    out, log = tmp_path / "run", tmp_path / "job.out"
    env = _env(cluster, inputs, out, CONVERT_CHECK="1")
    # a stale marker of an earlier job must not count: the job clears it at start
    out.mkdir(parents=True)
    (out / "preempted.json").write_text('{"step": 99, "reason": "stale"}')
    res = _submit(env, log, *_overrides(inputs))
    assert res.returncode == 0, explain(res)
    job = res.stdout.strip()
    _wait_for_text(log, "convert check:")
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=env, check=True, timeout=30)
    info = _wait(env, job, ("PENDING", "COMPLETED", "FAILED"), 300, log)
    text = log.read_text(errors="replace")
    assert info["JobState"] == "PENDING" and info["Restarts"] == "1", (info, text[-4000:])
    assert "verify: max |logit diff|" in text, "the convert check finished despite the signal"
    assert json.loads((out / "preempted.json").read_text())["step"] == 1
    subprocess.run(["scancel", job], env=env, check=True, timeout=30)


def _procs():
    """(pid, argv, environment, stat fields after the command name) of every process we can read."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = dict(kv.split(b"=", 1) for kv in (proc / "environ").read_bytes().split(b"\0") if b"=" in kv)
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        yield int(proc.name), cmd, env, stat


def _rank_pid(job: str, rank: int) -> int:
    """The pid of the training worker of `rank` in `job` (found by its environment)."""
    for pid, cmd, env, stat in _procs():
        # parent 1: an orphan of an earlier cluster's job with the same id, not this job's worker
        if (b"megatron_opd.cli" in cmd and env.get(b"SLURM_JOB_ID") == job.encode()
                and env.get(b"RANK") == str(rank).encode() and stat[1] != "1"):
            return pid
    raise AssertionError(f"no training worker of rank {rank} in job {job}")


def _processes_of(job: str, since: float) -> list[int]:
    """Live processes of `job` started after `since` (job ids repeat across local clusters)."""
    boot = time.time() - float(Path("/proc/uptime").read_text().split()[0])
    return [pid for pid, _, env, stat in _procs()
            if env.get(b"SLURM_JOB_ID") == job.encode() and stat[0] not in ("Z", "X")
            and boot + int(stat[19]) / os.sysconf("SC_CLK_TCK") >= since - 1]


def _kill_rank_while_it_has_forked(job: str, rank: int, timeout: float = 60) -> int:
    """SIGKILL the training worker of `rank` while it waits for the helpers megatron's checkpoint writer forks
    during every save (save_every: 1), then let the helpers go on. A rank killed at that moment once left the
    job waiting a minute: the helpers blocked on the dead rank's lock and lived on, holding its gloo sockets
    open. The helpers are frozen (SIGSTOP) until the rank is asleep waiting for them, so the moment is hit
    every time, not by chance. Returns the worker's pid."""
    pid = _rank_pid(job, rank)
    main = Path(f"/proc/{pid}/task/{pid}")
    deadline = time.time() + timeout
    while time.time() < deadline:
        helpers = [int(c) for c in (main / "children").read_text().split()]
        if not helpers:
            time.sleep(0.001)
            continue
        for h in helpers:
            os.kill(h, signal.SIGSTOP)
        waiting = time.time() + 2
        while time.time() < waiting and not (main / "wchan").read_text().startswith("futex"):
            time.sleep(0.01)
        killed = (main / "wchan").read_text().startswith("futex")
        if killed:
            os.kill(pid, signal.SIGKILL)
        for h in helpers:
            try:
                os.kill(h, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if killed:
            return pid
    raise AssertionError(f"rank {rank} (pid {pid}) never waited for a forked helper in {timeout:.0f} s")


def test_node_fault_fails_fast_naming_the_rank_and_resubmission_resumes(cluster, inputs, full_job, tmp_path):
    """(c): a rank SIGKILLed mid-step (while its checkpoint writer's helpers run) -> the job fails in bounded
    time, naming it; no corrupt checkpoint;
    the same job submitted again resumes from the last complete checkpoint and ends as the full job."""
    out, log = tmp_path / "run", tmp_path / "job.out"
    env = _env(cluster, inputs, out)
    submitted = time.time()
    res = _submit(env, log, *_overrides(inputs))
    assert res.returncode == 0, explain(res)
    job = res.stdout.strip()
    _wait_for_step(out, 2)
    _kill_rank_while_it_has_forked(job, 1)
    killed_at = time.time()
    info = _wait(env, job, ("FAILED", "COMPLETED", "CANCELLED"), 120, log)
    failed_in = time.time() - killed_at
    text = log.read_text(errors="replace")
    assert info["JobState"] == "FAILED", text[-4000:]
    assert failed_in < 60, f"the job took {failed_in:.0f} s to fail"
    assert not _processes_of(job, submitted), "processes of the failed job outlived it"
    err = next(line for line in text.splitlines() if "ERROR: training failed" in line)
    assert "node n2 (node_rank 1" in err and "rank 1" in err and "SIGKILL" in err, err
    # every checkpoint the run kept is complete and loads
    ckpts = out / "checkpoints"
    latest = (ckpts / "latest").read_text().strip()
    assert (ckpts / latest).is_dir()
    for d in sorted(ckpts.glob("step_*")):
        assert is_complete(d) and (d / "shared").is_dir(), d  # the torch_dist student + optimizer, all ranks' files
        for rank in (0, 1):
            torch.load(d / f"rank{rank}.pt", weights_only=True)
    last_good = int(latest.split("_")[-1])
    assert last_good >= 1

    log2 = tmp_path / "job2.out"
    res = _submit(env, log2, *_overrides(inputs))
    assert res.returncode == 0, explain(res)
    info = _wait(env, res.stdout.strip(), ("COMPLETED", "FAILED", "CANCELLED"), 600, log2)
    assert info["JobState"] == "COMPLETED", _tail(log2)
    assert f"at step {last_good}" in log2.read_text(errors="replace")
    _assert_same_run(full_job["out"], out)
    print(f"node fault: job failed {failed_in:.1f} s after the kill")


@pytest.mark.parametrize("extra_args,extra_env,message", [
    (["--nodes=3"], {}, "Requested node configuration is not available"),
    ([], {"CPUS_PER_TASK": "64"}, "Requested node configuration is not available"),
    ([], {"GPUS_PER_NODE": "8"}, "Invalid generic resource"),
])
def test_impossible_request_fails_fast_with_a_message(cluster, inputs, tmp_path, extra_args, extra_env, message):
    """(d): a request the cluster can never meet is refused at submission, never left PENDING."""
    env = _env(cluster, inputs, tmp_path / "run", **extra_env)
    t0 = time.time()
    res = subprocess.run([str(SLURM / "submit.sh"), *extra_args, str(SLURM / "opd_7b.sbatch")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and time.time() - t0 < 30, explain(res)
    assert "the cluster cannot run this request" in res.stderr and message in res.stderr, explain(res)
    assert res.stdout.strip() == "", "nothing may be submitted"
    queue = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True, timeout=30).stdout
    assert queue.strip() == "", queue


def test_wrong_python_fails_the_job_with_a_message(cluster, inputs, tmp_path):
    """A PYTHON without torch/megatron_opd: the job fails in seconds, saying which python and what to set."""
    log = tmp_path / "job.out"
    env = _env(cluster, inputs, tmp_path / "run", PYTHON="/usr/bin/python3")
    res = _submit(env, log, *_overrides(inputs))
    assert res.returncode == 0, explain(res)
    info = _wait(env, res.stdout.strip(), ("FAILED", "COMPLETED"), 120, log)
    assert info["JobState"] == "FAILED"
    assert "PYTHON='/usr/bin/python3' cannot import torch and megatron_opd" in log.read_text()
