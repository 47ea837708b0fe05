"""s2moe: self-speculative Mixture-of-Experts decoding for memory-bound devices.

The runtime lives in ``s2moe.runtime`` (folder ``runtime/``), the calibration toolkit in
``s2moe.calib`` (folder ``calib/``).
"""

__version__ = "0.1.0"
