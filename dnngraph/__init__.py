"""dnngraph: deep-learning operation graphs compiled into fused Triton kernels."""
from .versions import __version__
from .versions import check_installed_triton as _check_installed_triton

_check_installed_triton()  # before anything imports Triton or reads its internals

from .runtime import interpreter as _interpreter  # noqa: F401  (chooses CUDA or the interpreter before kernels exist)
from .dtypes import (DataType, bfloat16, float8_e4m3, float8_e5m2, float16, float32, int32, int64)
from .dtypes import float4_e2m1, float8_e8m0
from .dtypes import int8
from .dtypes import bool_ as bool  # noqa: A001  (the public name is dg.bool)
from .errors import (ExecutionError, GraphError, SerializationError, UnsupportedError,
                     ValidationError)
from .graph import Graph, Node
from .options import BuildOptions
from .target import Target
from .tensor import Tensor
from .graph_cache import jit
from .symbolic import Dynamic, Multiple, dynamic
from .dtypes import bool_bit_packed
from .bitpack import pack_bits, unpack_bits
from .tensor import bit_packed_strides

__all__ = [
    "Graph", "Node", "Tensor", "DataType", "float32", "float16", "bfloat16", "float8_e4m3",
    "float8_e5m2", "int32", "int64", "bool", "float4_e2m1", "float8_e8m0", "GraphError", "ValidationError", "UnsupportedError",
    "ExecutionError", "SerializationError", "BuildOptions", "Target", "jit",
    "Dynamic", "Multiple", "dynamic",
]
__all__ += ["int8"]
__all__ += ["bool_bit_packed", "pack_bits", "unpack_bits", "bit_packed_strides"]
from .dtypes import uint8
__all__ += ["uint8"]
# the cuDNN frontend's names (frontend.py): `import dnngraph as cudnn` ports frontend code
from .frontend import (build_plan_policy, convolution_mode, data_type, diagonal_alignment, heur_mode,
                       norm_forward_phase, reduction_mode)
pygraph = Graph  # the frontend's graph class name
__all__ += ["data_type", "norm_forward_phase", "reduction_mode", "convolution_mode", "diagonal_alignment",
            "heur_mode", "build_plan_policy", "pygraph"]
