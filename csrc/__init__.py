"""CUDA sources (installed as package data so `cupy.RawModule` can compile them at run time)."""

from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
