"""Triton kernel source: one renderer per family over one emitter, name allocator and expression table."""
