"""W4A16 implementations on prepared int4 weights (GPTQ v1/v2 and AWQ prepare into the same layouts)."""
