"""The benchmarks users run: ``attn2ssm bench generate | quality | train``."""
