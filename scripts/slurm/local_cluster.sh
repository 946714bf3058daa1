#!/usr/bin/env bash
# A real Slurm cluster on one machine, to try the sbatch scripts in this folder without a cluster (and
# for CI's `make test-slurm`): Debian's slurmctld + N slurmd daemons, every node on 127.0.0.1 with its
# own port and spool directory, authenticated by a munged of its own.
#
#   scripts/slurm/local_cluster.sh up [--nodes N]     # start (installs slurm-wlm + munge if missing)
#   eval "$(scripts/slurm/local_cluster.sh env)"     # SLURM_CONF for sbatch/squeue/scontrol in this shell
#   scripts/slurm/local_cluster.sh status
#   scripts/slurm/local_cluster.sh down               # stop exactly the daemons `up` started
#
# State lives in SLURM_LOCAL_DIR (default /tmp/megatron-opd-slurm): slurm.conf, logs, spools, pid files.
# Nodes are n1..nN (NodeHostname=localhost, NodeAddr=127.0.0.1); the names do not resolve, as on many
# real clusters, so the scripts take addresses from `scontrol show node` when `getent` fails.
# No systemd: the install blocks services from starting (policy-rc.d), and `down` stops only the pids in
# SLURM_LOCAL_DIR/pids. Needs root (slurmd runs jobs as their user; munged runs as the munge user).
# Ports: slurmctld SLURM_LOCAL_PORT (default 6917), slurmd nK on SLURM_LOCAL_PORT + K.
set -euo pipefail

DIR="${SLURM_LOCAL_DIR:-/tmp/megatron-opd-slurm}"
PORT="${SLURM_LOCAL_PORT:-6917}"
NODES=2
CPUS="${SLURM_LOCAL_CPUS:-$(nproc)}"
UP_TIMEOUT="${SLURM_LOCAL_TIMEOUT:-60}"
MARK=.megatron-opd-local-cluster   # `up` only ever deletes a folder that holds this file (or an empty one)

log() { printf '[local_cluster] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

usage() {
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

need_root() { [[ $(id -u) == 0 ]] || die "$1 needs root (run with sudo)"; }

install_packages() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurm-wlm)
    command -v sbatch >/dev/null || missing+=(slurm-client)
    command -v munged >/dev/null || missing+=(munge)
    ((${#missing[@]} == 0)) && return 0
    need_root "installing ${missing[*]}"
    log "installing ${missing[*]} (Debian packages; services blocked from starting)"
    local rc_d=/usr/sbin/policy-rc.d had_rc_d=0
    [[ -e $rc_d ]] && had_rc_d=1
    ((had_rc_d)) || { printf '#!/bin/sh\nexit 101\n' >"$rc_d"; chmod +x "$rc_d"; }
    local ok=0
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"; } >&2 || ok=$?
    ((had_rc_d)) || rm -f "$rc_d"
    ((ok == 0)) || die "apt-get install ${missing[*]} failed (exit $ok)"
}

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_conf() {
    local user=$1 k
    cat >"$DIR/slurm.conf" <<EOF
# written by scripts/slurm/local_cluster.sh: $NODES node(s) on 127.0.0.1
ClusterName=megatron-opd-local
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=$user
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/pids/slurmctld.pid
SlurmdPidFile=$DIR/pids/slurmd.%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobRequeue=1
ReturnToService=2
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait=10
MinJobAge=600
SlurmdTimeout=30
InactiveLimit=0
EOF
    for ((k = 1; k <= NODES; k++)); do
        echo "NodeName=n$k NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((PORT + k)) CPUs=$CPUS State=UNKNOWN" \
            >>"$DIR/slurm.conf"
    done
    local names
    names=$(seq -s, -f 'n%g' 1 "$NODES")
    echo "PartitionName=local Nodes=$names Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >>"$DIR/slurm.conf"
}

start_munge() {
    local m=$DIR/munge key=/etc/munge/munge.key
    mkdir -p "$m"
    chown munge:munge "$m"
    chmod 755 "$m"
    if [[ ! -s $key ]]; then
        mkdir -p /etc/munge
        dd if=/dev/urandom of="$key" bs=1 count=1024 status=none
        chown munge:munge "$key"
        chmod 400 "$key"
    fi
    runuser -u munge -- munged --socket="$m/munge.socket" --pid-file="$m/munged.pid" \
        --log-file="$m/munged.log" --seed-file="$m/munged.seed" --key-file="$key" ||
        die "munged did not start; see $m/munged.log"
    cp "$m/munged.pid" "$DIR/pids/munged.pid"
}

cmd_up() {
    while (($#)); do
        case $1 in
            --nodes) NODES=$2; shift 2 ;;
            --nodes=*) NODES=${1#*=}; shift ;;
            *) die "up: unknown option '$1'" ;;
        esac
    done
    [[ $NODES =~ ^[1-9][0-9]*$ ]] || die "--nodes must be a positive integer, got '$NODES'"
    install_packages
    need_root "starting slurmd and munged"
    local f
    for f in "$DIR"/pids/*.pid; do
        pid_alive "$f" && die "a local cluster is already up in $DIR ($(basename "$f" .pid) runs): scripts/slurm/local_cluster.sh down first"
    done
    if [[ -e $DIR && ! -f $DIR/$MARK ]] && [[ -n $(ls -A "$DIR" 2>/dev/null) ]]; then
        die "SLURM_LOCAL_DIR=$DIR exists, is not empty and was not made by this script: choose another folder"
    fi
    rm -rf "$DIR"
    mkdir -p "$DIR"/{state,spool,pids,log}
    : >"$DIR/$MARK"
    chmod 755 "$DIR"
    write_conf root
    start_munge
    export SLURM_CONF=$DIR/slurm.conf
    slurmctld -f "$SLURM_CONF" || die "slurmctld did not start; see $DIR/log/slurmctld.log"
    local k
    for ((k = 1; k <= NODES; k++)); do
        slurmd -f "$SLURM_CONF" -N "n$k" || die "slurmd n$k did not start; see $DIR/log/slurmd.n$k.log"
    done
    local deadline=$((SECONDS + UP_TIMEOUT)) idle=0
    while ((SECONDS < deadline)); do
        idle=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 == "idle"' | wc -l) || idle=0
        ((idle == NODES)) && break
        sleep 1
    done
    if ((idle != NODES)); then
        sinfo -N >&2 || true
        die "only $idle of $NODES node(s) idle after ${UP_TIMEOUT}s; see $DIR/log/"
    fi
    log "up: $NODES node(s) idle in $DIR (SLURM_CONF=$SLURM_CONF)"
}

cmd_down() {
    local f pid stopped=0
    [[ -d $DIR/pids ]] || { log "nothing to stop in $DIR"; return 0; }
    # slurmd first, then slurmctld, then munged (the others authenticate through it)
    for f in "$DIR"/pids/slurmd.*.pid "$DIR"/pids/slurmctld.pid "$DIR"/pids/munged.pid; do
        [[ -f $f ]] || continue
        pid=$(cat "$f")
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null || true
            local i
            for ((i = 0; i < 50; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
            kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
            stopped=$((stopped + 1))
        fi
        rm -f "$f"
    done
    log "down: stopped $stopped daemon(s) of $DIR"
}

cmd_status() {
    local f n=0
    for f in "$DIR"/pids/*.pid; do
        [[ -f $f ]] || continue
        if pid_alive "$f"; then
            echo "$(basename "$f" .pid): running (pid $(cat "$f"))"
            n=$((n + 1))
        else
            echo "$(basename "$f" .pid): not running"
        fi
    done
    ((n > 0)) || { echo "no local cluster in $DIR"; return 1; }
    SLURM_CONF=$DIR/slurm.conf sinfo -N
}

case ${1:-} in
    up) shift; cmd_up "$@" ;;
    down) cmd_down ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$(printf '%q' "$DIR/slurm.conf")" ;;
    *) usage ;;
esac
