"""Code every splitstream service shares: stubs, tensors, errors, experiments, registry, logging."""
