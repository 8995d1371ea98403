"""The tiny Llama target model that tests and the demo serve.

`TINY_MODEL_DIR` is a committed Hugging Face checkpoint (bf16 safetensors, byte-level BPE
tokenizer, chat template) written by `python -m eagle_tap.testbed.tiny_model.build --out DIR`.
Importing this package must stay cheap: no torch, no transformers.
"""

from pathlib import Path

TINY_MODEL_DIR: Path = Path(__file__).resolve().parent / "tiny-llama"
"""Folder that `AutoTokenizer` / `AutoModelForCausalLM.from_pretrained` and SGLang load."""

__all__ = ["TINY_MODEL_DIR"]
