"""Runtime: the manifest of generated kernels and the registry that picks among them."""
