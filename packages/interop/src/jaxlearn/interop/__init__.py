"""jaxlearn.interop: Leaf: HF safetensors / GGUF import and export."""
