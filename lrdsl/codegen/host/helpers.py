"""Integer helpers of the host code, and the refusal of second derivatives every backward shares."""
import torch


def _cdiv(a, b):
    """ceil(a / b) of non-negative ints. triton.cdiv and triton.next_power_of_2 are constexpr
    functions: called from Python they cost microseconds each, which a decode step pays per launch."""
    return -(-a // b)


def _next_power_of_2(n):
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


class SecondDerivativeError(RuntimeError):
    """A second derivative was asked of this module's functions (a backward with create_graph=True)."""


def _first_derivative_only(fn):
    """A backward (of an autograd Function, or a custom op's) that refuses a second derivative in
    one line. The backward is kernels, not torch operations: the gradients it returns have no
    graph, so a create_graph=True backward (a gradient penalty) would silently lose its
    second-order terms. Autograd runs a backward with gradients enabled exactly when
    create_graph=True, whatever the cotangents: torch's once_differentiable refuses only
    cotangents that require grad, and a constant one does not. (Under torch.compile the backward
    is traced, and torch.compile refuses a double backward itself.)"""

    def decorate(backward):
        def first_derivative_only(ctx, *grads):
            if torch.is_grad_enabled() and not torch.compiler.is_compiling():
                raise SecondDerivativeError(f"{fn}: second derivatives are not supported (a backward with "
                                            "create_graph=True): its backward is kernels, whose gradients have no graph")
            with torch.no_grad():
                return backward(ctx, *grads)

        first_derivative_only.__name__, first_derivative_only.__doc__ = backward.__name__, backward.__doc__
        return first_derivative_only

    return decorate
