"""jaxlearn.layers: embeddings, norms, linear (+int8/fp8 dots), attention (MHA/GQA/MQA,
RoPE, masks, KV cache), FFN, MoE, LoRA adapters, transformer stacks, decoder, causal LM.

See packages/layers/README.md for the public API, the HF Llama mapping and the contract
between files.
"""

from jaxlearn.layers.attention import Attention, make_mask
from jaxlearn.layers.causal_lm import CausalLM, cross_entropy
from jaxlearn.layers.composition import (
    first_layers,
    fuse_projection_params,
    fuse_projections,
    merge_lora,
    set_norm,
    set_rope,
    set_unroll,
    use_dot,
    use_gqa,
    use_lora,
    use_moe,
)
from jaxlearn.layers.decoder import Decoder
from jaxlearn.layers.dense import DotGeneral, Linear, SgemmDot, dense, einsum, matmul
from jaxlearn.layers.embedding import Embedding
from jaxlearn.layers.ffn import ACTIVATIONS, FeedForward, get_activation
from jaxlearn.layers.gemma import gemma2_config, gemma3_config, gemma_config
from jaxlearn.layers.legacy import older_param_path
from jaxlearn.layers.lora import ADAPTERS, LoraAdapter, LoraLinear, with_base_params
from jaxlearn.layers.multi_lora import MultiLoraLinear, use_multi_lora
from jaxlearn.layers.norm import LayerNorm, RMSNorm
from jaxlearn.layers.pipeline import PipelineStack, pipeline_config, use_pipeline
from jaxlearn.layers.recipes import (
    llama_config,
    mixtral_config,
    phi3_config,
    qwen3_config,
    qwen3_moe_config,
)
from jaxlearn.layers.rope import (
    SCALINGS,
    DynamicNTKFrequencyScaling,
    FrequencyScaling,
    LinearFrequencyScaling,
    Llama3FrequencyScaling,
    LongRopeFrequencyScaling,
    RotaryEmbedding,
    YarnFrequencyScaling,
    scaling_config,
    scaling_dict,
)
from jaxlearn.layers.transformer import (
    ACTIVATION_NAMES,
    BaseStack,
    LoopStack,
    ScanStack,
    TransformerLayer,
    stack_config,
    swapped_stack,
)

__all__ = [
    "ACTIVATION_NAMES", "gemma_config", "gemma2_config", "gemma3_config", "stack_config",
    "swapped_stack", "fuse_projection_params", "first_layers", "fuse_projections", "merge_lora",
    "older_param_path", "set_norm", "set_unroll", "set_rope", "use_dot", "use_gqa",
    "use_lora", "use_moe", "ADAPTERS", "LoraAdapter", "LoraLinear", "with_base_params",
    "MultiLoraLinear", "use_multi_lora", "use_pipeline", "pipeline_config",
    "PipelineStack", "ACTIVATIONS", "Attention", "BaseStack", "CausalLM", "Decoder",
    "DotGeneral", "Embedding", "FeedForward", "FrequencyScaling",
    "DynamicNTKFrequencyScaling", "LongRopeFrequencyScaling", "YarnFrequencyScaling",
    "SCALINGS", "scaling_config", "scaling_dict", "phi3_config", "LayerNorm", "Linear",
    "SgemmDot", "LinearFrequencyScaling", "Llama3FrequencyScaling", "LoopStack", "RMSNorm",
    "RotaryEmbedding", "ScanStack", "TransformerLayer", "cross_entropy", "dense", "einsum",
    "get_activation", "llama_config", "make_mask", "matmul", "mixtral_config",
    "qwen3_config", "qwen3_moe_config",
]
