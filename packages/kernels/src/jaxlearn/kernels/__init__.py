"""jaxlearn.kernels: pure JAX array functions below the layers (no Module, no config)."""

from jaxlearn.kernels.blockwise_attention import blockwise_attention
from jaxlearn.kernels.chunked_loss import head_cross_entropy
from jaxlearn.kernels.native import pool_spin_us, set_pool_spin_us
from jaxlearn.kernels.packed_gemm import PackedTable, PackedWeights, packed_matmul
from jaxlearn.kernels.ring_attention import ring_attention
from jaxlearn.kernels.segments import segments_visible, shared_segment
from jaxlearn.kernels.table_rows import table_rows
from jaxlearn.kernels.weight_layout import TransposedWeight, transpose_weight
from jaxlearn.kernels.weight_quant import Int8Weight, int8_matmul, quantize_int8, take_rows

__all__ = [
    "Int8Weight",
    "PackedTable",
    "PackedWeights",
    "TransposedWeight",
    "blockwise_attention",
    "head_cross_entropy",
    "int8_matmul",
    "packed_matmul",
    "pool_spin_us",
    "quantize_int8",
    "ring_attention",
    "segments_visible",
    "set_pool_spin_us",
    "shared_segment",
    "table_rows",
    "take_rows",
    "transpose_weight",
]
