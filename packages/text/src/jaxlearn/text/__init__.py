"""jaxlearn.text: tokenizers, chat templates and incremental detokenization, shared by the
input pipeline, the inference engine and interop. Import submodules directly, e.g.
`from jaxlearn.text.tokenizers import ByteTokenizer`; see packages/text/README.md."""
