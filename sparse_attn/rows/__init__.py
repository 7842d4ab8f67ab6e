"""The row-wise toolbox: sparse mappings, Fenchel-Young losses, structured and constrained mappings, the row kernels'
autograd wiring.

Layer rules: CONTRIBUTING.md, "Layers"; the picture: docs/design.md.
"""
