"""The forward pass's inputs beyond the core mappings (issue 26): settings (config.py), the parts
(inputs.py) and each part's rules (sampler.py, ...). Pure functions over host arrays and plain scalars: nothing
here imports a worker."""
