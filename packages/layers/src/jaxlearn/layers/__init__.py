"""jaxlearn.layers: Layer library: embeddings, norms, linear (+int8/fp8 dots), attention (MHA/GQA/MQA, RoPE, masks, KV cache), FFN, MoE, transformer stacks, decoder, causal LM."""
