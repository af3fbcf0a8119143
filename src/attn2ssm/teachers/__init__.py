"""Loading teachers: text (``text.py``: a local HF directory, a hub id, a GGUF file, a built-in
name) and vision (``vision.py``: a ViT/DeiT image classifier, or the built-in MNIST one; imported
from there, it pulls in torch)."""

from attn2ssm.teachers.text import (
    BUILTIN_TEACHERS,
    TeacherSource,
    check_weight_files,
    first_line,
    load_teacher,
    load_teacher_tokenizer,
    quiet_loading,
    read_teacher_config,
    resolve_teacher,
)

__all__ = [
    "BUILTIN_TEACHERS",
    "TeacherSource",
    "check_weight_files",
    "first_line",
    "load_teacher",
    "load_teacher_tokenizer",
    "quiet_loading",
    "read_teacher_config",
    "resolve_teacher",
]
