"""The router: sticky A/B split, per-version endpoint pools, forwarding without decoding tensors."""
