"""Distillation: losses, recipes (stages as data) and the training loop."""
