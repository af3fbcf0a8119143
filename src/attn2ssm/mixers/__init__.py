"""Sequence mixers: drop-in replacements for a Hugging Face attention module."""
