"""The attention machinery: the public call, the argument gate, routes, masks, the fused kernels' autograd wiring, the
reference, the CPU path, decode.

Layer rules: CONTRIBUTING.md, "Layers"; the picture: docs/design.md.
"""
