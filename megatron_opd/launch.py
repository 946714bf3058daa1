"""Helpers the SLURM launch scripts (scripts/slurm/) call before they spend GPU time.

`python -m megatron_opd.launch check-config --config X key=value...` loads the config exactly as
`megatron-opd train` will (same YAML, same overrides, same validation), checks that its model directories,
data files and evaluation sets exist (megatron_opd.inputs; `--skip-paths` for a dry run off-cluster) and
prints a one-line summary, so a typo fails the job in seconds instead of after the SGLang servers have
loaded their weights.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any, Optional

from megatron_opd.config import Config, ConfigError, load_config
from megatron_opd.inputs import check_inputs
from megatron_opd.plan import Cluster, arch_from, gpu_from_name, plan_run


def summarize(cfg: Config) -> str:
    """One line with the settings that decide the job's shape and the ablation row."""
    a, r, p, t = cfg.algo, cfg.rollout, cfg.parallel, cfg.teacher
    return (f"preset={a.preset} beta_kl={a.beta_kl:g} lambda_gold={a.lambda_gold:g} "
            f"mixture_ratio={a.mixture_ratio:g} | student={cfg.model.hf_path} "
            f"tp={p.tensor_model_parallel_size} pp={p.pipeline_model_parallel_size} | "
            f"rollout={r.backend}/{r.sglang_mode} url={r.server_url} n={r.n_samples_per_prompt} "
            f"max_new_tokens={r.max_new_tokens} | teacher={t.backend} {t.hf_path} url={t.server_url} | "
            f"out={cfg.logging.out_dir}")


def expand_hostlist(spec: str) -> list[str]:
    """Slurm's compressed host list (`node[01-03,07],gpu-a17`) as host names, as `scontrol show hostnames`
    prints them (zero padding kept). The dry run uses it where there is no scontrol (off-cluster)."""
    hosts: list[str] = []
    for part in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", spec):
        m = re.match(r"([^\[]*)\[([^\]]*)\](.*)$", part)
        if m is None:
            hosts.append(part)
            continue
        prefix, ranges, rest = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
                raise ValueError(f"host list {spec!r}: bad range {r!r}")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.extend(f"{prefix}{i:0{len(lo)}d}{tail}" for tail in (expand_hostlist(rest) if rest else [""]))
    return hosts


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_opd.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check-config", help="load + validate a config with overrides; print a summary")
    check.add_argument("--config", required=True, help="YAML file")
    check.add_argument("--skip-paths", action="store_true",
                       help="do not check that the model directories and data files exist (a dry run off-cluster)")
    check.add_argument("--plan-gpu", default=None,
                       help="also plan the trainer ranks' memory on this GPU (megatron-opd plan --gpu): a warning "
                            "when a rank does not fit")
    check.add_argument("--plan-strict", action="store_true", help="with --plan-gpu: a rank that does not fit fails")
    check.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    layout = sub.add_parser("layout", help="print the student's 'TP PP' (the sbatch scripts' convert check)")
    layout.add_argument("--config", required=True, help="YAML file")
    layout.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    hosts = sub.add_parser("hostnames", help="expand a Slurm host list like `scontrol show hostnames`")
    hosts.add_argument("nodelist")
    args = parser.parse_args(argv)
    if args.command == "hostnames":
        try:
            print("\n".join(expand_hostlist(args.nodelist)))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "layout":
        try:
            p = load_config(args.config, args.overrides).parallel
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
        print(p.tensor_model_parallel_size, p.pipeline_model_parallel_size)
        return 0
    try:
        cfg = load_config(args.config, args.overrides)
        if not args.skip_paths:
            check_inputs(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(f"config ok{' (paths not checked)' if args.skip_paths else ''}: {summarize(cfg)}")
    if args.plan_gpu:
        return check_plan(cfg, args.plan_gpu, args.plan_strict)
    return 0


def check_plan(cfg: Any, gpu_name: str, strict: bool) -> int:
    """The trainer ranks' planned memory on `gpu_name` (WORLD_SIZE ranks, else TP x PP): a warning, or with
    `strict` an error (exit 2), when one does not fit; a plan that cannot be made is said, not fatal."""
    p = cfg.parallel
    world = int(os.environ.get("WORLD_SIZE") or p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
    try:
        gpu = gpu_from_name(gpu_name)
        student = arch_from(cfg.model.hf_path, "model.hf_path")
        teacher = arch_from(cfg.teacher.hf_path, "teacher.hf_path") if cfg.teacher.hf_path else None
        plan = plan_run(cfg, Cluster(gpu, trainer=world), student, teacher)
    except ValueError as e:
        print(f"plan: not made ({e})", file=sys.stderr)
        return 2 if strict else 0
    bad = [v for v in plan["verdicts"] if v["role"].startswith("trainer") and not v["fits"]]
    for v in plan["verdicts"]:
        if v["role"].startswith("trainer"):
            print(f"plan ({gpu.name}, {world} trainer ranks): {v['role']}: {v['text']}",
                  file=sys.stderr if not v["fits"] else sys.stdout)
    if bad:
        print("plan: " + ("ERROR" if strict else "WARNING") + ": the layout does not fit; run `megatron-opd plan` "
              "for the table and layouts that fit", file=sys.stderr)
        return 2 if strict else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
