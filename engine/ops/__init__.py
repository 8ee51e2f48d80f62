"""Attention ops: Triton kernels (GPU, or CPU under TRITON_INTERPRET=1) and their
plain-torch references. Triton is imported lazily so that a CPU install without
it still works."""

from .attention_ref import gather_kv, paged_attention_ref, store_kv_ref

__all__ = ["gather_kv", "paged_attention_ref", "store_kv_ref", "triton_available"]


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
