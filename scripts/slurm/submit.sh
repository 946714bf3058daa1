#!/usr/bin/env bash
# Submit one of this folder's sbatch scripts after checking that the cluster can ever run it: a request
# no node can meet (GPUs, CPUs, nodes) is refused here with Slurm's reason, instead of PENDING forever.
#
#   scripts/slurm/submit.sh [SBATCH_OPTION...] SCRIPT [key=value overrides...]
#   GPUS_PER_NODE=0 scripts/slurm/submit.sh --nodes=2 scripts/slurm/opd_7b.sbatch train.steps=4   # CPU nodes
#
# GPUS_PER_NODE (default: the script's own #SBATCH value, 8) becomes --gpus-per-node; 0 submits for CPU nodes
# (no GPU gres asked, gloo). CPUS_PER_TASK (default: the script's #SBATCH value, 64; with GPUS_PER_NODE=0,
# 1) becomes --cpus-per-task. Other sbatch options pass through (before SCRIPT, the first argument ending in .sbatch). The job's
# environment is this shell's (--export=ALL), so set CONFIG, STUDENT, ... here; no comma-separated
# --export lists (Slurm splits them at every comma). Prints the job id on stdout.
set -euo pipefail

die() { printf '[submit] ERROR: %s\n' "$*" >&2; exit 1; }

opts=()   # everything before the first *.sbatch argument
while (($#)) && [[ $1 != *.sbatch ]]; do
    opts+=("$1")
    shift
done
(($#)) || die "no *.sbatch script given (usage: scripts/slurm/submit.sh [SBATCH_OPTION...] SCRIPT [overrides...])"
script=$1
shift
[[ -f $script ]] || die "sbatch script '$script' not found (relative paths are from $(pwd))"
command -v sbatch >/dev/null || die "sbatch not found: run on a Slurm login node (or scripts/slurm/local_cluster.sh up)"

if [[ -n ${GPUS_PER_NODE:-} ]]; then
    [[ $GPUS_PER_NODE =~ ^[0-9]+$ ]] || die "GPUS_PER_NODE='$GPUS_PER_NODE': expected a number (0 = CPU nodes)"
    opts=(--gpus-per-node="$GPUS_PER_NODE" ${opts[@]+"${opts[@]}"})
    [[ $GPUS_PER_NODE == 0 && -z ${CPUS_PER_TASK:-} ]] && CPUS_PER_TASK=1
fi
if [[ -n ${CPUS_PER_TASK:-} ]]; then
    [[ $CPUS_PER_TASK =~ ^[1-9][0-9]*$ ]] || die "CPUS_PER_TASK='$CPUS_PER_TASK': expected a positive number"
    opts=(--cpus-per-task="$CPUS_PER_TASK" ${opts[@]+"${opts[@]}"})
fi

# --test-only asks the controller whether (and when) the job could start; it fails for a request that no
# partition or node can ever satisfy, which a plain sbatch would leave PENDING for good.
if ! out=$(sbatch --test-only ${opts[@]+"${opts[@]}"} "$script" "$@" 2>&1); then
    die "the cluster cannot run this request ($(basename "$script") ${opts[*]}): ${out//$'\n'/ }"
fi
sbatch --parsable --export=ALL ${opts[@]+"${opts[@]}"} "$script" "$@"
