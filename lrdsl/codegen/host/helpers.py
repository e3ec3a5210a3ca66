"""Integer helpers of the host code."""


def _cdiv(a, b):
    """ceil(a / b) of non-negative ints. triton.cdiv and triton.next_power_of_2 are constexpr
    functions: called from Python they cost microseconds each, which a decode step pays per launch."""
    return -(-a // b)


def _next_power_of_2(n):
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()
