"""Cut quantized checkpoint tensors for one tensor-parallel rank, in their packed layouts (no dequantization).

"column" splits the output features N (each rank computes N / world outputs from the whole input);
"row" splits the input features K (each rank computes a partial x[..., K_r] @ W[:, K_r]^T; the partials
are summed across ranks). Shards are even: N (or K) must divide by the world size. A shard that cannot be
cut raises ShardError naming the tensor, the rank and the shape.

Each format's rules are its scheme unit's (kdsl.nn.schemes.block_fp8, .gptq, .awq: their docstrings say them);
this module names them where kdsl.parallel's users find them.
"""
from kdsl.nn.schemes.awq import AWQShard, shard_awq
from kdsl.nn.schemes.base import DIMS, PACK, ShardError
from kdsl.nn.schemes.block_fp8 import FP8Shard, shard_fp8
from kdsl.nn.schemes.gptq import GPTQShard, gptq_row_index, shard_gptq

__all__ = ["ShardError", "FP8Shard", "GPTQShard", "AWQShard", "shard_fp8", "shard_gptq", "shard_awq", "gptq_row_index",
           "DIMS", "PACK"]
