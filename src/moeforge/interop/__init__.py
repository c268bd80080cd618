"""Interoperability: Hugging Face transformers checkpoints and consolidated safetensors files."""

from moeforge.interop.hf import from_hf, read_hf_checkpoint, to_hf
from moeforge.interop.hf_config import config_from_hf, config_to_hf
from moeforge.interop.safetensors_io import load_safetensors, read_safetensors_config, to_safetensors

__all__ = [
    "config_from_hf",
    "config_to_hf",
    "from_hf",
    "load_safetensors",
    "read_hf_checkpoint",
    "read_safetensors_config",
    "to_hf",
    "to_safetensors",
]
