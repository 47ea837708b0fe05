"""s2moe runtime: model loading, NumPy forward pass, KV cache, decoding and the `s2moe` CLI."""

from s2moe import __version__

__all__ = ["__version__"]
