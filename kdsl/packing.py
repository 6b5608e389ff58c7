"""Facts of the prepared int4 weight layouts that both sides must agree on: the definitions
(kdsl.schema.layout validates tiles against them, templates bake them in) and the runtime
(kdsl.ops writes weights in them). Constants only; this module imports nothing from kdsl.
"""

# Tile of the "k_planes" weights: 128 columns by 8 planes of 16 rows.
PLANE_TILE_N = 128
PLANE_TILE_K = 128
PLANE_ROWS = PLANE_TILE_K // 8  # words per column of a tile; a word holds 8 of the column's rows
PAIR_SPAN = 2 * PLANE_ROWS  # rows the nibble pair (p, p + 4) covers over one column's words

# "biased" and "paired" zeros: the kernels build (bias + q) by OR-ing q's bits into the float whose value
# is this bias, so preparation stores zero + bias and one subtract dequantizes. Per activation dtype.
ZERO_BIAS = {"float16": 1024, "bfloat16": 128}
