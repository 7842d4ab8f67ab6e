"""The attention kernels: forward, backward, decode and their tile-level helpers.

Layer rules: CONTRIBUTING.md, "Layers"; the picture: docs/design.md.
"""
