"""GPU entry points per format family; each module exposes matmul(x, qt) for CUDA tensors.

Modules here import CuPy lazily (quantzoo.cuda_launch): the package works without CUDA.
"""
