"""A student in other formats: native transformers classes, GGUF for llama.cpp, refreshed remote code."""
