#!/usr/bin/env bash
# GPU readiness check (benchmarks/gpu_check.py) on a machine whose python has a CUDA PyTorch but not
# megatron-core, and no network: the wheels it lacks travel with the working tree in .whl/.
#
#   bash benchmarks/gpu_check.sh --fetch-wheels     # here, with PyPI: download .whl/ (<= 64 MiB; PY_TAG=cp312)
#   bash benchmarks/gpu_check.sh [gpu_check.py args]
#       # on the device machine; the device tool's call is
#       #   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
#       # -> python benchmarks/gpu_check.py --size 0.5b --device cuda --out $OUT/gpu_check.json
#       #    --time-limit ${TIME_LIMIT:-460} (the limit counts from this script's start; log: $OUT/gpu_check.log)
#   bash benchmarks/gpu_check.sh --cpu-tiny [gpu_check.py args]   # the same path at --size tiny --device cpu (CI)
#   bash benchmarks/gpu_check.sh --dry-run      # the phases (model, packed, ckpt, rng, resume, dynbatch, presets,
#                                               # memplan, sglang), each with what it checks and its criterion
#
# Not carried: torch, Transformer Engine and sglang (the machine's own). Without sglang the sglang phase prints
# "sglang: not installed, not run" and is no failure; everything else that cannot build fails the check.
#
# Wheel install: only the carried distributions the machine's python lacks, or has older than the carried
# ones, go to a fresh --target directory ($GPU_CHECK_SITE, default /tmp/gpu_check_site) that is put on
# PYTHONPATH. PYTHONPATH comes before site-packages, so whatever is installed there shadows the machine's
# copy: torch, triton, nvidia-* are never carried nor installed, and numpy (which torch's extension
# binds to), like the rest of torch's pinned stack (sympy, networkx, jinja2, ...; not carried), is installed
# only where absent, so the machine's torch runs on what it was installed with. Wheels whose tags the python
# does not support (another python version) are skipped with a warning; the report then says which
# import failed and its environment block gives the python version to fetch for (PY_TAG=cpXYZ).
#
# Environment: PYTHON (default: the first of python, python3 that imports torch), OUT, TIME_LIMIT,
# PY_TAG and LOCK (--fetch-wheels), GPU_CHECK_WHEELS (default <repo>/.whl), GPU_CHECK_SITE.
# Exit status: gpu_check.py's (0: every phase run is ok; sglang absent is no failure), or 2 for a usage/setup
# error.

set -euo pipefail

T_START="$(date +%s.%N)"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="${GPU_CHECK_WHEELS:-$ROOT/.whl}"
SITE="${GPU_CHECK_SITE:-/tmp/gpu_check_site}"
MAX_MIB=64

# Distributions carried, beyond the device's torch: megatron-core and its requirements, and what
# gpu_check.py imports through megatron_opd (transformers for the HF configs/models and its import-time
# stack, safetensors, tokenizers for the byte tokenizer, pyyaml, numpy, einops, tqdm), plus nvidia-ml-py
# (the trainer's GPU stats). Versions come from the lock (see fetch_wheels).
DISTS=(
  megatron-core packaging numpy einops
  transformers huggingface_hub tokenizers safetensors hf-xet regex PyYAML tqdm
  filelock fsspec typing_extensions click httpx2 httpcore2 h11 anyio idna truststore
  nvidia-ml-py
)

die() { echo "gpu_check.sh: $*" >&2; exit 2; }
say() { echo "gpu_check.sh: $*"; }

# has_arg OPT ARGS...: whether ARGS hold OPT (as "OPT VALUE" or "OPT=VALUE")
has_arg() {
  local opt="$1" a
  shift
  for a in "$@"; do
    [[ "$a" == "$opt" || "$a" == "$opt="* ]] && return 0
  done
  return 1
}

usage() { sed -n '2,/^$/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

fetch_wheels() {
  local tag="${PY_TAG:-cp312}" lock pip_py pyver total
  [[ "$tag" =~ ^cp3([0-9]+)$ ]] || die "PY_TAG=$tag: expected cp3XY (e.g. cp312)"
  pyver="3.${BASH_REMATCH[1]}"
  if [[ -n "${LOCK:-}" ]]; then
    lock="$LOCK"
  elif [[ "$tag" == cp312 ]]; then
    lock="$ROOT/requirements/lock-py312.txt"  # the Python 3.12 + megatron-core 0.19 leg
  else
    lock="$ROOT/requirements/lock-main.txt"
  fi
  [[ -f "$lock" ]] || die "lock file $lock not found"
  pip_py="${PIP_PYTHON:-}"
  if [[ -z "$pip_py" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then pip_py="$ROOT/.venv/bin/python"; else pip_py=python3; fi
  fi
  local -a reqs
  mapfile -t reqs < <("$pip_py" - "$lock" "${DISTS[@]}" <<'PY'
import re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
pins = {}
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if "==" in line:
        name, ver = line.split("==", 1)
        pins[norm(name)] = ver.strip()
missing = [d for d in sys.argv[2:] if norm(d) not in pins]
if missing:
    sys.exit(f"not pinned in {sys.argv[1]}: {' '.join(missing)}")
print("\n".join(f"{d}=={pins[norm(d)]}" for d in sys.argv[2:]))
PY
  )
  ((${#reqs[@]} == ${#DISTS[@]})) || die "could not read the pins from $lock"
  say "downloading ${#reqs[@]} wheels for $tag (python $pyver, manylinux x86_64;" \
    "pins from ${lock#"$ROOT"/}) into $WHEELS"
  rm -rf "$WHEELS"
  mkdir -p "$WHEELS"
  "$pip_py" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: -d "$WHEELS" \
    --python-version "$pyver" --implementation cp --abi "$tag" --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 \
    --platform manylinux2010_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    --platform any "${reqs[@]}"
  echo "$tag" >"$WHEELS/PY_TAG"
  find "$WHEELS" -maxdepth 1 -type f -name '*.whl' -printf '%s %f\n' | sort -k2 |
    awk '{printf "  %9.2f MiB  %s\n", $1 / 1048576, $2}'
  total="$(du -cb "$WHEELS"/* | tail -n 1 | cut -f1)"
  awk -v t="$total" -v m="$MAX_MIB" 'BEGIN { printf "gpu_check.sh: total %.2f MiB of %d MiB\n", t / 1048576, m }'
  if ((total > MAX_MIB * 1024 * 1024)); then
    die "$WHEELS is over $MAX_MIB MiB: the device tool carries at most $MAX_MIB MiB"
  fi
}

find_python() {
  if [[ -n "${PYTHON:-}" ]]; then
    echo "$PYTHON"
    return
  fi
  local p
  for p in python python3; do
    if command -v "$p" >/dev/null 2>&1 && "$p" -c "import torch" >/dev/null 2>&1; then
      echo "$p"
      return
    fi
  done
  die "no python that imports torch (tried python, python3; set PYTHON=...)"
}

# Picks the wheels to install (see the header) and installs them into $SITE; prints what it did.
install_wheels() {
  local py="$1"
  shopt -s nullglob
  local -a all=("$WHEELS"/*.whl)
  shopt -u nullglob
  if ((${#all[@]} == 0)); then
    say "no wheels in $WHEELS: using $py as it is (fetch them with: bash benchmarks/gpu_check.sh --fetch-wheels)"
    return 0
  fi
  rm -rf "$SITE"
  mkdir -p "$SITE"
  if ! "$py" - "$SITE" "${all[@]}" <<'PY'
import importlib.metadata as md
import os
import re
import subprocess
import sys
import zipfile

try:
    from packaging.tags import sys_tags
    from packaging.version import Version
except ImportError:
    try:
        from pip._vendor.packaging.tags import sys_tags
        from pip._vendor.packaging.version import Version
    except ImportError:  # neither packaging nor pip: CPython on linux x86_64 is what the wheels are for
        import sysconfig

        def sys_tags():
            cp = f"cp{sys.version_info[0]}{sys.version_info[1]}"
            plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")  # linux_x86_64
            arch = plat.split("_", 1)[1]
            plats = [plat, "manylinux1_" + arch, "manylinux2010_" + arch, "manylinux2014_" + arch,
                     *(f"manylinux_2_{m}_{arch}" for m in range(5, 40))]
            abi3 = [f"cp3{m}-abi3-{p}" for m in range(2, sys.version_info[1] + 1) for p in plats]
            return [f"{cp}-{cp}-{p}" for p in plats] + abi3 + ["py3-none-any", f"{cp}-none-any"]

        def Version(v):
            return tuple(int(x) if x.isdigit() else -1 for x in re.split(r"[.+-]", v))

site, wheels = sys.argv[1], sys.argv[2:]
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
NEVER = re.compile(r"^(torch|torchvision|torchaudio|triton|pytorch-triton.*|(?!nvidia-ml-py$)nvidia-.*)$")
# torch's own binary-bound or pinned stack: never shadowed, installed only where absent (typing_extensions,
# filelock, fsspec stay upgradable: newer versions are backward compatible, and anyio needs a recent one)
TORCH_DEPS = {"numpy", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "setuptools"}
supported = {str(t) for t in sys_tags()}
pick, log = [], []
for w in wheels:
    name, ver, *_, py, abi, plat = os.path.basename(w)[:-4].split("-")
    dist = norm(name)
    if NEVER.match(dist):
        log.append(f"never  {dist} {ver} (the machine's own)")
        continue
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    tags = {f"{a}-{b}-{c}" for a in py.split(".") for b in abi.split(".") for c in plat.split(".")}
    if not tags & supported:
        here = f"{sys.version_info[0]}{sys.version_info[1]}"
        if have is not None:
            log.append(f"keep   {dist} {have} (the carried {ver} is {py}-{abi}, not for python {here[0]}.{here[1:]})")
        else:
            log.append(f"WARN   {dist} {ver}: {py}-{abi}-{plat} does not fit python {here[0]}.{here[1:]} here "
                       f"(fetch with PY_TAG=cp{here}); not installed")
        continue
    if have is None:
        why = "absent"
    elif dist in TORCH_DEPS:
        log.append(f"keep   {dist} {have} (torch's stack; carried {ver})")
        continue
    else:
        try:
            older = Version(have) < Version(ver)
        except Exception:  # an unparsable local version: keep it
            older = False
        if not older:
            log.append(f"keep   {dist} {have} (carried {ver})")
            continue
        why = f"{have} here is older"
    pick.append(w)
    log.append(f"install {dist} {ver} ({why})")
print("\n".join("gpu_check.sh:   " + line for line in log), flush=True)
if pick:
    pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0
    if pip:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index",
                        "--no-deps", "--no-compile", "--target", site, *pick], check=True)
    else:  # no pip: a wheel is a zip laid out for site-packages (.data/{purelib,platlib} aside)
        for w in pick:
            with zipfile.ZipFile(w) as z:
                for m in z.namelist():
                    parts = m.split("/")
                    if len(parts) > 2 and parts[0].endswith(".data") and parts[1] in ("purelib", "platlib"):
                        parts = parts[2:]
                    elif parts[0].endswith(".data"):
                        continue
                    dest = os.path.join(site, *parts)
                    if m.endswith("/"):
                        continue
                    os.makedirs(os.path.dirname(dest), exist_ok=True)
                    with z.open(m) as src, open(dest, "wb") as dst:
                        dst.write(src.read())
    print(f"gpu_check.sh: installed {len(pick)} wheels into {site} ({'pip' if pip else 'unzipped'})", flush=True)
PY
  then
    die "installing the wheels from $WHEELS failed"
  fi
  [[ -z "$(ls -A "$SITE")" ]] || export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
}

main() {
  local mode=cuda
  case "${1:-}" in
    -h | --help) usage; exit 0 ;;
    --fetch-wheels) shift; (($# == 0)) || die "--fetch-wheels takes no arguments"; fetch_wheels; exit 0 ;;
    --cpu-tiny) shift; mode=cpu ;;
  esac
  cd "$ROOT"
  local py
  py="$(find_python)"
  say "python: $(command -v "$py")" \
    "($("$py" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'))"
  if [[ "$mode" == cuda ]] && command -v nvidia-smi >/dev/null 2>&1; then
    timeout 30 nvidia-smi || true
  fi
  if [[ -f "$WHEELS/PY_TAG" ]]; then
    say "wheels in $WHEELS were fetched for $(cat "$WHEELS/PY_TAG")"
  fi
  install_wheels "$py"
  export GPU_CHECK_T0="$T_START" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  local -a args
  if [[ "$mode" == cuda ]]; then
    args=(--size 0.5b --device cuda)
  else
    args=(--size tiny --device cpu)
  fi
  has_arg --out "$@" || args+=(--out "${OUT:-.}/gpu_check.json")
  has_arg --time-limit "$@" || args+=(--time-limit "${TIME_LIMIT:-460}")
  args+=("$@")
  say "$py benchmarks/gpu_check.py ${args[*]}"
  local rc=0
  if [[ -n "${OUT:-}" ]]; then
    mkdir -p "$OUT"
    set +e
    "$py" benchmarks/gpu_check.py "${args[@]}" 2>&1 | tee "$OUT/gpu_check.log"
    rc="${PIPESTATUS[0]}"
    set -e
  else
    "$py" benchmarks/gpu_check.py "${args[@]}" || rc=$?
  fi
  say "exit $rc"
  exit "$rc"
}

main "$@"
