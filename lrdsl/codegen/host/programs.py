"""A scan's programs and the GPU's multiprocessors: the facts the launch rule and the segmented
scans weigh (few programs on many multiprocessors leave most of the GPU idle).

Host code (lrdsl/codegen/host/__init__.py): copied verbatim into every generated module.
"""
import torch

from .helpers import _cdiv


def _scan_programs(c, BV):
    """A scan's programs (its grid, on one axis): one per (sequence, value head, block of BV columns)."""
    return c["N"] * c["HV"] * _cdiv(c["V"], BV)


_MULTIPROCESSORS = {}  # device index -> streaming multiprocessors


def _multiprocessors(q):
    """Streaming multiprocessors of q's GPU (0 in the interpreter, where launch settings do nothing)."""
    if not q.is_cuda:
        return 0
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if index not in _MULTIPROCESSORS:
        _MULTIPROCESSORS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _MULTIPROCESSORS[index]
