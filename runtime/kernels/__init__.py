"""The kernel room: array backends and the linear/expert seam (NumPy reference, compiled CPU kernels, CUDA)."""
