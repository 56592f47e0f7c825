"""The worker: serves one model version over the Open Inference Protocol with dynamic batching."""
