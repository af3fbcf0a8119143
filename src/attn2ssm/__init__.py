"""attn2ssm: distil a pretrained Hugging Face Transformer into a linear-attention, Mamba or hybrid student."""

__version__ = "0.1.0"
