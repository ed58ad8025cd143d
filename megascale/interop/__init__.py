"""Interoperability with Hugging Face transformers: the class and weight mapping (hf.py), checkpoints
out as model directories (export.py), pretrained weights in at any layout (load.py)."""
from megascale.interop.load import checked_init_from, hf_dir_of, load_hf_weights

__all__ = ["checked_init_from", "hf_dir_of", "load_hf_weights"]
