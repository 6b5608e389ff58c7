"""GPTQ implementations that read checkpoint tensors as they ship."""
