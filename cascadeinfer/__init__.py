"""cascadeinfer: Triton kernels for cascade attention."""

__version__ = "0.1.0"
