"""Triton kernels for MoE experts and sinks attention, one family per file, each with a public
launcher; their torch references live in `kernels.reference`.

Knows nothing of models, flags or screens: callers pass tensors and sizes.
"""
