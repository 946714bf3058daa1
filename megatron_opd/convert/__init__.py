"""HF safetensors <-> megatron-core torch_dist checkpoints: `megatron-opd convert` (convert/checkpoint.py);
tools/checkpoint_convert/convert.py is the same command as a script."""
