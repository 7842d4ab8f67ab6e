"""Drop-in entmax multi-head attention and helpers to swap it into existing models.

:class:`EntmaxMultiheadAttention` has the constructor, parameters, state dict and forward of
:class:`torch.nn.MultiheadAttention`; only the attention weights change, from softmax to
alpha-entmax (``alpha = 1`` is softmax, ``alpha = 2`` sparsemax), with one alpha per head that
may be learned as in Correia, Niculae & Martins 2019, "Adaptively Sparse Transformers":
``alpha = alpha_min + (alpha_max - alpha_min) * sigmoid(alpha_logit)``.
:func:`swap_attention` replaces every ``nn.MultiheadAttention`` of a model in place.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sparse_attn._validation import check_bool, check_number
from sparse_attn.attn.attention import run_layer_attention
from sparse_attn.attn.attn_inputs import (
    KERNEL_DTYPES,
    MAX_HEAD_DIM,
    MIN_HEAD_DIM,
    prepare_attention,
)
from sparse_attn.attn.masks import (
    causal_keep,
    check_mask,
    combine_masks,
    from_mha_mask,
    key_padding_to_mask,
)
from sparse_attn.kernels._args import interpreting
from sparse_attn.models._head_alpha import EntmaxAlpha, _check_factory, _HeadAlphaMixin, resolve_learnable
from sparse_attn.models._sdpa_callers import sdpa_modules
from sparse_attn.models.stats import head_stats_sink, register_layer_type

__all__ = ["EntmaxAlpha", "EntmaxMultiheadAttention", "swap_attention"]

_MHA_KEEP = "True = not allowed to attend"


def _kernel_device(t: Tensor) -> bool:
    """Whether the fused kernels run natively on ``t``'s device (CUDA); tests replace it to simulate a GPU."""
    return t.is_cuda


def module_backend(backend: str, owner: str, *, need_weights: bool, recorder_weights: bool, on_cuda: bool,
                   device, dtype: torch.dtype, head_dim: int) -> tuple[str, str | None]:
    """The backend an attention module passes to :func:`~sparse_attn.attn.attn_inputs.prepare_attention` for one call.

    The weights (``need_weights=True``, or a :func:`sparse_attn.record_head_stats` recorder with
    ``diversity=True``) exist only on the materialized reference. ``backend="triton"`` never falls
    back: when the fused kernels cannot run the call (those weights; tensors off CUDA without
    ``TRITON_INTERPRET=1``; a dtype or head dim the kernels do not take) it raises ``ValueError``
    naming every reason. ``backend="auto"`` falls back to the reference; on CUDA, where it would
    otherwise pick the kernels, the second element is a message saying why (the module warns once).

    Args:
        backend: the module's ``"auto"``, ``"triton"`` or ``"reference"``.
        owner: the module's class name, for the messages.
        need_weights, recorder_weights: whether this call must return / report its weights.
        on_cuda: whether the tensors are on a device the fused kernels run on natively (CUDA).
        device, dtype, head_dim: of the projected queries.

    Returns:
        ``(backend, warning)``: ``"reference"`` when the weights are needed, else ``backend``;
        ``warning`` None or the text of the fallback warning.
    """
    if not isinstance(backend, str) or backend not in ("auto", "triton", "reference"):
        raise ValueError(f"{owner}.backend must be one of ('auto', 'triton', 'reference'), got {backend!r}")
    dense = need_weights or recorder_weights
    if backend == "reference":
        return backend, None
    reasons = []
    if need_weights:
        reasons.append("need_weights=True (the default, as in nn.MultiheadAttention) asks for the attention weights, "
                       "which only the materialized path computes: pass need_weights=False for the fused path")
    if recorder_weights:
        reasons.append("a record_head_stats(..., diversity=True) recorder needs the attention weights, which only "
                       "the materialized path computes: record with diversity=False")
    if backend == "triton" and not on_cuda and not interpreting():
        reasons.append(f"the tensors are on {device}: the fused kernels need CUDA tensors (or TRITON_INTERPRET=1 "
                       f"set before import, for testing)")
    if dtype not in KERNEL_DTYPES:
        reasons.append(f"the dtype is {dtype}: the fused kernels take float16, bfloat16 or float32")
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        reasons.append(f"head_dim (embed_dim // num_heads) is {head_dim}: the fused kernels take head dims in "
                       f"[{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
    if backend == "triton" and reasons:
        raise ValueError(
            f"{owner}(backend='triton') cannot run this call on the fused Triton kernels: {'; '.join(reasons)}. "
            f"backend='auto' runs such calls on the materialized reference (O(N^2) memory), as does "
            f"backend='reference'"
        )
    warning = None
    if backend == "auto" and on_cuda and reasons:
        warning = (f"{owner}(backend='auto') runs on the materialized reference (O(N^2) memory) instead of the fused "
                   f"Triton kernels on {device}: {'; '.join(reasons)}. (Said once per module.)")
    return ("reference" if dense else backend), warning


class EntmaxMultiheadAttention(_HeadAlphaMixin, nn.MultiheadAttention):
    """Multi-head attention with alpha-entmax weights, a drop-in for :class:`torch.nn.MultiheadAttention`.

    The constructor arguments up to ``dtype``, the parameter names (``in_proj_weight`` or
    ``q_proj_weight``/``k_proj_weight``/``v_proj_weight`` when ``kdim``/``vdim`` differ,
    ``in_proj_bias``, ``out_proj``, ``bias_k``, ``bias_v``) and the forward signature and mask
    conventions are those of ``nn.MultiheadAttention``, so ``load_state_dict(mha.state_dict())``
    works as is (a learnable alpha keeps its current value when the state dict has none).
    It is an ``nn.MultiheadAttention`` subclass so that code checking ``isinstance`` (e.g.
    ``nn.TransformerEncoderLayer``) accepts it; PyTorch's fused softmax fast paths are always
    declined (``_qkv_same_embed_dim`` reads False), so every call goes through this module.

    Args:
        embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first,
            device, dtype: as ``nn.MultiheadAttention`` (``dropout`` applies to the attention
            weights after the entmax, in training mode).
        alpha: float in [1, 2] or a tensor of shape ``(num_heads,)``: the fixed alpha of each head
            (1 = softmax, 1.5 = 1.5-entmax, 2 = sparsemax). Default 1.5.
        learnable: learn one alpha per head through the parameter ``alpha_logit``
            ``(num_heads,)``, ``alpha = alpha_min + (alpha_max - alpha_min) * sigmoid(alpha_logit)``.
            Default False. ``learnable_alpha`` is a deprecated alias (``DeprecationWarning``;
            passing both is a ``TypeError``); the property ``.learnable_alpha`` stays.
        alpha_min, alpha_max: range of a learnable alpha, ``1 <= alpha_min < alpha_max <= 2``.
            Default (1, 2) as in the adaptively sparse Transformer.
        alpha_init: initial learnable alpha (float or ``(num_heads,)`` tensor strictly inside
            ``(alpha_min, alpha_max)``); default ``alpha``.
        backend: ``"auto"``, ``"triton"`` or ``"reference"``, passed to
            :func:`sparse_attn.entmax_attention`. Default ``"auto"``. The fused kernels run only calls
            with ``need_weights=False`` (the weights exist only on the materialized reference).
            ``"triton"`` never falls back: a call it cannot run (``need_weights=True``, a
            ``record_head_stats(diversity=True)`` recorder, CPU tensors without ``TRITON_INTERPRET=1``,
            a dtype other than float16/bfloat16/float32) raises ``ValueError`` naming the reasons,
            and so does the constructor for a head dim outside [16, 256]. ``"auto"`` runs such calls on
            the reference; on CUDA, where it would otherwise use the kernels, it says so with a
            ``UserWarning``, once per module.
        deterministic: True (default): bitwise reproducible gradients. False lets the fused backward accumulate the
            query gradient with atomics (faster, reproducible to float32 rounding only), as
            :func:`sparse_attn.entmax_attention`'s ``deterministic``.

    Forward: ``(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False) -> (out, weights or None)`` with the shapes of
    ``nn.MultiheadAttention``: query ``(L, N, E)`` (``(N, L, E)`` if ``batch_first``, ``(L, E)``
    unbatched), key ``(S, N, kdim)``, value ``(S, N, vdim)``; boolean masks are True where
    attention is NOT allowed, float masks are added to the scores; ``key_padding_mask`` ``(N, S)``;
    ``attn_mask`` ``(L, S)`` or ``(N * num_heads, L, S)``. ``is_causal`` is a hint that
    ``attn_mask`` is the causal mask; without ``attn_mask`` it applies the causal mask
    ``j <= i``. ``need_weights=True`` (the default, as in ``nn.MultiheadAttention``) computes the
    attention densely on the materialized reference (O(L * S) memory) and returns the (sparse)
    weights ``(N, L, S)`` averaged over heads, or ``(N, num_heads, L, S)``; pass
    ``need_weights=False`` for the fused Triton kernels (the fast path on CUDA). Unlike softmax, a
    query with no key to attend to gives zeros instead of NaN.
    """

    _head_stats_sink = None
    _fallback_warned = False  # set on the instance by its first backend='auto' fallback warning

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
        *,
        alpha: float | Tensor = 1.5,
        learnable: bool | None = None,
        alpha_min: float = 1.0,
        alpha_max: float = 2.0,
        alpha_init: float | Tensor | None = None,
        backend: str = "auto",
        learnable_alpha: bool | None = None,
        deterministic: bool = True,
    ) -> None:
        nn.Module.__init__(self)
        for name, flag in (("bias", bias), ("add_bias_kv", add_bias_kv), ("add_zero_attn", add_zero_attn),
                           ("batch_first", batch_first), ("deterministic", deterministic)):
            check_bool(name, flag)
        _check_factory(device, dtype)
        for name, val in (("embed_dim", embed_dim), ("num_heads", num_heads), ("kdim", kdim), ("vdim", vdim)):
            if val is None and name in ("kdim", "vdim"):
                continue
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        check_number("dropout", dropout, 0.0, 1.0, high_open=True)
        if backend not in ("auto", "triton", "reference"):
            raise ValueError(f"backend must be one of ('auto', 'triton', 'reference'), got {backend!r}")
        if backend == "triton" and not MIN_HEAD_DIM <= embed_dim // num_heads <= MAX_HEAD_DIM:
            raise ValueError(
                f"backend='triton' needs head_dim = embed_dim // num_heads in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}] (the "
                f"fused kernels' range), got {embed_dim} // {num_heads} = {embed_dim // num_heads}; use backend='auto' "
                f"or 'reference' (the materialized reference)"
            )
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._packed_in_proj = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = float(dropout)
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        self.add_zero_attn = add_zero_attn
        self.backend = backend
        self.deterministic = deterministic
        if self._packed_in_proj:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
            for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                self.register_parameter(name, None)
        else:
            self.register_parameter("in_proj_weight", None)
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **factory))
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
        else:
            self.bias_k = self.bias_v = None
        learnable = resolve_learnable(learnable, learnable_alpha, default=False)
        self._init_alpha(alpha, learnable, alpha_min, alpha_max, alpha_init, device, dtype)
        self._reset_parameters()

    @property
    def _qkv_same_embed_dim(self) -> bool:
        """Always False, so that PyTorch's fused softmax fast paths never bypass this module."""
        return False

    def _reset_parameters(self) -> None:
        if self._packed_in_proj:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            for w in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                nn.init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, alpha={self._alpha_repr()}, "
                f"dropout={self.dropout}, batch_first={self.batch_first}")

    @classmethod
    def from_mha(cls, mha: nn.MultiheadAttention, **kwargs) -> EntmaxMultiheadAttention:
        """A new module with the configuration, a copy of the weights (and their ``requires_grad``) of ``mha``.

        Args:
            mha: the ``nn.MultiheadAttention`` to copy (kept unchanged).
            **kwargs: keyword-only arguments of the constructor (``alpha``, ``learnable``,
                ``alpha_min``, ``alpha_max``, ``alpha_init``, ``backend``).
        """
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(f"mha must be an nn.MultiheadAttention, got {type(mha).__name__}")
        ref = mha.out_proj.weight
        new = cls(
            mha.embed_dim, mha.num_heads, dropout=mha.dropout, bias=mha.in_proj_bias is not None,
            add_bias_kv=mha.bias_k is not None, add_zero_attn=mha.add_zero_attn, kdim=mha.kdim, vdim=mha.vdim,
            batch_first=mha.batch_first, device=ref.device, dtype=ref.dtype, **kwargs,
        )
        new.load_state_dict(mha.state_dict(), strict=not isinstance(mha, EntmaxMultiheadAttention))
        new_params = dict(new.named_parameters())
        for name, p in mha.named_parameters():
            if name in new_params:
                new_params[name].requires_grad_(p.requires_grad)
        new.train(mha.training)
        return new

    def _project(self, query: Tensor, key: Tensor, value: Tensor, self_attn: bool):
        """Input projections of (N, L, E), (N, S, kdim), (N, S, vdim) to (N, L|S, E) each."""
        b = self.in_proj_bias
        bq, bk, bv = b.chunk(3) if b is not None else (None, None, None)
        if not self._packed_in_proj:
            return (F.linear(query, self.q_proj_weight, bq), F.linear(key, self.k_proj_weight, bk),
                    F.linear(value, self.v_proj_weight, bv))
        if self_attn:
            return F.linear(query, self.in_proj_weight, b).chunk(3, dim=-1)
        wq, wk, wv = self.in_proj_weight.chunk(3)
        return F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)

    def _check_inputs(self, query, key, value):
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.is_nested:
                raise ValueError(
                    f"{name} is a nested tensor; EntmaxMultiheadAttention takes padded tensors and key_padding_mask"
                )
            if not t.is_floating_point():
                raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(
                "query, key and value must all be 3-D (batched) or all 2-D (unbatched), got shapes "
                f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        for name, t, dim in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            if t.shape[-1] != dim:
                raise ValueError(f"{name} must have {dim} features in its last dimension, got shape {tuple(t.shape)}")
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(
                f"key and value must agree in sequence and batch sizes, got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        device = self.out_proj.weight.device
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.device != device:
                raise ValueError(f"{name} must be on the module's device ({device}), got {t.device}")

    def _masks(self, attn_mask, key_padding_mask, n: int, l_q: int, s: int, n_extra: int, device):
        """Merge MHA-convention masks into one keep/bias mask broadcastable to (N, H, L, S + n_extra)."""
        check_mask("attn_mask", attn_mask, device, keep_means=_MHA_KEEP)
        check_mask("key_padding_mask", key_padding_mask, device, keep_means=_MHA_KEEP)
        kpm = am = None
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (n, s):
                raise ValueError(
                    f"key_padding_mask must have shape (batch, src_len) = {(n, s)}, got {tuple(key_padding_mask.shape)}"
                )
            kpm = key_padding_to_mask(key_padding_mask, n_extra)
        if attn_mask is not None:
            if attn_mask.dim() == 2 and tuple(attn_mask.shape) == (l_q, s):
                am = from_mha_mask(attn_mask, n_extra)[None, None]
            elif attn_mask.dim() == 3 and tuple(attn_mask.shape) == (n * self.num_heads, l_q, s):
                am = from_mha_mask(attn_mask, n_extra).reshape(n, self.num_heads, l_q, s + n_extra)
            else:
                raise ValueError(
                    f"attn_mask must have shape (tgt_len, src_len) = {(l_q, s)} or (batch * num_heads, tgt_len, "
                    f"src_len) = {(n * self.num_heads, l_q, s)}, got {tuple(attn_mask.shape)}"
                )
        return combine_masks(am, kpm)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend; arguments, shapes and mask conventions as :meth:`torch.nn.MultiheadAttention.forward`.

        Returns ``(out, weights)``: ``out`` shaped like ``query`` (with ``embed_dim`` features);
        ``weights`` ``(N, L, S)`` (or ``(N, num_heads, L, S)`` when ``average_attn_weights`` is
        False; without the batch dimension for unbatched input) when ``need_weights``, else None.
        A NaN or ``+inf`` in a float mask makes its rows NaN (the non-finite policy, every path).
        """
        for name, flag in (("need_weights", need_weights), ("average_attn_weights", average_attn_weights),
                           ("is_causal", is_causal)):
            check_bool(name, flag)
        self._check_inputs(query, key, value)
        self_attn = query is key and key is value
        batched = query.dim() == 3
        if not batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if isinstance(key_padding_mask, Tensor) and key_padding_mask.dim() == 1:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        n, l_q, s = query.shape[0], query.shape[1], key.shape[1]
        if key.shape[0] != n:
            raise ValueError(f"query and key must have the same batch size, got {n} and {key.shape[0]}")
        q, k, v = self._project(query, key, value, self_attn)
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.to(k.dtype).expand(n, 1, self.embed_dim)], dim=1)
            v = torch.cat([v, self.bias_v.to(v.dtype).expand(n, 1, self.embed_dim)], dim=1)
        heads = (self.num_heads, self.head_dim)
        q, k, v = (t.unflatten(-1, heads).transpose(1, 2) for t in (q, k, v))
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(n, self.num_heads, 1, self.head_dim)], dim=2)
            v = torch.cat([v, v.new_zeros(n, self.num_heads, 1, self.head_dim)], dim=2)
        n_extra = int(self.bias_k is not None) + int(self.add_zero_attn)

        sink = head_stats_sink(self)
        recorder_weights = sink is not None and sink.wants_weights
        dense = need_weights or recorder_weights
        backend, fallback = module_backend(
            self.backend, type(self).__name__, need_weights=need_weights, recorder_weights=recorder_weights,
            on_cuda=_kernel_device(q), device=q.device, dtype=q.dtype, head_dim=self.head_dim,
        )
        if fallback is not None and not self._fallback_warned:
            self._fallback_warned = True
            warnings.warn(fallback, UserWarning, stacklevel=2)
        causal = is_causal and n_extra == 0 and l_q == s
        if causal:
            attn_mask = None
        elif is_causal and attn_mask is None:
            attn_mask = ~causal_keep(l_q, s, q.device, bottom_right=False)
        mask = self._masks(attn_mask, key_padding_mask, n, l_q, s, n_extra, query.device)
        inputs = prepare_attention(
            q, k, v, self._alpha_arg(), attn_mask=mask, is_causal=causal,
            dropout_p=self.dropout if self.training else 0.0, backend=backend, alpha_in_range=True,
            deterministic=self.deterministic,
        )

        out, weights = run_layer_attention(inputs, dense, sink)
        out = self.out_proj(out.transpose(1, 2).reshape(n, l_q, self.embed_dim))
        if not batched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        if average_attn_weights:
            weights = weights.mean(dim=1)
        return out, weights.squeeze(0) if not batched else weights


def swap_attention(model: nn.Module, alpha: float | Tensor = 1.5, learnable: bool | None = None,
                   **kw) -> list[tuple[str, nn.MultiheadAttention]]:
    """Replace every ``nn.MultiheadAttention`` inside ``model`` by an :class:`EntmaxMultiheadAttention`, in place.

    Weights, configuration and train/eval mode are kept. A module shared by several parents is
    replaced by one shared new module. ``nn.TransformerEncoder`` instances get
    ``use_nested_tensor = False`` (their nested-tensor fast path would bypass the new modules).

    Args:
        model: any ``nn.Module`` (not itself an ``nn.MultiheadAttention``: use
            :meth:`EntmaxMultiheadAttention.from_mha` for that).
        alpha: fixed alpha (float or ``(num_heads,)`` tensor), or the initial alpha when
            ``learnable``. Default 1.5.
        learnable: learn one alpha per head (``alpha_logit`` parameters). Default False.
        **kw: other keyword-only arguments of :class:`EntmaxMultiheadAttention`
            (``alpha_min``, ``alpha_max``, ``alpha_init``, ``backend``; ``learnable_alpha`` is a
            deprecated alias of ``learnable``).

    Returns:
        ``[(qualified_name, replaced_module), ...]`` in model order (one entry per replaced module). When
        nothing was replaced a ``UserWarning`` says so (and names the modules that call
        ``scaled_dot_product_attention`` directly, which :func:`sparse_attn.sdpa.swap_sdpa_attention` handles).
    """
    learnable = resolve_learnable(learnable, kw.pop("learnable_alpha", None), default=False)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.MultiheadAttention):
        raise ValueError(
            "model is itself an nn.MultiheadAttention; use EntmaxMultiheadAttention.from_mha(model) instead"
        )
    targets = []
    for parent_name, parent in model.named_modules(remove_duplicate=False):
        for child_name, child in parent.named_children():
            if isinstance(child, nn.MultiheadAttention) and not isinstance(child, EntmaxMultiheadAttention):
                full_name = f"{parent_name}.{child_name}" if parent_name else child_name
                targets.append((parent, child_name, full_name, child))
    new_of: dict[int, EntmaxMultiheadAttention] = {}
    replaced = []
    for parent, child_name, full_name, child in targets:
        if id(child) not in new_of:
            new_of[id(child)] = EntmaxMultiheadAttention.from_mha(child, alpha=alpha, learnable=learnable, **kw)
            replaced.append((full_name, child))
        setattr(parent, child_name, new_of[id(child)])
    if replaced:
        for m in model.modules():
            if isinstance(m, nn.TransformerEncoder):
                m.use_nested_tensor = False
    else:
        _warn_nothing_swapped(model)
    return replaced


def _warn_nothing_swapped(model: nn.Module) -> None:
    done = sum(isinstance(m, EntmaxMultiheadAttention) for m in model.modules())
    sdpa = [name or "(the model)" for name, _ in sdpa_modules(model)]
    hint = (f"; {len(sdpa)} module(s) call torch.nn.functional.scaled_dot_product_attention directly "
            f"(e.g. {sdpa[0]!r}): use sparse_attn.sdpa.swap_sdpa_attention(model) for those" if sdpa else
            "; for modules that call torch.nn.functional.scaled_dot_product_attention use "
            "sparse_attn.sdpa.swap_sdpa_attention, for Hugging Face models attn_implementation='entmax'")
    warnings.warn(
        f"swap_attention replaced nothing: {type(model).__name__} has no nn.MultiheadAttention left to replace "
        f"({done} EntmaxMultiheadAttention already){hint}",
        UserWarning, stacklevel=3,
    )


register_layer_type(lambda m: isinstance(m, EntmaxMultiheadAttention), lambda m: m.alpha)
