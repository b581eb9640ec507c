"""jaxlearn.interop: HF safetensors / GGUF import and export for jaxlearn causal LMs.

    from jaxlearn.interop import load_pretrained, export_hf, open_model
    source = open_model("model_dir_or_file.gguf_or_run")  # ModelSource: what is at a path
    loaded = load_pretrained("model_dir_or_file.gguf")   # LoadedModel
    model = loaded.model()                               # CausalLM
    ids = loaded.encode_chat([{"role": "user", "content": "Hi"}])
    export_hf("out_dir", loaded.config, loaded.params, tokenizer=loaded.tokenizer)
    export_gguf("out.gguf", loaded.config, loaded.params, tokenizer=loaded.tokenizer,
                chat_template=loaded.chat_template, dtype="q8_0")
    export_peft("adapter/", lora_config, params)          # LoRA adapters alone, PEFT layout
    adapter = read_peft("adapter/", base_config)          # PeftAdapter (config made LoRA)
    rank, alpha, adapter_params, paths = load_lora_adapter("adapter_or_run/", base_config)

See packages/interop/README.md. The families themselves (`Architecture`, config building, HF
config.json fields, name tables) are `jaxlearn.families`; chat templates are
`jaxlearn.text.chat`.
"""

from typing import Any

from jaxlearn.interop.errors import (
    ChatTemplateError,
    InteropError,
    MalformedFileError,
    ParameterMismatchError,
    TokenizerError,
    UnsupportedModelError,
)
from jaxlearn.interop.generate import greedy_generate
from jaxlearn.interop.hf import export_hf, export_pretrained, load_hf, load_hf_tokenizer
from jaxlearn.interop.lora_source import LoraAdapterWeights, load_lora_adapter
from jaxlearn.interop.model import LoadedModel
from jaxlearn.interop.model_source import ModelSource, open_model
from jaxlearn.interop.peft import PeftAdapter, export_peft, read_peft
from jaxlearn.interop.pretrained import JaxlearnCheckpointError, load_pretrained

__all__ = [
    "ChatTemplateError",
    "InteropError",
    "JaxlearnCheckpointError",
    "LoadedModel",
    "LoraAdapterWeights",
    "MalformedFileError",
    "ModelSource",
    "ParameterMismatchError",
    "PeftAdapter",
    "TokenizerError",
    "UnsupportedModelError",
    "export_gguf",
    "export_hf",
    "export_peft",
    "export_pretrained",
    "greedy_generate",
    "load_gguf",
    "load_hf",
    "load_hf_tokenizer",
    "load_lora_adapter",
    "load_pretrained",
    "open_model",
    "read_peft",
]


def __getattr__(name: str) -> Any:
    # gguf is imported lazily: the `gguf` package is only needed for GGUF files.
    if name == "load_gguf":
        from jaxlearn.interop.gguf import load_gguf

        return load_gguf
    if name == "export_gguf":
        from jaxlearn.interop.gguf_export import export_gguf

        return export_gguf
    raise AttributeError(f"module 'jaxlearn.interop' has no attribute {name!r}")
