"""The row kernels: alpha-entmax rows, TV prox, isotonic regression.

Layer rules: CONTRIBUTING.md, "Layers"; the picture: docs/design.md.
"""
