"""Every op `kdsl bench` times: the dense ops' setups (kdsl.bench.timing), the block-FP8 MoE ops' (kdsl.bench.moe)
and the W4A16 MoE layer's (kdsl.bench.moe_w4a16)."""
from kdsl.bench import moe, moe_w4a16, timing

SETUPS = {**timing.SETUPS, **moe.SETUPS, **moe_w4a16.SETUPS}
