"""Prompt sets with golden solutions (prompts.py), the resumable sampler (sampler.py), built-in problems."""
