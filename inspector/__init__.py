"""The user-facing side: the Textual TUI, the headless CLI and session files.

Headless commands import no textual, plotext or tomli-w at module level, so they run on the GPU
machines, where only torch, triton, numpy and safetensors exist.
"""
