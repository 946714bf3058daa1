"""megatron-opd: Stable-OPD on-policy distillation of LLMs on megatron-core."""

__version__ = "0.1.0"
