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

# Batch invariance (set `module.BATCH_INVARIANT = True`): a sequence's outputs, final state and
# gradients are then bit for bit the same whatever else is in the batch. Every choice that weighs
# a call's programs against the GPU's multiprocessors (the scan at half the chunk size, segmented
# scans, resumed re-runs, few-program launch settings) depends on the batch; in this mode each
# takes the branch a batch too large to fill the GPU would take, as in the interpreter. Costs speed
# only where the batch has fewer programs than the GPU has multiprocessors.
BATCH_INVARIANT = False


def _multiprocessors(q):
    """The multiprocessors the launch choices weigh a call's programs against: q's GPU's
    (_device_multiprocessors), or 0 with BATCH_INVARIANT (every choice then as for a large batch)."""
    return 0 if BATCH_INVARIANT else _device_multiprocessors(q)


def _device_multiprocessors(q):
    """Streaming multiprocessors of q's GPU (0 in the interpreter, where launch settings do nothing)."""
    if not q.is_cuda:
        return 0
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if index not in _MULTIPROCESSORS:
        _MULTIPROCESSORS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _MULTIPROCESSORS[index]
