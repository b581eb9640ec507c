"""jaxlearn.text: tokenizers, chat templates and incremental detokenization, shared by the
input pipeline, the inference engine and interop. Import submodules directly, e.g.
`from jaxlearn.text.tokenizers import ByteTokenizer`; see packages/text/README.md."""

# The public submodules (imported on use, so that importing the package stays cheap;
# `from jaxlearn.text import *` imports them all).
__all__ = [
    "chat",
    "chat_encoding",
    "detokenize",
    "errors",
    "gguf_file",
    "gguf_tokenizer",
    "gguf_vocab",
    "hf_files",
    "protocol",
    "tokenizer_export",
    "tokenizers",
]
