"""The engine: model presets, dispatch decisions, flags, the model forward and its arms,
generation, and measurement.

Never imports inspector/ or textual: it runs where only torch, triton, numpy and safetensors
exist (the GPU machines).
"""
