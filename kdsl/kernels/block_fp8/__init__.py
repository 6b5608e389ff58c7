"""Block-FP8 (DeepSeek-V3) implementations."""
