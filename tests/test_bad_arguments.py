"""One table of bad arguments per kind of entry point (mappings, losses, structured and constrained mappings,
kernel launchers, stats; entmax_attention and its reference; the modules; SDPA routing), each row a call
that must raise ``TypeError`` / ``ValueError`` naming the argument, and a test that every public callable of
``sparse_attn`` has rows in them (the Hugging Face integration's table is in tests/integrations/test_hf.py).
"""

import inspect
import math
import re

import pytest
import torch
from helpers import qkv
from torch import nn

import sparse_attn as sa
from sparse_attn.kernels.rows.row_entmax import entmax_rows_bwd, entmax_rows_fwd
from sparse_attn.kernels.rows.structured import isotonic_nonincreasing_rows, tv_prox_rows
from sparse_attn.reference import entmax_attention_reference
from sparse_attn.rows._triton_rows import entmax_rows_triton

_X = torch.randn(3, 4)
_X64 = torch.randn(3, 4, dtype=torch.float64)
_LABELS = torch.tensor([0, 1, 3])
_META = torch.empty(3, 4, device="meta")
_BOOL = torch.ones(3, 4, dtype=torch.bool)
_ATTENTION_MODEL = nn.ModuleDict({"attn": sa.EntmaxMultiheadAttention(16, 4)})


# (callable, kwargs, exception, substring naming the argument). One row per argument check.
BAD_INPUTS = [
    (sa.sparsemax, dict(X=[1.0, 2.0]), TypeError, "X must be a torch.Tensor"),
    (sa.sparsemax, dict(X=torch.ones(3, 4, dtype=torch.int64)), TypeError, "X must be a floating"),
    (sa.sparsemax, dict(X=torch.tensor(1.0)), ValueError, "dim=-1 cannot index"),
    (sa.sparsemax, dict(X=_X, dim=2), ValueError, "dim must be in"),
    (sa.sparsemax, dict(X=_X, dim=1.0), TypeError, "dim must be an int"),
    (sa.sparsemax, dict(X=_X, k=0), ValueError, "k must be >= 1"),
    (sa.sparsemax, dict(X=_X, k=2.0), TypeError, "k must be a positive int or None"),
    (sa.entmax15, dict(X=_X, k=-1), ValueError, "k must be >= 1"),
    (sa.entmax15, dict(X=_X, dim=-3), ValueError, "dim must be in"),
    (sa.entmax15, dict(X=_X, dim=2), ValueError, "dim must be in"),
    (sa.entmax15, dict(X=[1.0, 2.0]), TypeError, "X must be a torch.Tensor"),
    (sa.entmax, dict(X=_X, alpha=0.0), ValueError, "alpha must be finite and in"),
    (sa.entmax, dict(X=_X, alpha=math.inf), ValueError, "alpha must be finite and in"),
    (sa.entmax, dict(X=_X, alpha="1.5"), TypeError, "alpha must be a float"),
    (sa.entmax, dict(X=_X, alpha=True), TypeError, "alpha must be a float"),
    (sa.entmax, dict(X=_X, alpha=torch.ones(3, 1, dtype=torch.int64)), TypeError, "alpha must be a float"),
    (sa.entmax, dict(X=_X, alpha=torch.full((3, 4), 1.5)), ValueError, "alpha must be broadcastable"),
    (sa.entmax, dict(X=_X, alpha=torch.full((2, 1), 1.5)), ValueError, "alpha must be broadcastable"),
    (sa.entmax, dict(X=_X, alpha=torch.full((1, 3, 1), 1.5)), ValueError, "alpha must be broadcastable"),
    (sa.entmax, dict(X=_X, alpha=torch.tensor([[1.5], [math.nan], [1.2]])), ValueError, "alpha must be finite"),
    (sa.entmax, dict(X=_X, alpha=torch.full((3, 1), 1.5, device="meta")), ValueError, "alpha must be on the input's"),
    (sa.entmax, dict(X=_X, alpha=torch.tensor([[1.5], [0.0], [1.2]])), ValueError, "alpha must be finite and in"),
    (sa.entmax_bisect, dict(X=_X, n_iter=0), ValueError, "n_iter must be >= 1"),
    (sa.entmax_bisect, dict(X=_X, n_iter=None), TypeError, "n_iter must be a positive int"),
    (sa.entmax_bisect, dict(X=_X, ensure_sum_one=1), TypeError, "ensure_sum_one must be a bool"),
    (sa.entmax_bisect, dict(X=_X, alpha=-1.0), ValueError, "alpha must be finite and in"),
    (sa.entmax_bisect, dict(X=_X, alpha=math.nan), ValueError, "alpha must be finite and in"),
    (sa.Sparsemax, dict(dim="last"), TypeError, "dim must be an int"),
    (sa.Sparsemax, dict(k=0), ValueError, "k must be >= 1"),
    (sa.Entmax15, dict(k=1.5), TypeError, "k must be a positive int"),
    (sa.EntmaxBisect, dict(alpha=0.0), ValueError, "alpha must be finite and in"),
    (sa.EntmaxBisect, dict(n_iter=0), ValueError, "n_iter must be >= 1"),
    (sa.Entmax, dict(alpha=torch.tensor([1, 2])), TypeError, "alpha must be a float"),
    (sa.Entmax, dict(alpha="x"), TypeError, "alpha must be a real number"),
    (sa.entmax, dict(X=_X, alpha=1.5, dim=2), ValueError, "dim must be in [-2, 1]"),
    (sa.entmax_bisect, dict(X=_X, dim=1.5), TypeError, "dim must be an int"),
    (sa.Entmax, dict(dim="x"), TypeError, "dim must be an int"),
    (sa.Entmax15, dict(dim=1.5), TypeError, "dim must be an int"),
    (sa.EntmaxBisect, dict(dim=None), TypeError, "dim must be an int"),
    (sa.Sparsemax(), dict(X=torch.ones(3, 4, dtype=torch.int64)), TypeError, "X must be a floating"),
    (sa.Entmax15(), dict(X=[1.0]), TypeError, "X must be a torch.Tensor"),
    (sa.EntmaxBisect(), dict(X=torch.ones(3, dtype=torch.int32)), TypeError, "X must be a floating"),
    (sa.Entmax(), dict(X=[1.0]), TypeError, "X must be a torch.Tensor"),
    (entmax_rows_triton, dict(X=_X.double(), alpha=1.5), TypeError, "X must be a float16, bfloat16 or float32"),
    (entmax_rows_triton, dict(X=_X, alpha=2.5), ValueError, "alpha must be"),
    (entmax_rows_triton, dict(X=_X, alpha=torch.full((3, 1), 0.9)), ValueError, "alpha must be in [1, 2]"),
    (entmax_rows_triton, dict(X=_X, alpha=1.5, dim=2), ValueError, "dim must be in"),
    (sa.sparsemax_loss, dict(X=_X, target=[0, 1, 3]), TypeError, "target must be a torch.Tensor"),
    (sa.sparsemax_loss, dict(X=_X[0], target=_LABELS), ValueError, "X must have shape (N, C)"),
    (sa.sparsemax_loss, dict(X=torch.ones(3, 4, dtype=torch.int32), target=_LABELS), TypeError, "X must be a floating"),
    (sa.sparsemax_loss, dict(X=_X, target=torch.tensor([0, 1])), ValueError, "target labels must have shape (3,)"),
    (sa.sparsemax_loss, dict(X=_X, target=torch.tensor([0, 1, 4])), ValueError, "target labels must be in [0, 3]"),
    (sa.sparsemax_loss, dict(X=_X, target=torch.tensor([0, -1, 2])), ValueError, "target labels must be in [0, 3]"),
    (sa.sparsemax_loss, dict(X=_X, target=torch.ones(3, dtype=torch.bool)), TypeError, "target must be an integer"),
    (sa.sparsemax_loss, dict(X=_X, target=torch.full((3, 3), 1 / 3)), ValueError, "target with label proportions must"),
    (sa.sparsemax_loss, dict(X=_X, target=_META), ValueError, "target must be on the device of X"),
    (sa.sparsemax_loss, dict(X=_X, target=_LABELS.to("meta")), ValueError, "target must be on the device of X"),
    (sa.sparsemax_loss, dict(X=_X, target=_LABELS, k=0), ValueError, "k must be >= 1"),
    (sa.sparsemax_loss, dict(X=_X, target=_LABELS, ignore_index=1.0), TypeError, "ignore_index must be an int"),
    (sa.sparsemax_loss, dict(X=_X, target=_LABELS, reduction="avg"), ValueError, "reduction must be one of"),
    (sa.entmax15_loss, dict(X=_X, target=_LABELS, k="2"), TypeError, "k must be a positive int"),
    (sa.entmax15_loss, dict(X=_X, target=torch.full((3, 4), 0.5)), ValueError, "target label proportions must sum"),
    (sa.entmax15_loss, dict(X=_X, target=torch.tensor([0, 1, 4])), ValueError, "target labels must be in [0, 3]"),
    (sa.entmax15_loss, dict(X=_X, target=torch.ones(3, dtype=torch.bool)), TypeError, "target must be an integer"),
    (sa.entmax_bisect_loss, dict(X=_X, target=_LABELS, alpha=0.0), ValueError, "alpha must be finite and in"),
    (sa.entmax_bisect_loss, dict(X=_X, target=_LABELS, alpha=-1.0), ValueError, "alpha must be finite and in"),
    (sa.entmax_bisect_loss, dict(X=_X, target=_LABELS, alpha=torch.full((4, 1), 1.5)), ValueError,
     "alpha must be broadcastable"),
    (sa.entmax_bisect_loss, dict(X=_X, target=_LABELS, n_iter=0), ValueError, "n_iter must be >= 1"),
    (sa.SparsemaxLoss, dict(reduction="batchmean"), ValueError, "reduction must be one of"),
    (sa.SparsemaxLoss, dict(k=0), ValueError, "k must be >= 1"),
    (sa.Entmax15Loss, dict(ignore_index="pad"), TypeError, "ignore_index must be an int"),
    (sa.EntmaxBisectLoss, dict(alpha=-2.0), ValueError, "alpha must be finite and in"),
    (sa.EntmaxBisectLoss, dict(n_iter=1.5), TypeError, "n_iter must be a positive int"),
    (sa.entmax15_loss, dict(X=_X, target=_LABELS, ignore_index=1.0), TypeError, "ignore_index must be an int"),
    (sa.entmax15_loss, dict(X=_X, target=_LABELS, reduction="avg"), ValueError, "reduction must be one of"),
    (sa.entmax_bisect_loss, dict(X=_X, target=_LABELS, ignore_index="x"), TypeError, "ignore_index must be an int"),
    (sa.entmax_bisect_loss, dict(X=_X, target=_LABELS, reduction=None), ValueError, "reduction must be one of"),
    (sa.SparsemaxLoss, dict(ignore_index=None), TypeError, "ignore_index must be an int"),
    (sa.Entmax15Loss, dict(k=0), ValueError, "k must be >= 1"),
    (sa.Entmax15Loss, dict(reduction="avg"), ValueError, "reduction must be one of"),
    (sa.EntmaxBisectLoss, dict(ignore_index=1.5), TypeError, "ignore_index must be an int"),
    (sa.EntmaxBisectLoss, dict(reduction="x"), ValueError, "reduction must be one of"),
    (sa.SparsemaxLoss(), dict(X=_X[0], target=_LABELS), ValueError, "X must have shape (N, C)"),
    (sa.SparsemaxLoss(), dict(X=_X, target=[0, 1, 3]), TypeError, "target must be a torch.Tensor"),
    (sa.Entmax15Loss(), dict(X=torch.ones(3, 4, dtype=torch.int64), target=_LABELS), TypeError, "X must be a floating"),
    (sa.Entmax15Loss(), dict(X=_X, target=torch.tensor([0, 1, 9])), ValueError, "target labels must be in [0, 3]"),
    (sa.EntmaxBisectLoss(), dict(X=[1.0], target=_LABELS), TypeError, "X must be a torch.Tensor"),
    (sa.EntmaxBisectLoss(), dict(X=_X, target=torch.full((3, 4), 0.5)), ValueError,
     "target label proportions must sum"),
    (sa.fusedmax, dict(X=[1.0]), TypeError, "X must be a torch.Tensor"),
    (sa.fusedmax, dict(X=[1.0, 2.0]), TypeError, "X must be a torch.Tensor"),
    (sa.fusedmax, dict(X=_X, lam=-0.1), ValueError, "lam must be finite and in"),
    (sa.fusedmax, dict(X=_X, lam=math.nan), ValueError, "lam must be finite and in"),
    (sa.fusedmax, dict(X=_X, gamma=0.0), ValueError, "gamma must be finite and in"),
    (sa.fusedmax, dict(X=_X, gamma="1"), TypeError, "gamma must be a real number"),
    (sa.fusedmax, dict(X=_X, dim=5), ValueError, "dim must be in"),
    (sa.fusedmax, dict(X=_X, dim=2), ValueError, "dim must be in"),
    (sa.fusedmax, dict(X=_X, mask=torch.ones(3, 4)), TypeError, "mask must be a boolean tensor"),
    (sa.fusedmax, dict(X=_X, mask=[True]), TypeError, "mask must be a torch.Tensor"),
    (sa.fusedmax, dict(X=_X, mask=_BOOL[:2]), ValueError, "mask must be broadcastable"),
    (sa.fusedmax, dict(X=_X, mask=torch.ones(5, 4, dtype=torch.bool)), ValueError, "mask must be broadcastable"),
    (sa.fusedmax, dict(X=_X, mask=_BOOL.to("meta")), ValueError, "mask must be on the device of X"),
    (sa.fusedmax, dict(X=_X, lengths=torch.tensor([1, 2, 5])), ValueError, "lengths must be in [0, 4]"),
    (sa.fusedmax, dict(X=_X, lengths=torch.tensor([1.0, 2.0, 3.0])), TypeError, "lengths must be an integer"),
    (sa.fusedmax, dict(X=_X, lengths=torch.tensor([1, 2])), ValueError, "lengths must be broadcastable"),
    (sa.fusedmax, dict(X=_X, lengths=torch.tensor([1, 2, 3], device="meta")), ValueError,
     "lengths must be on the device of X"),
    (sa.oscarmax, dict(X=_X, lam=math.inf), ValueError, "lam must be finite and in"),
    (sa.oscarmax, dict(X=torch.ones(3, 4, dtype=torch.int64)), TypeError, "X must be a floating"),
    (sa.oscarmax, dict(X=_X, lam="big"), TypeError, "lam must be a real number"),
    (sa.oscarmax, dict(X=_X, lengths=torch.tensor([1.0, 2.0, 3.0])), TypeError, "lengths must be an integer"),
    (sa.sq_pnorm_max, dict(X=_X, p=1.0), ValueError, "p must be finite and in (1.0, 2.0]"),
    (sa.sq_pnorm_max, dict(X=_X, p=2.5), ValueError, "p must be finite and in (1.0, 2.0]"),
    (sa.sq_pnorm_max, dict(X=_X, gamma=-1.0), ValueError, "gamma must be finite and in"),
    (sa.gamma_sparsemax, dict(X=_X, gamma=math.nan), ValueError, "gamma must be finite and in"),
    (sa.gamma_sparsemax, dict(X=_X, lengths=torch.tensor([-1, 2, 3])), ValueError, "lengths must be in [0, 4]"),
    (sa.tv_prox, dict(X=_X, lam=-1.0), ValueError, "lam must be finite and in"),
    (sa.tv_prox, dict(X=_X, mask=torch.ones(3, 4, dtype=torch.int8)), TypeError, "mask must be a boolean"),
    (sa.oscar_prox, dict(X=_X, lam="0.1"), TypeError, "lam must be a real number"),
    (sa.oscar_prox, dict(X=_X, dim=1.5), TypeError, "dim must be an int"),
    (sa.Fusedmax, dict(lam=-1.0), ValueError, "lam must be finite and in"),
    (sa.Fusedmax, dict(lam=math.inf), ValueError, "lam must be finite and in"),
    (sa.Fusedmax, dict(dim="x"), TypeError, "dim must be an int"),
    (sa.Oscarmax, dict(gamma=0.0), ValueError, "gamma must be finite and in"),
    (sa.oscarmax, dict(X=_X, dim=2), ValueError, "dim must be in"),
    (sa.oscarmax, dict(X=_X, gamma=-1.0), ValueError, "gamma must be finite and in"),
    (sa.oscarmax, dict(X=_X, mask=torch.ones(3, 4)), TypeError, "mask must be a boolean tensor"),
    (sa.sq_pnorm_max, dict(X=_X, dim="a"), TypeError, "dim must be an int"),
    (sa.sq_pnorm_max, dict(X=_X, mask=_BOOL[:2]), ValueError, "mask must be broadcastable"),
    (sa.sq_pnorm_max, dict(X=_X, lengths=torch.tensor([5, 1, 1])), ValueError, "lengths must be in [0, 4]"),
    (sa.gamma_sparsemax, dict(X=_X, dim=3), ValueError, "dim must be in"),
    (sa.gamma_sparsemax, dict(X=_X, mask=[True]), TypeError, "mask must be a torch.Tensor"),
    (sa.tv_prox, dict(X=_X, dim=-3), ValueError, "dim must be in"),
    (sa.tv_prox, dict(X=_X, lengths=torch.tensor([1.0, 2.0, 3.0])), TypeError, "lengths must be an integer"),
    (sa.oscar_prox, dict(X=_X, mask=torch.ones(3, 4, dtype=torch.int8)), TypeError, "mask must be a boolean"),
    (sa.oscar_prox, dict(X=_X, lengths=torch.tensor([-1, 2, 3])), ValueError, "lengths must be in [0, 4]"),
    (sa.Fusedmax, dict(gamma=math.inf), ValueError, "gamma must be finite and in"),
    (sa.Oscarmax, dict(lam=-0.1), ValueError, "lam must be finite and in"),
    (sa.Oscarmax, dict(dim=1.0), TypeError, "dim must be an int"),
    (sa.Fusedmax(), dict(X=[1.0]), TypeError, "X must be a torch.Tensor"),
    (sa.Oscarmax(), dict(X=_X, mask=torch.ones(3, 4)), TypeError, "mask must be a boolean tensor"),
    (sa.csoftmax, dict(z=[1.0], u=_X), TypeError, "z must be a torch.Tensor"),
    (sa.csoftmax, dict(z=_X, u=1.0), TypeError, "u must be a torch.Tensor"),
    (sa.csoftmax, dict(z=_X, u=torch.ones(3, 4, dtype=torch.int64)), TypeError, "u must be a floating"),
    (sa.csoftmax, dict(z=_X, u=torch.ones(2, 4)), ValueError, "u must be broadcastable"),
    (sa.csoftmax, dict(z=_X, u=torch.ones(2, 3, 4)), ValueError, "u must be broadcastable"),
    (sa.csoftmax, dict(z=_X, u=torch.ones(3, 4), mask=torch.ones(3, 4, dtype=torch.int64)), TypeError,
     "mask must be a boolean"),
    (sa.csoftmax, dict(z=_X, u=torch.ones(3, 4, device="meta")), ValueError, "u must be on the device of z"),
    (sa.csoftmax, dict(z=_X, u=torch.full((3, 4), -1.0)), ValueError, "u must be >= 0"),
    (sa.csoftmax, dict(z=_X, u=torch.full((3, 4), math.nan)), ValueError, "on the valid entries, got nan"),
    (sa.csoftmax, dict(z=_X, u=torch.full((3, 4), 0.1)), ValueError, "u must sum to at least 1"),
    (sa.csparsemax, dict(z=_X, u=torch.ones(3, 4), dim=2), ValueError, "dim must be in"),
    (sa.csparsemax, dict(z=_X, u=torch.ones(3, 4), dim=3), ValueError, "dim must be in"),
    (sa.csparsemax, dict(z=[1.0], u=torch.ones(3, 4)), TypeError, "z must be a torch.Tensor"),
    (sa.csparsemax, dict(z=_X, u=torch.ones(3, 4, dtype=torch.int64)), TypeError, "u must be a floating"),
    (sa.csparsemax, dict(z=_X, u=torch.ones(2, 4)), ValueError, "u must be broadcastable"),
    (sa.csoftmax, dict(z=_X, u=torch.ones(3, 4), dim=5), ValueError, "dim must be in"),
    (sa.csoftmax, dict(z=_X, u=torch.ones(3, 4), lengths=torch.tensor([1, 2])), ValueError,
     "lengths must be broadcastable"),
    (sa.csparsemax, dict(z=_X, u=torch.ones(3, 4), mask=torch.ones(3, 4)), TypeError, "mask must be a boolean"),
    (sa.csparsemax, dict(z=_X, u=torch.ones(3, 4), lengths=torch.tensor([5, 1, 1])), ValueError, "lengths must be in"),
    (sa.FertilityAttention, dict(transform="softmax"), ValueError, "transform must be one of"),
    (sa.FertilityAttention, dict(fertility=0.0), ValueError, "fertility must be finite and in"),
    (sa.FertilityAttention, dict(sink=1), TypeError, "sink must be a bool"),
    (sa.FertilityAttention, dict(exhaustion=-0.5), ValueError, "exhaustion must be finite and in"),
    (sa.FertilityAttention, dict(predictor=3), TypeError, "predictor must be a module"),
    (sa.FertilityPredictor, dict(input_dim=0), ValueError, "input_dim must be >= 1"),
    (sa.FertilityPredictor, dict(input_dim=4, hidden_dim=2.0), TypeError, "hidden_dim must be a positive int"),
    (sa.FertilityPredictor, dict(input_dim=4, max_fertility=math.inf), ValueError, "max_fertility must be finite"),
    (sa.set_checks, dict(enabled=1), TypeError, "enabled must be a bool"),
    (sa.record_head_stats, dict(model="model"), TypeError, "model must be an nn.Module"),
    (sa.record_head_stats, dict(model=nn.Linear(2, 2)), ValueError, "Linear contains no entmax attention layer"),
    (sa.record_head_stats, dict(model=_ATTENTION_MODEL, diversity="yes"), TypeError, "diversity must be a bool"),
    (sa.record_head_stats, dict(model=_ATTENTION_MODEL, history=1), TypeError, "history must be a bool"),
    (sa.record_head_stats, dict(model=_ATTENTION_MODEL, query_mask=[1, 0]), TypeError, "query_mask must be None or a"),
    (sa.record_head_stats, dict(model=_ATTENTION_MODEL, query_mask=torch.ones(2, 3)), TypeError,
     "query_mask must be a boolean or integer"),
    (sa.record_head_stats, dict(model=_ATTENTION_MODEL, query_mask=torch.ones(3, dtype=torch.bool)), ValueError,
     "query_mask must have shape (batch, query length)"),
    (sa.HeadStatsRecorder, dict(model=_ATTENTION_MODEL, diversity=1), TypeError, "diversity must be a bool"),
    (sa.HeadStatsRecorder, dict(model=None), TypeError, "model must be an nn.Module"),
]


def _fertility_calls():
    module = sa.FertilityAttention(fertility=1.0)
    scores = torch.randn(3, 4, 5)
    _, state = module(scores)
    return [
        (module, dict(scores=torch.ones(3, 4, 5, dtype=torch.int64)), TypeError, "scores must be a floating"),
        (module, dict(scores=torch.randn(5)), ValueError, "scores must have shape (..., T, J)"),
        (module, dict(scores=scores, src_mask=torch.ones(3, 5)), TypeError, "src_mask must be a boolean"),
        (module, dict(scores=scores, src_mask=torch.ones(3, 5, dtype=torch.bool, device="meta")), ValueError,
         "src_mask must be on the device of the scores"),
        (module, dict(scores=scores, src_lengths=torch.tensor([5, 3, 2], device="meta")), ValueError,
         "src_lengths must be on the device of the scores"),
        (module, dict(scores=scores, src_lengths=torch.tensor([6, 3, 2])), ValueError,
         "src_lengths must be in [0, 5] (src_len), got values in [2, 6]"),
        (module, dict(scores=scores, src_lengths=torch.tensor([-1, 3, 2])), ValueError,
         "src_lengths must be in [0, 5] (src_len), got values in [-1, 3]"),
        (module, dict(scores=scores, src_lengths=torch.tensor([[5], [3], [2]])), ValueError,
         "src_lengths must be broadcastable to (3,), got shape (3, 1)"),
        (module, dict(scores=scores, src_lengths=torch.tensor([5, 3])), ValueError,
         "src_lengths must be broadcastable to (3,), got shape (2,)"),
        (module, dict(scores=scores, src_lengths=torch.tensor([5.0, 3.0, 2.0])), TypeError,
         "src_lengths must be an integer tensor"),
        (module, dict(scores=scores, src_mask=torch.ones(2, 5, dtype=torch.bool)), ValueError,
         "src_mask must be broadcastable to (3, 5), got shape (2, 5)"),
        (module, dict(scores=scores, tgt_mask=torch.ones(3, 4)), TypeError,
         "tgt_mask must be a boolean tensor (False = padded target position), got dtype torch.float32"),
        (module, dict(scores=scores, tgt_mask=torch.ones(3, 5, dtype=torch.bool)), ValueError,
         "tgt_mask must be broadcastable to (3, 4), got shape (3, 5)"),
        (module, dict(scores=scores, tgt_mask=[True] * 4), TypeError, "tgt_mask must be a torch.Tensor"),
        (module, dict(scores=scores, fertility=torch.full((3, 5), -1.0)), ValueError, "fertility must be >= 0"),
        (module, dict(scores=scores, fertility=torch.ones(3, 5, dtype=torch.int64)), TypeError,
         "fertility must be a float or a floating-point tensor"),
        (module, dict(scores=scores, fertility=torch.ones(3, 5, device="meta")), ValueError,
         "fertility must be on the device of the scores"),
        (module, dict(scores=scores, tgt_mask=torch.ones(3, 4, dtype=torch.bool, device="meta")), ValueError,
         "tgt_mask must be on the device of the scores"),
        (module, dict(scores=scores, state="state"), TypeError, "state must be a FertilityState"),
        (module.step, dict(scores=scores[:, 0], state=state, step_mask=torch.ones(3)), TypeError,
         "step_mask must be a boolean"),
        (module.step, dict(scores=scores[:, 0], step_mask=torch.ones(3, dtype=torch.int64)), TypeError,
         "step_mask must be a boolean tensor"),
        (module.step, dict(scores=scores[:, 0], step_mask=torch.ones(4, dtype=torch.bool)), ValueError,
         "step_mask must be broadcastable to (3,), got shape (4,)"),
        (module.step, dict(scores=scores[:, 0].to("meta"), state=state), ValueError,
         "scores must be on the device of the state"),
        (module.init_state, dict(batch_shape=(3,), src_len=0), ValueError, "src_len must be >= 1"),
        (module.init_state, dict(batch_shape=(3,), src_len=5, src_mask=torch.ones(3, 5)), TypeError,
         "src_mask must be a boolean tensor"),
        (module.init_state, dict(batch_shape=(3,), src_len=5, src_lengths=torch.tensor([6, 1, 1])), ValueError,
         "src_lengths must be in [0, 5]"),
        (module.init_state, dict(batch_shape=(3,), src_len=5, fertility=torch.full((3, 5), -1.0)), ValueError,
         "fertility must be >= 0"),
        (module.init_state, dict(batch_shape=3, src_len=5), TypeError, "batch_shape must be"),
        (module.init_state, dict(batch_shape=(3,), src_len=5, dtype=torch.int64), TypeError, "dtype must be"),
        (sa.FertilityPredictor(2), dict(h=torch.ones(3, 5, 4)), ValueError, "h must have shape (..., J, 2)"),
        (sa.FertilityPredictor(2), dict(h=torch.ones(3, 5, 2, dtype=torch.int64)), TypeError, "h must be a floating"),
        (tv_prox_rows, dict(x=torch.ones(2, 3, dtype=torch.float16), lengths=torch.tensor([3, 3]), lam=0.1), TypeError,
         "x must be a 2-d float32 or float64"),
        (tv_prox_rows, dict(x=torch.ones(2, 3), lengths=torch.tensor([3]), lam=0.1), ValueError,
         "lengths must have shape (2,)"),
        (isotonic_nonincreasing_rows, dict(v=torch.ones(2, 3), lengths=torch.ones(2)), TypeError,
         "lengths must be an integer"),
        (entmax_rows_fwd, dict(x=torch.ones(2, 3, dtype=torch.float64), alpha=1.5, mode=2), TypeError,
         "x must be a 2-d float16, bfloat16 or float32"),
        (entmax_rows_fwd, dict(x=torch.ones(2, 3), alpha=1.5, mode=7), ValueError, "mode must be one of"),
        (entmax_rows_fwd, dict(x=torch.ones(2, 3), alpha=torch.ones(3), mode=3), ValueError,
         "alpha must be a float or a tensor of shape (2,)"),
        (entmax_rows_bwd, dict(y=torch.ones(2, 3), dy=torch.ones(2, 4), alpha=1.5, mode=2), ValueError,
         "dy must match y"),
        (sa.FertilityAttention(fertility=None, predictor=sa.FertilityPredictor(2)), dict(scores=scores,
         encoder_states=torch.ones(3, 5, 2, dtype=torch.int64)), TypeError, "encoder_states must be a floating"),
    ]


@pytest.mark.parametrize("call,kwargs,exc,match", BAD_INPUTS + _fertility_calls(),
                         ids=lambda v: getattr(v, "__name__", None) if callable(v) else None)
def test_bad_inputs_name_the_argument(call, kwargs, exc, match):
    with pytest.raises(exc, match=re.escape(match)):
        call(**kwargs)


_M = "meta"
_CU = torch.tensor([0, 4, 9], dtype=torch.int32)
_CU_K = torch.tensor([0, 5, 11], dtype=torch.int32)
_VARLEN = dict(batch=1, cu_seqlens_q=_CU, cu_seqlens_k=_CU_K)

# (targets, arguments, error, message): targets "a" = entmax_attention with every backend,
# "r" = entmax_attention_reference, "t" = entmax_attention with backend="triton" only.
ATTENTION_BAD = [
    ("ar", dict(q="x"), TypeError, "q must be a torch.Tensor"),
    ("ar", dict(v=[1.0]), TypeError, "v must be a torch.Tensor"),
    ("ar", dict(q=torch.zeros(2, 4, 9)), ValueError, "q must have shape"),
    ("ar", dict(q=torch.zeros(2, 4, 9, 16, dtype=torch.int64)), TypeError, "q must be float16"),
    ("ar", dict(k=torch.zeros(2, 4, 11, 16, dtype=torch.float64)), TypeError, "share one dtype"),
    ("ar", dict(v=torch.zeros(2, 4, 11, 16, device=_M)), ValueError, "q, k and v must be on one device"),
    ("ar", dict(v=torch.zeros(2, 4, 12, 16)), ValueError, "k and v must agree in"),
    ("ar", dict(q=torch.zeros(3, 4, 9, 16)), ValueError, "same batch size"),
    ("ar", dict(q=torch.zeros(2, 4, 9, 6)), ValueError, "same head_dim"),
    ("ar", dict(q=torch.zeros(2, 5, 9, 16), enable_gqa=True, kv_heads=2), ValueError, "multiple of the number"),
    ("ar", dict(q=torch.zeros(2, 4, 9, 16), kv_heads=0), ValueError, "multiple of the number"),
    ("a", dict(kv_heads=2), ValueError, "enable_gqa=True"),
    ("ar", dict(alpha=0.5), ValueError, r"alpha must be finite and in \[1, 2\]"),
    ("ar", dict(alpha=2.5), ValueError, r"alpha must be finite and in \[1, 2\]"),
    ("ar", dict(alpha=float("nan")), ValueError, "alpha must be finite"),
    ("ar", dict(alpha=float("inf")), ValueError, "alpha must be finite"),
    ("ar", dict(alpha=torch.tensor([1.5, 1.2, 3.0, 1.0])), ValueError, r"alpha must be finite and in \[1, 2\]"),
    ("ar", dict(alpha=torch.tensor([1.5, float("nan"), 1.0, 1.0])), ValueError, r"alpha must be finite"),
    ("ar", dict(alpha=torch.tensor([1.5, 1.2])), ValueError, "alpha must be a float or a tensor of shape"),
    ("ar", dict(alpha=torch.ones(4, 1)), ValueError, "alpha must be a float or a tensor of shape"),
    ("ar", dict(alpha=torch.ones(0)), ValueError, "alpha must be a float or a tensor of shape"),
    ("ar", dict(alpha=torch.tensor([1, 2, 1, 2])), TypeError, "floating-point tensor"),
    ("ar", dict(alpha=torch.ones(4, device=_M)), ValueError, "alpha must be on the device of q"),
    ("ar", dict(alpha="1.5"), TypeError, "alpha must be a float or a tensor"),
    ("ar", dict(alpha=True), TypeError, "alpha must be a float or a tensor"),
    ("ar", dict(attn_mask=torch.zeros(2, 4, 9, 10, dtype=torch.bool)), ValueError, "attn_mask must be broadcastable"),
    ("ar", dict(attn_mask=torch.zeros(1, 2, 4, 9, 11)), ValueError, "attn_mask must be broadcastable"),
    ("ar", dict(attn_mask=torch.zeros(9, 11, dtype=torch.int32)), TypeError, "attn_mask must be boolean"),
    ("ar", dict(attn_mask=[[True]]), TypeError, "attn_mask must be a torch.Tensor"),
    ("ar", dict(attn_mask=torch.zeros(9, 11, device=_M)), ValueError, "attn_mask must be on the device"),
    ("ar", dict(block_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool)), TypeError, "block_mask must be None, a "),
    ("ar", dict(block_mask=sa.BlockSparseMask(torch.ones(1, 1, 1, 1), 16)), TypeError, "block_mask: the mask must"),
    ("ar", dict(block_mask=sa.BlockSparseMask(torch.ones(1, 1, 1, 1, dtype=torch.bool), (16, 0))), ValueError,
     "block_mask: block_size must be"),
    ("ar", dict(block_mask=sa.BlockSparseMask(torch.ones(2, 4, 1, 2, dtype=torch.bool), 8)), ValueError,
     r"block_mask: the mask must have shape .* = \(2 or 1, 4 or 1, 2, 2\)"),
    ("ar", dict(block_mask=sa.BlockSparseMask(torch.ones(1, 1, 1, 1, dtype=torch.bool, device=_M), 16)), ValueError,
     "block_mask must be on the device"),
    ("ar", dict(block_mask=sa.BlockSparseMask(torch.ones(1, 1, 1, 1, dtype=torch.bool), 16,
                                              torch.zeros(1, 16, 1, dtype=torch.int32))), TypeError,
     "block_mask: with bits, the mask must be an int32 tensor of block states"),
    ("ar", dict(block_mask=sa.BlockSparseMask(torch.ones(1, 1, 1, 1, dtype=torch.int32), 16, torch.zeros(1, 16, 1))),
     TypeError, r"block_mask: bits must be None or an int32 tensor \(partial blocks, 16, 1\)"),
    ("ar", dict(block_mask=sa.BlockSparseMask(torch.ones(1, 1, 1, 1, dtype=torch.int32), 16,
                                              torch.zeros(1, 8, 1, dtype=torch.int32))), ValueError,
     r"block_mask: bits must have shape \(partial blocks, 16, 1\)"),
    ("ar", dict(block_mask=sa.BlockSparseMask(torch.full((1, 1, 1, 1), 5, dtype=torch.int32), 16,
                                              torch.zeros(1, 16, 1, dtype=torch.int32))), ValueError,
     r"block_mask: block states must lie in \[0, 2\]"),
    ("ar", dict(dropout_p=1.0), ValueError, r"dropout_p must be finite and in \[0, 1\)"),
    ("ar", dict(dropout_p=-0.1), ValueError, r"dropout_p must be finite and in \[0, 1\)"),
    ("ar", dict(dropout_p=float("nan")), ValueError, "dropout_p must be finite"),
    ("ar", dict(dropout_p="0.1"), TypeError, "dropout_p must be a Python number"),
    ("ar", dict(scale=float("inf")), ValueError, "scale must be None or a finite number"),
    ("ar", dict(scale=float("nan")), ValueError, "scale must be None or a finite number"),
    ("ar", dict(scale=torch.tensor(0.5)), TypeError, "scale must be None or a Python number"),
    ("ar", dict(enable_gqa="no"), TypeError, "enable_gqa must be a bool"),
    ("ar", dict(return_stats=1), TypeError, "return_stats must be a bool"),
    ("a", dict(deterministic=0), TypeError, "deterministic must be a bool"),
    ("ar", dict(is_causal=None), TypeError, "is_causal must be a bool"),
    ("a", dict(backend="cuda"), ValueError, "backend must be one of"),
    ("t", dict(q=torch.zeros(2, 4, 9, 16, dtype=torch.float64), kv_dtype=torch.float64), TypeError,
     "the triton backend takes float16"),
    ("t", dict(q=torch.zeros(2, 4, 9, 8), k=torch.zeros(2, 4, 11, 8), v=torch.zeros(2, 4, 11, 8)), ValueError,
     r"head_dim in \[16, 256\]"),
    ("t", dict(v=torch.zeros(2, 4, 11, 8)), ValueError, r"the kernels take value head dims in \[16, 256\]"),
    ("ar", dict(cu_seqlens_q=_CU), ValueError, "must be given together"),
    ("ar", dict(cu_seqlens_q=_CU, cu_seqlens_k=_CU_K), ValueError, "batch size 1"),
    ("ar", dict(_VARLEN, cu_seqlens_q=torch.tensor([0.0, 9.0])), TypeError, "cu_seqlens_q must be a 1-d int32"),
    ("ar", dict(_VARLEN, cu_seqlens_k=_CU_K[None]), TypeError, "cu_seqlens_k must be a 1-d int32"),
    ("ar", dict(_VARLEN, cu_seqlens_q=_CU.to(_M)), ValueError, "cu_seqlens_q must be on the device of q"),
    ("ar", dict(_VARLEN, cu_seqlens_q=_CU[:1], cu_seqlens_k=_CU_K[:1]), ValueError, "at least two offsets"),
    ("ar", dict(_VARLEN, cu_seqlens_k=torch.tensor([0, 11], dtype=torch.int32)), ValueError,
     "same number of sequences"),
    ("ar", dict(_VARLEN, cu_seqlens_q=torch.tensor([0, 4, 8], dtype=torch.int32)), ValueError,
     "end at the packed length 9"),
    ("ar", dict(_VARLEN, cu_seqlens_q=torch.tensor([1, 4, 9], dtype=torch.int32)), ValueError, "start at 0"),
    ("ar", dict(_VARLEN, cu_seqlens_q=torch.tensor([0, 6, 4, 9], dtype=torch.int64),
                cu_seqlens_k=torch.tensor([0, 5, 5, 11], dtype=torch.int64)), ValueError, "non-decreasing"),
    ("ar", dict(max_seqlen_q=9), ValueError, "max_seqlen_q is only used with cu_seqlens"),
    ("ar", dict(_VARLEN, max_seqlen_k=5.0), TypeError, "max_seqlen_k must be None or an int"),
    ("ar", dict(_VARLEN, max_seqlen_q=-1), ValueError, "max_seqlen_q must be at least"),
    ("ar", dict(_VARLEN, max_seqlen_k=5), ValueError, r"max_seqlen_k must be at least the longest sequence \(6\)"),
    ("r", dict(compute_dtype=torch.float16), ValueError, "compute_dtype must be None, torch.float32"),
    ("r", dict(generator="seed"), TypeError, "generator must be a torch.Generator"),
    ("r", dict(return_weights=1), TypeError, "return_weights must be a bool"),
    ("r", dict(dropout_mask=torch.ones(9, 11)), TypeError, "dropout_mask must be a boolean tensor"),
    ("r", dict(dropout_mask=[[True]]), TypeError, "dropout_mask must be a torch.Tensor"),
    ("r", dict(dropout_mask=torch.ones(9, 12, dtype=torch.bool)), ValueError, "dropout_mask must be broadcastable"),
    ("r", dict(dropout_mask=torch.ones(9, 11, dtype=torch.bool, device=_M)), ValueError,
     "dropout_mask must be on the device"),
]
_ATTENTION_CALLS = {"a": ("auto", "reference", "triton"), "r": ("reference function",), "t": ("triton",)}
_ATTENTION_CASES = [(row, call) for row in range(len(ATTENTION_BAD)) for code in ATTENTION_BAD[row][0]
                    for call in _ATTENTION_CALLS[code]]


@pytest.mark.parametrize("row,call", _ATTENTION_CASES)
def test_attention_bad_arguments(row, call):
    """Every entry point and backend names the bad argument (inputs float32, head dim 16)."""
    _, kwargs, err, match = ATTENTION_BAD[row]
    kwargs = dict(kwargs)
    kv_heads, batch = kwargs.pop("kv_heads", 4), kwargs.pop("batch", 2)
    kv_dtype = kwargs.pop("kv_dtype", torch.float32)
    q, k, v = qkv(b=batch, hq=4, hk=kv_heads, d=16, dtype=torch.float32)
    args = [kwargs.pop(name, t) for name, t in (("q", q), ("k", k.to(kv_dtype)), ("v", v.to(kv_dtype)))]
    if call == "reference function":
        fn = entmax_attention_reference
    else:
        kwargs.setdefault("backend", call)
        fn = sa.entmax_attention
    with pytest.raises(err, match=match):
        fn(*args, **kwargs)


@pytest.mark.parametrize("call", ["auto", "reference", "reference function"])
@pytest.mark.parametrize("mask,err", [(torch.ones(9, 11, dtype=torch.bool).tril(), TypeError),
                                      (torch.zeros(1, 1, 9, 11), ValueError)])
def test_a_mask_passed_as_the_fourth_argument_says_so(call, mask, err):
    """SDPA's 4th positional argument is attn_mask, entmax_attention's alpha: a mask there gets an alpha error that
    names the position and where the mask goes."""
    q, k, v = qkv(b=2, hq=4, hk=4, d=16, dtype=torch.float32)
    fn = entmax_attention_reference if call == "reference function" else sa.entmax_attention
    kwargs = {} if call == "reference function" else {"backend": call}
    want = "a float or a floating-point tensor, got a tensor of dtype torch.bool" if mask.dtype == torch.bool else \
        "a float or a tensor of shape () or (4,) (one per head), got shape (1, 1, 9, 11)"
    want += ". alpha is the 4th positional argument, where scaled_dot_product_attention takes attn_mask: pass a mask"
    with pytest.raises(err, match=re.escape(f"alpha must be {want} as attn_mask=")):
        fn(q, k, v, mask, **kwargs)


E, H = 16, 4


def _two_attention_layers():
    return nn.Sequential(nn.MultiheadAttention(E, H), nn.MultiheadAttention(E, H))


class _SdpaBlock(nn.Module):
    """A module whose forward calls SDPA, as swap_sdpa_attention looks for."""

    num_heads = H

    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


# (callable name, arguments, error, message). "mha": sa.EntmaxMultiheadAttention(E, H, **kw);
# "forward": sa.EntmaxMultiheadAttention(E, H)(query, key, value, **kw) with (L, N, E) = (5, 2, 16) inputs;
# "alpha": sa.EntmaxAlpha(H, **kw); "swap": sa.swap_attention(**kw); "from_mha": from_mha(**kw);
# "sdpa_attach" / "sdpa_swap": attach_entmax_sdpa / swap_sdpa_attention on a small module; "sdpa_context": entering
# the entmax_sdpa(**kw) block.
MODULE_BAD = [
    ("mha", dict(alpha=0.5), ValueError, "alpha must be finite and in"),
    ("mha", dict(alpha=float("nan")), ValueError, "alpha must be finite and in"),
    ("mha", dict(alpha=torch.ones(3)), ValueError, "alpha must be a float or a tensor of shape"),
    ("mha", dict(alpha=torch.tensor([1.0, 1.5, 2.5, 1.0])), ValueError, "alpha must be finite and in"),
    ("mha", dict(alpha=torch.ones(H, dtype=torch.int64)), TypeError, "floating-point"),
    ("mha", dict(alpha="1.5"), TypeError, "alpha must be a float or a tensor, got str"),
    ("mha", dict(alpha=[1.5, 1.2, 1.3, 2.0]), TypeError,
     r"alpha must be a float or a tensor, got list; for one alpha per head pass a tensor of shape \(4,\)"),
    ("mha", dict(alpha=(1.5, 1.2), learnable=True), TypeError, "alpha must be a float or a tensor, got tuple"),
    pytest.param("mha", dict(device="cuda"), ValueError, "device='cuda', but CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available")),
    ("mha", dict(deterministic="no"), TypeError, "deterministic must be a bool"),
    ("mha", dict(learnable=True, alpha_init=1.0), ValueError, "strictly between"),
    ("mha", dict(learnable=True, alpha_init=torch.ones(2)), ValueError, "alpha_init must be a float or a tensor"),
    ("mha", dict(learnable=True, alpha_min=1.6, alpha_max=1.4), ValueError, "alpha_min must be < alpha_max"),
    ("mha", dict(learnable="yes"), TypeError, "learnable must be a bool"),
    ("mha", dict(learnable=True, learnable_alpha=True), TypeError, "got both learnable= and its deprecated alias"),
    ("mha", dict(alpha_max=2.5), ValueError, "alpha_max must be finite"),
    ("mha", dict(alpha_min=float("nan")), ValueError, "alpha_min must be finite"),
    ("mha", dict(backend="cuda"), ValueError, "backend must be one of"),
    ("mha", dict(dropout=1.0), ValueError, "dropout must be"),
    ("mha", dict(embed_dim=10), ValueError, "divisible"),
    ("mha", dict(embed_dim=0), ValueError, "embed_dim must be a positive int"),
    ("mha", dict(num_heads=2.0), ValueError, "num_heads must be a positive int"),
    ("mha", dict(kdim=-1), ValueError, "kdim must be a positive int"),
    ("mha", dict(vdim=0), ValueError, "vdim must be a positive int"),
    ("mha", dict(dtype=torch.int64), TypeError, "dtype must be"),
    ("mha", dict(batch_first=1), TypeError, "batch_first must be a bool"),
    ("mha", dict(bias="yes"), TypeError, "bias must be a bool"),
    ("mha", dict(add_bias_kv=2), TypeError, "add_bias_kv must be a bool"),
    ("mha", dict(add_zero_attn="no"), TypeError, "add_zero_attn must be a bool"),
    ("forward", dict(query=[1.0]), TypeError, "query must be a torch.Tensor"),
    ("forward", dict(key=torch.randn(5, 2, E, dtype=torch.float64).to(torch.int64)), TypeError,
     "key must be a floating-point tensor"),
    ("forward", dict(value=torch.randn(5, 2, E, device="meta")), ValueError, "value must be on the module's device"),
    ("forward", dict(query=torch.randn(5, 2, 8)), ValueError, "query must have 16 features"),
    ("forward", dict(key=torch.randn(5, E)), ValueError, "all be 3-D"),
    ("forward", dict(key=torch.randn(5, 3, E), value=torch.randn(5, 3, E)), ValueError, "same batch size"),
    ("forward", dict(value=torch.randn(6, 2, E)), ValueError, "key and value must agree"),
    ("forward", dict(key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)), ValueError,
     "key_padding_mask must have shape"),
    ("forward", dict(key_padding_mask=torch.zeros(2, 5, dtype=torch.int64)), TypeError,
     r"key_padding_mask must be boolean \(True = not allowed to attend\)"),
    ("forward", dict(key_padding_mask=[[True]]), TypeError, "key_padding_mask must be a torch.Tensor"),
    ("forward", dict(key_padding_mask=torch.zeros(2, 5, dtype=torch.bool, device="meta")), ValueError,
     "key_padding_mask must be on the device"),
    ("forward", dict(attn_mask=torch.zeros(4, 5, dtype=torch.bool)), ValueError, "attn_mask must have shape"),
    ("forward", dict(attn_mask=torch.zeros(2 * H, 5, 4)), ValueError, "attn_mask must have shape"),
    ("forward", dict(attn_mask=torch.zeros(5, 5, dtype=torch.int64)), TypeError, "attn_mask must be boolean"),
    ("forward", dict(attn_mask=torch.zeros(5, 5, device="meta")), ValueError, "attn_mask must be on the device"),
    ("forward", dict(is_causal=None), TypeError, "is_causal must be a bool"),
    ("forward", dict(is_causal="yes"), TypeError, "is_causal must be a bool"),
    ("forward", dict(need_weights="yes"), TypeError, "need_weights must be a bool"),
    ("forward", dict(average_attn_weights=None), TypeError, "average_attn_weights must be a bool"),
    ("alpha", dict(num_heads=0), ValueError, "num_heads must be a positive int"),
    ("alpha", dict(alpha=3.0), ValueError, "alpha must be finite and in"),
    ("alpha", dict(learnable=1), TypeError, "learnable must be a bool"),
    ("alpha", dict(learnable=False, learnable_alpha=False), TypeError, "got both"),
    ("alpha", dict(alpha=torch.ones(2, 2)), ValueError, "alpha must be a float or a tensor of shape"),
    ("alpha", dict(alpha_min=0.5), ValueError, r"alpha_min must be finite and in \[1, 2\]"),
    ("alpha", dict(alpha_max=math.nan), ValueError, r"alpha_max must be finite and in \[1, 2\]"),
    ("alpha", dict(learnable=True, alpha_init=2.0), ValueError, "strictly between"),
    ("alpha", dict(dtype=torch.int64), TypeError, "dtype must be"),
    ("alpha", dict(device="nodevice"), ValueError, "device"),
    pytest.param("alpha", dict(device="cuda:0"), ValueError, "device='cuda:0', but CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available")),
    ("swap", dict(model="model"), TypeError, "model must be an nn.Module"),
    ("swap", dict(model=nn.MultiheadAttention(E, H)), ValueError, "from_mha"),
    ("swap", dict(alpha=2.5), ValueError, "alpha must be finite and in"),
    ("swap", dict(learnable=True, learnable_alpha=True), TypeError, "got both"),
    ("swap", dict(learnable=None, alpha_max=3.0), ValueError, "alpha_max must be finite"),
    ("from_mha", dict(mha=nn.Linear(2, 2)), TypeError, "mha must be an nn.MultiheadAttention"),
    ("from_mha", dict(alpha=0.9), ValueError, "alpha must be finite and in"),
    ("sdpa_attach", dict(module="m"), TypeError, "module must be an nn.Module"),
    ("sdpa_attach", dict(num_heads=0), ValueError, "num_heads must be a positive int"),
    ("sdpa_attach", dict(num_heads=None), ValueError, "cannot tell the number of heads"),
    ("sdpa_attach", dict(backend="cuda"), ValueError, "backend must be one of"),
    ("sdpa_attach", dict(alpha=2.5), ValueError, "alpha must be finite and in"),
    ("sdpa_attach", dict(learnable="yes"), TypeError, "learnable must be a bool"),
    ("sdpa_swap", dict(model=3), TypeError, "model must be an nn.Module"),
    ("sdpa_swap", dict(modules=3), TypeError, "modules must be None, a class"),
    ("sdpa_swap", dict(alpha=0.5), ValueError, "alpha must be finite and in"),
    ("sdpa_context", dict(alpha="1.5"), TypeError, "alpha must be a float or a tensor"),
    ("sdpa_context", dict(alpha=torch.ones(2, 2)), ValueError, "alpha must be a float or a tensor of shape"),
    ("sdpa_context", dict(alpha=2.5), ValueError, r"alpha must be finite and in \[1, 2\]"),
    ("sdpa_context", dict(backend="fast"), ValueError, "backend must be one of"),
]


@pytest.mark.parametrize("kind,kwargs,err,match", MODULE_BAD)
def test_module_bad_arguments(kind, kwargs, err, match, kernel_device):
    kwargs = dict(kwargs)
    if kind == "mha":
        call = lambda: sa.EntmaxMultiheadAttention(kwargs.pop("embed_dim", E), kwargs.pop("num_heads", H), **kwargs)  # noqa: E731
    elif kind == "forward":
        ent, x = sa.EntmaxMultiheadAttention(E, H), torch.randn(5, 2, E)
        q, k, v = (kwargs.pop(name, x) for name in ("query", "key", "value"))
        call = lambda: ent(q, k, v, **kwargs)  # noqa: E731
    elif kind == "forward_triton":  # head dim 16, the fused path; its float-mask check names the argument
        ent = sa.EntmaxMultiheadAttention(32, 2, backend="triton", device=kernel_device)
        x = torch.randn(5, 2, 32, device=kernel_device)
        kwargs = {name: m.to(kernel_device) for name, m in kwargs.items()}
        call = lambda: ent(x, x, x, need_weights=False, **kwargs)  # noqa: E731
    elif kind == "alpha":
        call = lambda: sa.EntmaxAlpha(kwargs.pop("num_heads", H), **kwargs)  # noqa: E731
    elif kind == "swap":
        call = lambda: sa.swap_attention(kwargs.pop("model", _two_attention_layers()), **kwargs)  # noqa: E731
    elif kind == "sdpa_attach":
        module, heads = kwargs.pop("module", nn.Linear(4, 4)), kwargs.pop("num_heads", H)
        call = lambda: sa.attach_entmax_sdpa(module, num_heads=heads, **kwargs)  # noqa: E731
    elif kind == "sdpa_swap":
        call = lambda: sa.swap_sdpa_attention(kwargs.pop("model", _SdpaBlock()), **kwargs)  # noqa: E731
    elif kind == "sdpa_context":
        def call():
            with sa.entmax_sdpa(**kwargs):
                pass
    else:
        call = lambda: sa.EntmaxMultiheadAttention.from_mha(kwargs.pop("mha", nn.MultiheadAttention(E, H)), **kwargs)  # noqa: E731
    with pytest.raises(err, match=match):
        call()


# The public callable each kind of MODULE_BAD row calls.
MODULE_TARGETS = {"mha": sa.EntmaxMultiheadAttention, "forward": sa.EntmaxMultiheadAttention,
                  "forward_triton": sa.EntmaxMultiheadAttention, "alpha": sa.EntmaxAlpha, "swap": sa.swap_attention,
                  "from_mha": sa.EntmaxMultiheadAttention, "sdpa_attach": sa.attach_entmax_sdpa,
                  "sdpa_swap": sa.swap_sdpa_attention, "sdpa_context": sa.entmax_sdpa}
# Public names without bad-input rows, and why.
NO_BAD_INPUT_ROWS = {
    "checks_enabled": "takes no argument",
    "AttentionStats": "the statistics entmax_attention(return_stats=True) returns; never built by users",
    "BlockSparseMask": "a plain (mask, block_size) pair, checked where passed (block_mask= rows in ATTENTION_BAD)",
    "FertilityState": "the decoding state FertilityAttention returns; its users pass it back as state=, checked there",
}


def _values(row):
    """A table row's values, whether a plain tuple or a ``pytest.param``."""
    return row.values if isinstance(row, type(pytest.param())) else row


def _public_name(target):
    """The name in ``sparse_attn.__all__`` of a row's callable: itself, its class (a module instance) or the
    object a method is bound to (or that object's class)."""
    public = {id(getattr(sa, name)): name for name in sa.__all__}
    owner = getattr(target, "__self__", None)
    for obj in (target, type(target), owner, type(owner)):
        if id(obj) in public:
            return public[id(obj)]
    return None


def test_every_public_callable_has_bad_input_rows():
    """A public function or class without a row in one of the bad-argument tables fails here."""
    covered = {_public_name(_values(row)[0]) for row in BAD_INPUTS + _fertility_calls()}
    covered |= {_public_name(MODULE_TARGETS[_values(row)[0]]) for row in MODULE_BAD}
    if any(set(row[0]) & {"a", "t"} for row in ATTENTION_BAD):
        covered.add("entmax_attention")
    public = {name for name in sa.__all__ if callable(getattr(sa, name))}
    assert public - covered - set(NO_BAD_INPUT_ROWS) == set(), "public callables without a bad-input row"
    assert set(NO_BAD_INPUT_ROWS) <= public and not set(NO_BAD_INPUT_ROWS) & covered
    assert not inspect.signature(sa.checks_enabled).parameters
