"""The model: its configuration, its weights loaded from a file, and its forward pass in JAX."""
