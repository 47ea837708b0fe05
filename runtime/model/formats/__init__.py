"""Checkpoint formats: safetensors (Hugging Face folders) and GGUF, behind one `TensorRef`."""
