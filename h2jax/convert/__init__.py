"""Hugging Face interop: LLaMA-family checkpoints in and out of h2jax's checkpoint layout.

`import_hf(hf_dir, out_dir)` reads a local Hugging Face model directory (``config.json`` and
``*.safetensors``; ``LlamaForCausalLM``, or ``MistralForCausalLM`` without a short sliding
window) and writes step 0 of an h2jax checkpoint directory
(:class:`h2jax.checkpoint.CheckpointStore`, keys by model path such as
``params/blocks/3/attn/wq``) that ``h2jax train --init-from`` reads under any plan, plus
``model.yaml`` (the model section of an experiment), the directory's tokenizer and generation
files and its ``config.json`` (as ``hf_config.json``). `export_hf(ckpt_dir, out_dir)` writes
a committed step back as a Hugging Face directory (``config.json`` + ``model.safetensors``,
with the source's context length, special token ids and tokenizer files when they are found
beside the checkpoint or its run's tokenizer). Neither needs torch. A checkpoint that cannot be
converted raises :class:`ConvertError` naming the tensor or key and the shapes (exit 2 in
the CLI).
"""

from h2jax.convert._hf import (
    ConvertError,
    config_from_hf,
    config_to_hf,
    export_hf,
    hf_tensor_names,
    import_hf,
    load_model,
    read_hf_params,
)

__all__ = [
    "ConvertError",
    "config_from_hf",
    "config_to_hf",
    "export_hf",
    "hf_tensor_names",
    "import_hf",
    "load_model",
    "read_hf_params",
]
