"""lrdsl: compile declarative linear-recurrence specs into Triton kernels.

    import lrdsl
    mod = lrdsl.load("specs/gdn.toml")     # compile (cached) and import
    o, ht = mod.recurrent(q, k, v, g, beta, output_final_state=True)
"""
__version__ = "0.1.0"


def load(path, **options):
    """Compile the spec at `path` (through the on-disk cache) and import the generated module."""
    from .runtime.loader import load as _load

    return _load(path, **options)
