# shellcheck shell=bash
# Shared functions for the sbatch scripts in this folder; sourced, never run on its own.
#
# Each script places three roles on the job's nodes: SGLang servers (student rollout, teacher
# scoring), started first and polled on /health, then one torchrun per training node. Every
# background step is killed by the EXIT trap, so a failed or cancelled job leaves no server behind.
#
# DRY_RUN=1 prints each command that would run (a "+ " line, shell-quoted) and starts nothing;
# tests use it with a fake `scontrol` to check the rendered commands.
#
# Knobs (env): PYTHON (default: the checkout's .venv/bin/python when there is one, else python3), TORCHRUN
# (default: the torchrun beside PYTHON), SRUN, SRUN_ARGS (extra srun options), SERVER_TIMEOUT (s),
# POLL_INTERVAL (s), MASTER_ADDR, MASTER_PORT, CHECK_CONFIG=0 (skip the config check before the servers
# start; PLAN_GPU=h100-80gb: it also plans the trainer ranks' memory on that GPU, "" off, PLAN_STRICT=1 to
# fail a layout that does not fit instead of warning), SGLANG_API_KEY (default: a random key per job), GPUS_PER_NODE (default: Slurm's
# SLURM_GPUS_PER_NODE, else 8; 0 = CPU/gloo: no GPUs are bound and each node runs NPROC_PER_NODE training
# ranks, default 1), CONVERT_CHECK=1 (before training: hf->mcore at the training layout across the
# nodes, then mcore->hf --verify), EVAL_ARGS (after training: `megatron-opd eval` arguments for the
# exported student, e.g. "--benchmarks math500 --k 1"), PREEMPT_GRACE (s a preempted job waits for every
# rank to checkpoint, default 120).
#
# Addresses: node names come from `scontrol show hostnames`; each is used as a network address only when
# `getent hosts` resolves it, else the node's NodeAddr from `scontrol show node` (names need not resolve).
#
# Preemption: the scripts ask for `--signal=B:USR1@300 --requeue`. On USR1 the batch shell writes
# $OUT/preempt.request; the trainer finishes its step, checkpoints, writes $OUT/preempted.json and exits;
# the script then requeues the job (`scontrol requeue`), and the requeued job resumes from that checkpoint.
#
# API key: the servers accept weight updates, so each gets an API key. The key is SGLANG_API_KEY,
# generated per job from /dev/urandom unless set, exported so the trainer (srun passes the
# environment on) reads it through rollout.api_key_env / teacher.api_key_env, and never printed or put
# on a command line: each server runs under megatron_opd/rollout/keyed_launch.py, which reads it from
# the environment, hands it to SGLang as --api-key inside the process (not in `ps`) and redacts it from
# everything the server and its workers write to their logs.

DRY_RUN="${DRY_RUN:-0}"
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=python3
    [[ -x "${REPO_ROOT:-.}/.venv/bin/python" ]] && PYTHON="${REPO_ROOT:-.}/.venv/bin/python"
fi
if [[ -z "${TORCHRUN:-}" ]]; then
    TORCHRUN=torchrun
    [[ "$PYTHON" == */* && -x "$(dirname "$PYTHON")/torchrun" ]] && TORCHRUN="$(dirname "$PYTHON")/torchrun"
fi
GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_PER_NODE:-8}}"
GPUS_PER_NODE="${GPUS_PER_NODE##*:}"   # Slurm may write "gpu:8" / "a100:8"
NPROC_PER_NODE="${NPROC_PER_NODE:-1}"
CONVERT_CHECK="${CONVERT_CHECK:-0}"
EVAL_ARGS="${EVAL_ARGS:-}"
PREEMPT_GRACE="${PREEMPT_GRACE:-120}"
SRUN="${SRUN:-srun}"
SRUN_ARGS="${SRUN_ARGS:-}"
SERVER_TIMEOUT="${SERVER_TIMEOUT:-1800}"
POLL_INTERVAL="${POLL_INTERVAL:-10}"
CHECK_CONFIG="${CHECK_CONFIG:-1}"
PLAN_GPU="${PLAN_GPU-h100-80gb}"   # the config check also plans the trainer ranks' memory on this GPU ("": off)
PLAN_STRICT="${PLAN_STRICT:-0}"    # 1: a trainer rank that does not fit fails the check (default: a warning)

NODES=()        # node names of the job, in SLURM order (for --nodelist)
ADDRS=()        # their network addresses (for servers, URLs and rendezvous), same order
PREEMPT_REQUESTED=0
OUT_DIR=""      # set by prepare_out_dir: where the preemption request and marker live
BG_PIDS=()      # every background step started here; killed on exit
SERVER_NAMES=()
SERVER_URLS=()
SERVER_PIDS=()
SERVER_LOGS=()
TRAIN_PIDS=()
TRAIN_NODE_NAMES=()

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

is_dry_run() { [[ "$DRY_RUN" == 1 ]]; }

# Print a command as one shell-quoted "+ ..." line.
show_cmd() {
    printf '+'
    printf ' %q' "$@"
    printf '\n'
}

# launch_bg LOGFILE CMD... : start CMD in the background (stdout+stderr to LOGFILE, or to the job's
# own output when LOGFILE is "-"); sets LAST_PID. In dry-run mode only prints it.
launch_bg() {
    local logfile=$1
    shift
    LAST_PID=""
    if is_dry_run; then
        show_cmd "$@"
        return 0
    fi
    if [[ "$logfile" == "-" ]]; then
        "$@" &
    else
        "$@" >"$logfile" 2>&1 &
    fi
    LAST_PID=$!
    BG_PIDS+=("$LAST_PID")
}

# cleanup: TERM every background step (srun forwards it to the tasks), then KILL stragglers.
cleanup() {
    local rc=$? pid i
    trap - EXIT TERM INT
    if ((${#BG_PIDS[@]} > 0)); then
        log "stopping ${#BG_PIDS[@]} background step(s)"
        for pid in "${BG_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
        for ((i = 0; i < 20; i++)); do
            local alive=0
            for pid in "${BG_PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
            ((alive)) || break
            sleep 0.5
        done
        for pid in "${BG_PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
    fi
    exit "$rc"
}

install_cleanup_trap() {
    trap cleanup EXIT
    trap 'exit 143' TERM
    trap 'exit 130' INT
}

# gpu_count "0,1,2,3" -> 4; rejects anything but a comma list of GPU indices.
gpu_count() {
    [[ "$1" =~ ^[0-9]+(,[0-9]+)*$ ]] || die "GPU list '$1': expected comma-separated indices, e.g. 0,1,2,3"
    local -a ids
    IFS=, read -r -a ids <<<"$1"
    echo "${#ids[@]}"
}

# slurm_setup: NODES from SLURM_JOB_NODELIST (via scontrol), MASTER_PORT from the job id so two
# jobs sharing a node do not collide; installs the cleanup trap.
slurm_setup() {
    trap on_preempt_signal USR1   # first: the default action of USR1 would end the batch shell
    [[ -n "${SLURM_JOB_NODELIST:-}" ]] ||
        die "SLURM_JOB_NODELIST is not set: submit with sbatch (for a dry run set it and DRY_RUN=1)"
    local hosts
    if is_dry_run && ! command -v scontrol >/dev/null; then   # a dry run off-cluster: expand it ourselves
        hosts=$("$PYTHON" -m megatron_opd.launch hostnames "$SLURM_JOB_NODELIST") ||
            die "cannot expand SLURM_JOB_NODELIST='$SLURM_JOB_NODELIST'"
    else
        hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST") ||
            die "scontrol show hostnames '$SLURM_JOB_NODELIST' failed"
    fi
    mapfile -t NODES <<<"$hosts"
    [[ -n "${NODES[0]:-}" ]] || die "no hosts in SLURM_JOB_NODELIST='$SLURM_JOB_NODELIST'"
    if [[ -n "${SLURM_NNODES:-}" ]] && ((SLURM_NNODES != ${#NODES[@]})); then
        die "SLURM_NNODES=$SLURM_NNODES but SLURM_JOB_NODELIST expands to ${#NODES[@]} hosts"
    fi
    local name
    for name in "${NODES[@]}"; do ADDRS+=("$(node_addr "$name")"); done
    [[ "$GPUS_PER_NODE" =~ ^[0-9]+$ ]] || die "GPUS_PER_NODE='$GPUS_PER_NODE': expected a number (0 = CPU/gloo)"
    [[ "$NPROC_PER_NODE" =~ ^[1-9][0-9]*$ ]] || die "NPROC_PER_NODE='$NPROC_PER_NODE': expected a positive number"
    if ! is_dry_run; then
        "$PYTHON" -c 'import torch, megatron_opd' 2>/dev/null ||
            die "PYTHON='$PYTHON' cannot import torch and megatron_opd: set PYTHON to the python of the venv that has megatron-opd installed (make venv makes $REPO_ROOT/.venv)"
    fi
    ((${SLURM_RESTART_COUNT:-0} == 0)) || log "requeued job (restart ${SLURM_RESTART_COUNT}): training resumes from its last checkpoint"
    export MASTER_PORT="${MASTER_PORT:-$((29500 + ${SLURM_JOB_ID:-0} % 1000))}"
    install_cleanup_trap
}

# node_addr NAME: NAME when it resolves (getent), else the node's NodeAddr from Slurm.
node_addr() {
    local name=$1 addr
    if getent hosts "$name" >/dev/null 2>&1; then
        echo "$name"
        return 0
    fi
    addr=$(scontrol show node "$name" -o 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p')
    if [[ -n "$addr" ]]; then
        echo "$addr"
    elif is_dry_run; then
        echo "$name"
    else
        die "node '$name' does not resolve (getent hosts) and 'scontrol show node $name' gives no NodeAddr"
    fi
}

# addr_of NODE: the address slurm_setup found for NODE.
addr_of() {
    local i
    for ((i = 0; i < ${#NODES[@]}; i++)); do
        [[ "${NODES[i]}" == "$1" ]] && { echo "${ADDRS[i]}"; return 0; }
    done
    die "addr_of: '$1' is not a node of this job"
}

# The batch shell got USR1 (`#SBATCH --signal=B:USR1@N` or `scancel --batch --signal=USR1`): ask the
# trainer to checkpoint and stop at the end of its step (trainer/preempt.py reads the request file).
# A signal before the trainer runs (server start, convert check) leaves the request in place: the trainer
# stops after its first step. Returns 0 always (a trap's status must not trip `set -e`).
on_preempt_signal() {
    PREEMPT_REQUESTED=1
    log "preemption signal: asking the trainer to checkpoint and stop (${OUT_DIR:-?}/preempt.request)"
    if [[ -n "$OUT_DIR" ]] && ! is_dry_run; then : >"$OUT_DIR/preempt.request" || true; fi
    return 0
}

# requeue_if_preempted: after training stopped, when the trainer checkpointed on a request
# ($OUT_DIR/preempted.json), requeue the job and exit 0; otherwise return.
requeue_if_preempted() {
    [[ -n "$OUT_DIR" && -f "$OUT_DIR/preempted.json" ]] || return 0
    log "trainer checkpointed on preemption: $(cat "$OUT_DIR/preempted.json")"
    if [[ -n "${SLURM_JOB_ID:-}" ]] && scontrol requeue "$SLURM_JOB_ID"; then
        log "job $SLURM_JOB_ID requeued; it resumes from the checkpoint"
    else
        log "could not requeue job ${SLURM_JOB_ID:-?} (submit with --requeue?): resubmit it to resume"
    fi
    exit 0
}

require_nodes() {
    ((${#NODES[@]} >= $1)) || die "this layout needs $1 node(s) but the job has ${#NODES[@]} (sbatch --nodes=$1)"
}

# prepare_out_dir OUT: the job's output folder. A preemption request or marker left by an earlier job is
# removed here, so that only this job's requests count (a requeued job whose trainer fails early must fail,
# not requeue again on the old marker). A USR1 that arrived before this is written out now.
prepare_out_dir() {
    OUT_DIR=$1
    is_dry_run && return 0
    mkdir -p "$1/logs"
    rm -f "$1/preempt.request" "$1/preempted.json"
    if ((PREEMPT_REQUESTED)); then : >"$1/preempt.request"; fi
}

# wait_pid PID: PID's exit status. A trapped signal (USR1) interrupts `wait` with a status > 128 while
# the step still runs: wait again.
wait_pid() {
    local pid=$1 rc
    while true; do
        rc=0
        wait "$pid" || rc=$?
        if ((rc > 128)) && kill -0 "$pid" 2>/dev/null; then
            continue
        fi
        if ((rc > 128)); then   # it ended as the signal came: its status is still there to collect
            local again=0
            wait "$pid" 2>/dev/null || again=$?
            ((again == 127)) || rc=$again
        fi
        return "$rc"
    done
}

# check_config CONFIG OVERRIDES... : fail in seconds on a bad YAML or override or a missing model/data path,
# before any server spends minutes loading weights.
check_config() {
    local config=$1
    shift
    [[ -f "$config" ]] || die "config file '$config' not found (relative paths are from $(pwd))"
    [[ "$CHECK_CONFIG" == 1 ]] || return 0
    local plan=()
    [[ -n "$PLAN_GPU" ]] && plan=(--plan-gpu "$PLAN_GPU")
    [[ "$PLAN_STRICT" == 1 && -n "$PLAN_GPU" ]] && plan+=(--plan-strict)
    if is_dry_run; then   # a dry run off-cluster has no model or data paths to check
        "$PYTHON" -m megatron_opd.launch check-config --skip-paths "${plan[@]}" --config "$config" "$@" >&2 ||
            die "config check failed for $config (see the message above)"
        return 0
    fi
    # The job's first step, on every node: each sees the paths through its own mounts, and WORLD_SIZE
    # (CHECK_WORLD_SIZE, set by the script to its training ranks) is checked against the layout.
    local n=${#NODES[@]}
    "$SRUN" --nodes="$n" --ntasks="$n" --ntasks-per-node=1 \
        env ${CHECK_WORLD_SIZE:+WORLD_SIZE="$CHECK_WORLD_SIZE"} \
        "$PYTHON" -m megatron_opd.launch check-config "${plan[@]}" --config "$config" "$@" >&2 ||
        die "config check failed for $config on the job's nodes (see the message above)"
}

# ranks_per_node GPUS: training ranks a node runs (the GPUs listed, or NPROC_PER_NODE without GPUs).
ranks_per_node() {
    if ((GPUS_PER_NODE == 0)); then echo "$NPROC_PER_NODE"; else gpu_count "$1"; fi
}

# server_url NAME NODE PORT: NAME_URL (e.g. ROLLOUT_URL) when set, else http://<NODE's address>:PORT.
server_url() {
    local var="${1^^}_URL"
    if [[ -n "${!var:-}" ]]; then echo "${!var}"; else echo "http://$(addr_of "$2"):$3"; fi
}

# ensure_api_key: SGLANG_API_KEY for this job's servers and trainer (see the header); never echoed.
ensure_api_key() {
    if [[ -z "${SGLANG_API_KEY:-}" ]]; then
        SGLANG_API_KEY=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
        [[ ${#SGLANG_API_KEY} -eq 64 ]] || die "could not read a random API key from /dev/urandom"
    fi
    export SGLANG_API_KEY
}

# The launcher that gives a server $SGLANG_API_KEY on the compute node (stdlib only: any python runs it).
KEYED_LAUNCH=("${REPO_ROOT:-.}/megatron_opd/rollout/keyed_launch.py" --key-env SGLANG_API_KEY)

# srun_on NODE CUDA_VISIBLE_DEVICES CMD... : the step prefix placing CMD on one node with the given
# GPUs. --overlap lets servers and trainers share a node; `env` runs after SLURM's own GPU binding,
# so our CUDA_VISIBLE_DEVICES wins.
SRUN_PREFIX=()
srun_prefix() {
    local node=$1 gpus=$2
    local -a extra=()
    [[ -n "$SRUN_ARGS" ]] && read -r -a extra <<<"$SRUN_ARGS"
    ((GPUS_PER_NODE > 0)) || gpus=""   # CPU/gloo: no GPU is visible to the step
    SRUN_PREFIX=("$SRUN" --overlap --nodes=1 --ntasks=1 --nodelist="$node" ${extra[@]+"${extra[@]}"}
        env CUDA_VISIBLE_DEVICES="$gpus")
}

# start_sglang NAME NODES_CSV GPUS PORT MODEL TP PP OUT_DIR [EXTRA_ARGS...]
# One SGLang server over the GPUs GPUS of each node in NODES_CSV. One node: data-parallel replicas
# fill the GPUs (dp = #GPUs / (tp*pp)). Several nodes: one replica spanning them (tp*pp = all GPUs),
# HTTP served by the first node. Each node binds its own hostname. Token ids in and out
# (--skip-tokenizer-init), as the in-tree clients expect (rollout/server.py, teacher/sglang.py).
start_sglang() {
    local name=$1 nodes_csv=$2 gpus=$3 port=$4 model=$5 tp=$6 pp=$7 out=$8
    shift 8
    local -a nodes
    IFS=, read -r -a nodes <<<"$nodes_csv"
    local nnodes=${#nodes[@]} ngpu=1
    ((GPUS_PER_NODE == 0)) || ngpu=$(gpu_count "$gpus")
    [[ -n "$model" ]] || die "$name: model path is empty"
    [[ "$tp" =~ ^[1-9][0-9]*$ && "$pp" =~ ^[1-9][0-9]*$ ]] || die "$name: tp=$tp pp=$pp must be positive integers"
    local total=$((ngpu * nnodes))
    ((total % (tp * pp) == 0)) || die "$name: tp*pp=$((tp * pp)) does not divide its $total GPU(s)"
    local dp=$((total / (tp * pp)))
    ((nnodes == 1 || dp == 1)) ||
        die "$name: a multi-node server must be one replica (tp*pp = $total GPUs), got tp=$tp pp=$pp"
    is_dry_run || [[ -e "$model" ]] ||
        log "warning: $name model '$model' not found on $(hostname) (fine for a hub id or a path mounted only on the compute nodes)"
    ensure_api_key
    local head i host_var="${name^^}_HOST"
    head=$(addr_of "${nodes[0]}")
    for ((i = 0; i < nnodes; i++)); do
        local bind
        bind=$(addr_of "${nodes[i]}")
        ((i == 0)) && [[ -n "${!host_var:-}" ]] && bind=${!host_var}   # ROLLOUT_HOST / TEACHER_HOST: bind address
        local -a cmd=("$PYTHON" "${KEYED_LAUNCH[@]}" -m sglang.launch_server --model-path "$model" --host "$bind"
            --port "$port" --tp-size "$tp" --dp-size "$dp" --skip-tokenizer-init)
        ((pp > 1)) && cmd+=(--pp-size "$pp")
        ((nnodes > 1)) && cmd+=(--nnodes "$nnodes" --node-rank "$i" --dist-init-addr "$head:$((port + 1000))")
        cmd+=("$@")
        srun_prefix "${nodes[i]}" "$gpus"
        launch_bg "$out/logs/sglang_$name.node$i.log" "${SRUN_PREFIX[@]}" "${cmd[@]}"
        if ((i == 0)); then
            SERVER_NAMES+=("$name")
            SERVER_URLS+=("$(server_url "$name" "${nodes[0]}" "$port")")
            SERVER_PIDS+=("$LAST_PID")
            SERVER_LOGS+=("$out/logs/sglang_$name.node0.log")
        fi
    done
}

http_ok() {
    if command -v curl >/dev/null 2>&1; then
        curl -sf -m 5 -o /dev/null "$1"
    else
        python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' "$1" 2>/dev/null
    fi
}

# wait_for_server NAME URL PID LOG TIMEOUT: poll URL/health until it answers 200; fail early when the
# server step exits, and after TIMEOUT seconds.
wait_for_server() {
    local name=$1 url=$2 pid=$3 logfile=$4 timeout=$5
    if is_dry_run; then
        echo "# wait for $name: $url/health (timeout ${timeout}s)"
        return 0
    fi
    local deadline=$((SECONDS + timeout))
    until http_ok "$url/health"; do
        if [[ -n "$pid" ]] && ! kill -0 "$pid" 2>/dev/null; then
            die "$name server exited before it became healthy; see $logfile"
        fi
        ((SECONDS < deadline)) || die "$name server at $url not healthy after ${timeout}s; see $logfile"
        sleep "$POLL_INTERVAL"
    done
    log "$name server ready at $url"
}

wait_for_servers() {
    local i
    for ((i = 0; i < ${#SERVER_NAMES[@]}; i++)); do
        wait_for_server "${SERVER_NAMES[i]}" "${SERVER_URLS[i]}" "${SERVER_PIDS[i]}" "${SERVER_LOGS[i]}" "$SERVER_TIMEOUT"
    done
}

# one_replica NAME GPUS TP: the rollout server must be one replica (tp = its GPUs on one node): the
# trainer's weight group ranks SGLang's side as 1 + tp_rank, so data-parallel replicas would collide.
one_replica() {
    ((GPUS_PER_NODE > 0)) || return 0
    local n
    n=$(gpu_count "$2")
    ((n == $3)) || die "$1: disaggregated weight sync needs one SGLang replica: set ROLLOUT_TP=$n (the number of ROLLOUT_GPUS), got $3"
}

# start_training NODES_CSV GPUS OUT_DIR TRAIN_ARGS... : one torchrun per node (static rendezvous on
# the first node, node_rank = position in NODES_CSV) running `megatron_opd.cli train TRAIN_ARGS`.
# Node 0 writes to the job's output, the others to OUT_DIR/logs.
start_training() {
    local nodes_csv=$1 gpus=$2 out=$3
    shift 3
    local -a nodes
    IFS=, read -r -a nodes <<<"$nodes_csv"
    local nproc
    nproc=$(ranks_per_node "$gpus")
    local master=${MASTER_ADDR:-$(addr_of "${nodes[0]}")}
    TRAIN_NPROC=$nproc
    # CPU threads per rank follow the allocation (torchrun would pin 1 per worker otherwise)
    if [[ -z "${OMP_NUM_THREADS:-}" && -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
        export OMP_NUM_THREADS=$((SLURM_CPUS_PER_TASK / nproc > 0 ? SLURM_CPUS_PER_TASK / nproc : 1))
    fi
    # where a disaggregated rollout server reaches trainer rank 0 for the weight-sync rendezvous
    export MEGATRON_OPD_WEIGHT_SYNC_ADDR="${MEGATRON_OPD_WEIGHT_SYNC_ADDR:-$master}"
    torchrun_nodes train "$MASTER_PORT" "$nproc" "$gpus" "$out" "$nodes_csv" train "$@"
    TRAIN_PIDS+=(${NODE_PIDS[@]+"${NODE_PIDS[@]}"})
    TRAIN_NODE_NAMES+=("${nodes[@]}")
}

# torchrun_nodes NAME PORT NPROC GPUS OUT_DIR NODES_CSV CLI_ARGS... : one torchrun per node of NODES_CSV (static
# rendezvous on the first node's address at PORT, node_rank = position) running `megatron_opd.cli CLI_ARGS`;
# node 0 logs to the job's output, the others to OUT_DIR/logs/NAME.nodeK.log. Sets NODE_PIDS.
NODE_PIDS=()
torchrun_nodes() {
    local name=$1 port=$2 nproc=$3 gpus=$4 out=$5 nodes_csv=$6
    shift 6
    local -a nodes
    IFS=, read -r -a nodes <<<"$nodes_csv"
    local nnodes=${#nodes[@]} i master
    master=${MASTER_ADDR:-$(addr_of "${nodes[0]}")}
    NODE_PIDS=()
    for ((i = 0; i < nnodes; i++)); do
        local logfile=-
        ((i == 0)) || logfile="$out/logs/$name.node$i.log"
        srun_prefix "${nodes[i]}" "$gpus"
        launch_bg "$logfile" "${SRUN_PREFIX[@]}" "$TORCHRUN" --nnodes="$nnodes" --nproc_per_node="$nproc" \
            --node_rank="$i" --rdzv_backend=static --rdzv_endpoint="$master:$port" -m megatron_opd.cli "$@"
        NODE_PIDS+=("$LAST_PID")
    done
}

# wait_training: return when every torchrun exited 0. A failure dies naming the node and its ranks, and the
# EXIT trap stops the other nodes' steps (a rank killed mid-step leaves the others in a collective), unless
# the trainer checkpointed on a preemption request: then wait (PREEMPT_GRACE) for every node and requeue.
# Also dies when a server dies while training still runs (the trainer would otherwise hang on it).
wait_training() {
    is_dry_run && return 0
    local -a pending=("${!TRAIN_PIDS[@]}")
    while ((${#pending[@]} > 0)); do
        local -a still=()
        local idx pid rc i
        for idx in "${pending[@]}"; do
            pid=${TRAIN_PIDS[idx]}
            if kill -0 "$pid" 2>/dev/null; then
                still+=("$idx")
            else
                rc=0
                wait_pid "$pid" || rc=$?
                ((rc == 0)) || training_failed "$idx" "$rc"
            fi
        done
        pending=(${still[@]+"${still[@]}"})
        ((${#pending[@]} > 0)) || break
        for ((i = 0; i < ${#SERVER_PIDS[@]}; i++)); do
            kill -0 "${SERVER_PIDS[i]}" 2>/dev/null ||
                die "${SERVER_NAMES[i]} server died during training; see ${SERVER_LOGS[i]}"
        done
        sleep "$POLL_INTERVAL"
    done
    requeue_if_preempted
    log "training finished"
}

# training_failed INDEX RC: a node's torchrun exited RC != 0. Waits a moment for the others (a rank that
# dies takes its peers' collectives down with it), then names every node that failed and the rank and exit
# code torchrun reports as the root cause, and dies (the EXIT trap stops what is left).
training_failed() {
    local idx=$1 rc=$2 nproc=${TRAIN_NPROC:-1}
    if ((PREEMPT_REQUESTED)) || [[ -n "$OUT_DIR" && ( -f "$OUT_DIR/preempt.request" || -f "$OUT_DIR/preempted.json" ) ]]; then
        local deadline=$((SECONDS + PREEMPT_GRACE)) pid
        for pid in "${TRAIN_PIDS[@]}"; do
            while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 1; done
        done
        requeue_if_preempted
    fi
    sleep 2
    local -a failed=("node ${TRAIN_NODE_NAMES[idx]} (node_rank $idx, ranks $((idx * nproc))-$((idx * nproc + nproc - 1))) exited with status $rc")
    local i code cause
    for ((i = 0; i < ${#TRAIN_PIDS[@]}; i++)); do
        ((i == idx)) && continue
        kill -0 "${TRAIN_PIDS[i]}" 2>/dev/null && continue
        code=0
        wait_pid "${TRAIN_PIDS[i]}" 2>/dev/null || code=$?
        ((code == 0)) || failed+=("node ${TRAIN_NODE_NAMES[i]} (node_rank $i) exited with status $code")
    done
    cause=""
    if [[ -n "$OUT_DIR" ]]; then   # torchrun's "Root Cause (first observed failure)" of the other nodes' logs
        cause=$(cat "$OUT_DIR"/logs/train.node*.log 2>/dev/null | grep -A6 'Root Cause' |
            sed -n 's/^ *\(rank\|exitcode\) *: /\1 /p' | paste -sd' ' -) || cause=""
    fi
    local IFS=';'
    die "training failed: ${failed[*]}${cause:+; torchrun root cause: $cause}; the remaining ranks are stopped. Logs: ${OUT_DIR:-.}/logs/train.node*.log (node 0: the job's output). Resubmit to resume from the last complete checkpoint."
}

# convert_check NODES_CSV GPUS OUT_DIR MODEL TP PP: the student through the converter at the training
# layout before any training: hf->mcore with one torchrun per node (so a PP/TP layout spans the nodes),
# then mcore->hf on the first node with --verify (megatron vs HF logits). Writes OUT_DIR/convert/.
convert_check() {
    local nodes_csv=$1 gpus=$2 out=$3 model=$4 tp=$5 pp=$6
    local -a nodes
    IFS=, read -r -a nodes <<<"$nodes_csv"
    local nnodes=${#nodes[@]} nproc i backend=nccl mp=$((tp * pp))
    nproc=$(ranks_per_node "$gpus")
    ((GPUS_PER_NODE > 0)) || backend=gloo
    # the converter runs exactly tp*pp ranks: spread over all the nodes when they divide it, else on the first
    if ((mp % nnodes == 0 && mp / nnodes <= nproc)); then
        nproc=$((mp / nnodes))
    elif ((mp <= nproc)); then
        nodes=("${nodes[0]}")
        nnodes=1
        nproc=$mp
    else
        die "CONVERT_CHECK: tp*pp=$mp ranks do not fit nodes $nodes_csv ($nnodes x $nproc ranks)"
    fi
    log "convert check: hf->mcore tp=$tp pp=$pp as $nnodes node(s) x $nproc rank(s), then mcore->hf --verify"
    local used
    used=$(IFS=,; echo "${nodes[*]}")
    torchrun_nodes convert $((MASTER_PORT + 1)) "$nproc" "$gpus" "$out" "$used" convert hf-to-mcore --hf "$model" \
        --out "$out/convert/mcore" --tp "$tp" --pp "$pp" --backend "$backend" --overwrite
    is_dry_run || for ((i = 0; i < nnodes; i++)); do
        wait_pid "${NODE_PIDS[i]}" || die "convert hf-to-mcore failed on node ${nodes[i]} (node_rank $i)"
    done
    srun_prefix "${nodes[0]}" "$gpus"
    run_step "${SRUN_PREFIX[@]}" "$PYTHON" -m megatron_opd.cli convert mcore-to-hf --ckpt "$out/convert/mcore" \
        --out "$out/convert/hf" --tp 1 --pp 1 --backend "$backend" --overwrite --verify ||
        die "convert mcore-to-hf --verify failed (see above)"
}

# eval_export NODE GPUS OUT_DIR: `megatron-opd eval` of the trained student (OUT_DIR/hf) with EVAL_ARGS.
eval_export() {
    [[ -n "$EVAL_ARGS" ]] || return 0
    local node=$1 gpus=$2 out=$3
    local -a args
    read -r -a args <<<"$EVAL_ARGS"
    srun_prefix "$node" "$gpus"
    run_step "${SRUN_PREFIX[@]}" "$PYTHON" -m megatron_opd.cli eval --model "$out/hf" --out "$out/eval" \
        --no-progress "${args[@]}" || die "eval of $out/hf failed (see above)"
    log "eval of the exported student: $out/eval/results.md"
}

# run_step CMD...: run CMD in the foreground (dry run: print it).
run_step() {
    if is_dry_run; then
        show_cmd "$@"
        return 0
    fi
    "$@"
}
