"""Tensor parallelism on torch.distributed: per-rank shards of quantized checkpoints in their packed
layouts (sharding), the column/row-parallel linears that run them (layers), the gated MLP as serving stacks
run it, one all-reduce per call (mlp), and the collectives underneath (comm)."""
from kdsl.parallel.comm import ALL_REDUCE, SYMM_MEM_MAX_BYTES, symm_mem_buffer
from kdsl.parallel.layers import ColumnParallelLinear, RowParallelLinear
from kdsl.parallel.mlp import ParallelMLP
from kdsl.parallel.sharding import (AWQShard, FP8Shard, GPTQShard, ShardError, shard_awq, shard_fp8,
                                    shard_gptq, gptq_row_index)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ShardError", "FP8Shard", "GPTQShard",
           "AWQShard", "shard_fp8", "shard_gptq", "shard_awq", "gptq_row_index", "ALL_REDUCE", "SYMM_MEM_MAX_BYTES",
           "symm_mem_buffer"]
