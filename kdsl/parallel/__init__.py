"""Tensor parallelism on torch.distributed: per-rank shards of quantized checkpoints in their packed
layouts (sharding) and the column/row-parallel linears that run them (layers)."""
from kdsl.parallel.layers import ColumnParallelLinear, RowParallelLinear
from kdsl.parallel.sharding import (AWQShard, FP8Shard, GPTQShard, ShardError, shard_awq, shard_fp8,
                                    shard_gptq, gptq_row_index)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ShardError", "FP8Shard", "GPTQShard", "AWQShard",
           "shard_fp8", "shard_gptq", "shard_awq", "gptq_row_index"]
