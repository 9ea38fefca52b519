"""The op catalog: one module per family, each registering its ops into `REGISTRY`."""
from . import conv, ctc, dropout, gather, matmul, moe, norm, pointwise, pooling, reduction, sdpa, shape, softmax  # noqa: F401
from . import lrn  # noqa: F401
from . import rnn  # noqa: F401
from . import block_scale  # noqa: F401
from . import sdpa_fp8  # noqa: F401
from .base import REGISTRY, OpDef, OutputSpec, lookup

__all__ = ["REGISTRY", "OpDef", "OutputSpec", "lookup"]
