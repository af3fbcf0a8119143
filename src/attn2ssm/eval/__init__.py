"""Evaluation: perplexity, reports (lm-eval bridge, recall and fidelity metrics grow here)."""
