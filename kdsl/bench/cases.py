"""Every op `kdsl bench` times: the dense ops' setups (kdsl.bench.timing) and the MoE ops' (kdsl.bench.moe)."""
from kdsl.bench import moe, timing

SETUPS = {**timing.SETUPS, **moe.SETUPS}
