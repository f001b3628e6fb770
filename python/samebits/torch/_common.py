"""What every samebits.torch op shares: torch tensors as samebits._core.raw descriptors, the stream,
the accumulator dtype, and the argument checks that must happen before a pointer is taken."""
import contextlib
from typing import Optional

import torch
from torch import Tensor

from .. import _core
from .._core import Error

raw = _core.raw

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
           torch.int32: "int32", torch.uint8: "uint8", torch.int64: "int64"}


def _acc(t: Tensor) -> torch.dtype:
    """The dtype of accumulators and per-row statistics: fp32, or fp64 for fp64 tensors (the CPU's
    truth mode, which torch.autograd.gradcheck runs the ops in)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _desc(t: Optional[Tensor], op: str, arg: str):
    """(pointer, dtype, shape, device, tensor) of a contiguous tensor, for samebits._core.raw. The
    tensor rides along so that a temporary (a .contiguous() copy made in the call's argument list)
    stays alive until the op has run: the pointer alone would let torch's allocator hand its memory
    to the next temporary."""
    if t is None:
        return None
    if t.dtype not in _DTYPES:
        raise Error(f"samebits.torch {op}: argument '{arg}': dtype {t.dtype} is not taken "
                    f"(bfloat16, float16, float32; float64 on the CPU; int32 / int64 ids, int32 targets; uint8 masks)")
    if t.dtype == torch.float64 and t.device.type == "cuda":
        raise Error(f"samebits.torch {op}: argument '{arg}': dtype torch.float64 is taken on the CPU only (the "
                    "fp64 truth mode); CUDA ops take bfloat16, float16 and float32")
    if t.device.type not in ("cpu", "cuda"):
        raise Error(f"samebits.torch {op}: argument '{arg}': device {t.device} is not taken (cpu or cuda)")
    if not t.is_contiguous():
        raise Error(f"samebits.torch {op}: argument '{arg}': must be contiguous (.contiguous())")
    return (t.data_ptr(), _DTYPES[t.dtype], tuple(t.shape), t.device.type, t)


# torch's current stream of a device as the raw handle, without making a torch.cuda.Stream object
# (the call's host time: issue 29); the public path where this torch lacks the private one.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_NO_SWITCH = contextlib.nullcontext()  # stateless: one instance serves every call


def _stream(t: Tensor) -> int:
    if not t.is_cuda:
        return 0
    if _raw_stream is not None:
        return _raw_stream(t.device.index)
    return torch.cuda.current_stream(t.device).cuda_stream


def _device(t: Tensor):
    """The tensor's device made current for the call: a switch only where another one is current
    (entering torch.cuda.device costs as much as the rest of a small op's host work)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _NO_SWITCH


def _load_dispatcher_ops():
    """samebits.torch's ops registered in torch's C++ dispatcher (_torch_ops.cpp: no Python in a
    call), where the build made them for this torch version; None otherwise (the custom_op path
    runs) or where SAMEBITS_TORCH_OPS=0."""
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    lib, stamp = os.path.join(here, "_torch_ops.so"), os.path.join(here, "_torch_ops.version")
    if os.environ.get("SAMEBITS_TORCH_OPS") == "0" or not os.path.exists(lib) or not os.path.exists(stamp):
        return None
    with open(stamp) as f:
        if f.read().strip() != torch.__version__:
            return None
    try:
        torch.ops.load_library(lib)
    except (OSError, RuntimeError) as e:  # a stale or broken build: the custom_op path, said once
        import warnings
        warnings.warn(f"samebits.torch: {lib} did not load ({e}); the ops run through torch.library.custom_op")
        return None
    return torch.ops.samebits_ext


_ext = _load_dispatcher_ops()


def _ids(t: Tensor, op: str, arg: str) -> Tensor:
    """Ids an op reads as int32 or int64 (the embedding's), flattened, as they are."""
    if t.dtype not in (torch.int32, torch.int64):
        raise Error(f"samebits.torch {op}: argument '{arg}': dtype {t.dtype} is not taken (int32 or int64)")
    return t.reshape(-1).contiguous()


def _int32(t: Tensor, op: str, arg: str) -> Tensor:
    """Token ids / targets as int32, refusing an int64 value int32 cannot hold (a cast would wrap it
    into a valid-looking id)."""
    flat = _ids(t, op, arg)
    if flat.dtype == torch.int64 and flat.numel() and bool((flat.max() >= 2**31) | (flat.min() < -2**31)):
        raise Error(f"samebits.torch {op}: argument '{arg}': a value does not fit in int32")
    return flat.to(torch.int32)


def _rows(x: Tensor, op: str) -> Tensor:
    if x.dim() < 1:
        raise Error(f"samebits.torch {op}: argument 'x': needs at least one dimension")
    if not x.is_contiguous():
        raise Error(f"samebits.torch {op}: argument 'x': must be contiguous (.contiguous())")
    return x.reshape(-1, x.shape[-1])
