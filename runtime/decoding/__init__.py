"""The decoding room: speculative decoding, methods, reuse-aware gating, cost model, sampling, generation, metrics."""
