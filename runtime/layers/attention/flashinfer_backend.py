"""attention_backend="flashinfer": FlashInfer's paged prefill/decode kernels (not yet implemented in braid).

Importing this module raises ImportError with the reason, which the registry turns into a clear ValueError
at startup; the Triton backend ("triton", the GPU default) needs no extra package.
"""

try:
    import flashinfer  # noqa: F401
except ImportError as e:
    raise ImportError("attention_backend='flashinfer' needs the flashinfer package (pip install flashinfer-python); "
                      "the default 'triton' backend needs nothing extra") from e

raise ImportError("flashinfer is installed, but braid's FlashInfer attention backend is not implemented yet; "
                  "use attention_backend='triton' (the GPU default) or 'torch'")
