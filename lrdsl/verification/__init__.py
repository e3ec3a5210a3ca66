"""Checking generated kernels: the chunk-form evaluator, sympy proofs, `lrdsl check`'s engine and the random workloads every check draws."""
