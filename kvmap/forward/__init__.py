"""Per-step inputs of a vLLM forward pass beyond the core mappings (issue 26): CUDA-graph padding,
attention metadata, backend metadata. Pure functions over numpy arrays."""
