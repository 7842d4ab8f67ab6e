"""The model-facing layer: drop-in modules, per-head alpha, SDPA interception, head statistics, context parallelism.

Layer rules: CONTRIBUTING.md, "Layers"; the picture: docs/design.md.
"""
