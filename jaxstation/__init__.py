"""jaxstation: a batched, batch-invariant LLM serving station in JAX."""
