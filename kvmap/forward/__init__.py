"""The forward pass's inputs beyond the core mappings (issue 26): settings (config.py), the parts
(inputs.py) and each part's rules: sampler.py, cudagraph.py (CUDA-graph dispatch), padded_tails.py (the
padded step's inputs), dp_padding.py, attention.py (CommonAttentionMetadata, the decode/prefill split),
flashinfer.py, flash_attn.py, local_attention.py. Pure functions over host arrays and plain scalars: nothing
here imports a worker."""
