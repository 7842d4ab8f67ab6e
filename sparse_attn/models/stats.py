"""Per-head attention statistics: density, alpha and Jensen-Shannon head diversity.

``with record_head_stats(model) as rec: model(x)`` makes every entmax attention layer of
``model`` (:class:`sparse_attn.modules.EntmaxMultiheadAttention`, and the attention modules of
a Hugging Face model running ``attn_implementation="entmax"`` of
:mod:`sparse_attn.integrations.hf`, with or without attached alphas) report, on each call, the
per-row support size and number of valid keys computed by the attention itself (the weights are
not materialized). The recorder accumulates, per layer and head:

* density: mean over query rows with at least one valid key of ``nnz / n_valid``, the fraction
  of the keys a query may attend to that receive a nonzero weight (1 for softmax);
* alpha: the head's alpha at the last recorded call;
* with ``diversity=True``, the Jensen-Shannon head diversity of Correia, Niculae & Martins 2019,
  "Adaptively Sparse Transformers" (eq. 11),
  ``JS = H(mean_h p_h) - mean_h H(p_h)``, Shannon entropies in base ``n`` (the number of valid
  keys of the row, so ``0 <= JS <= 1``), averaged over the query rows with ``n >= 2``. This
  needs the weights, so those calls take the dense (materialized) path.

``query_mask`` (or :meth:`HeadStatsRecorder.set_query_mask`) leaves padded query rows out of both: a
right-padded batch's padding tokens still attend to the real keys, so without it they count as
rows. (Left padding under a causal mask needs nothing: such rows have no valid key.)

With ``history=True`` the recorder also keeps each call's per-head density
(:meth:`HeadStatsRecorder.density_history`): during ``generate()`` one call per layer and step,
so a generation loop gets the head densities of every generated token (on CUDA the decoding steps
run the split-K decode kernels, whose per-row statistics cost nothing extra; docs/decode.md).

The recorder attaches a :class:`HeadStatsSink` to each layer (the instance attribute
``_head_stats_sink``, read by the layer through :func:`head_stats_sink`, removed on exit); the
recorder's state is not global. Which modules are entmax attention layers is told by
:func:`register_layer_type`, called by :mod:`sparse_attn.modules` and
:mod:`sparse_attn.integrations.hf` when they are imported. Accumulators stay on the device
until read. Recording also works in code compiled with ``torch.compile(fullgraph=True)``: the
callback is traced (entering or leaving a recorder triggers a recompilation). Under activation checkpointing
(``torch.utils.checkpoint``) the forward the backward recomputes is not recorded again: one call per forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor, nn

__all__ = ["HeadStatsRecorder", "HeadStatsSink", "head_stats_sink", "record_head_stats", "register_layer_type"]

_SINK_ATTRIBUTE = "_head_stats_sink"
_LAYER_TYPES: list[tuple[Callable[[nn.Module], bool], Callable[[nn.Module], Tensor]]] = []


class HeadStatsSink(Protocol):
    """What a recorded attention layer reports to, once per forward call.

    Attributes:
        wants_weights: when True the layer computes its weights densely and passes them.

    Call: ``sink(nnz, n_valid, alpha, weights)`` with ``nnz``, ``n_valid`` the per-row support
    size and number of valid keys ``(B, H, Nq)`` (ints), ``alpha`` the heads' alpha ``(H,)`` and
    ``weights`` the attention weights ``(B, H, Nq, Nk)`` before dropout, or None.
    """

    wants_weights: bool

    def __call__(self, nnz: Tensor, n_valid: Tensor, alpha: Tensor, weights: Tensor | None) -> None: ...


def head_stats_sink(module: nn.Module) -> HeadStatsSink | None:
    """The sink a recorder attached to ``module``, or None when it is not being recorded."""
    return getattr(module, _SINK_ATTRIBUTE, None)


def register_layer_type(is_layer: Callable[[nn.Module], bool], head_alpha: Callable[[nn.Module], Tensor]) -> None:
    """Make the recorder record another kind of entmax attention layer.

    Such a layer calls :func:`head_stats_sink` on itself in its forward and, when it gets a sink,
    reports every call to it (see :class:`HeadStatsSink`).

    Args:
        is_layer: ``is_layer(module)`` is True for the modules to record.
        head_alpha: ``head_alpha(module)``: the current alpha of each head, ``(num_heads,)``.
    """
    if not callable(is_layer) or not callable(head_alpha):
        raise TypeError(f"is_layer and head_alpha must be callables, got {type(is_layer).__name__} "
                        f"and {type(head_alpha).__name__}")
    if (is_layer, head_alpha) not in _LAYER_TYPES:
        _LAYER_TYPES.append((is_layer, head_alpha))


def _layer_alpha_fn(module: nn.Module):
    return next((alpha_fn for is_layer, alpha_fn in _LAYER_TYPES if is_layer(module)), None)


def _is_recordable(module: nn.Module) -> bool:
    return _layer_alpha_fn(module) is not None


def _current_alpha(module: nn.Module) -> Tensor:
    """alpha ``(num_heads,)`` of a recordable layer, detached."""
    return _layer_alpha_fn(module)(module).detach().reshape(-1)


def _entropy(p: Tensor) -> Tensor:
    """Shannon entropy (natural log) along the last dimension, with 0 log 0 = 0."""
    return -torch.special.xlogy(p, p).sum(-1)


def js_head_diversity(p: Tensor, n_valid: Tensor) -> tuple[Tensor, Tensor]:
    """Sum over rows of the Jensen-Shannon head diversity (eq. 11) and the number of rows counted.

    Args:
        p: attention weights ``(B, H, Nq, Nk)``, rows summing to 1 (or 0 for empty rows).
        n_valid: ``(B, H, Nq)`` number of keys each row may attend to.

    Returns:
        ``(js_sum, count)`` float64 scalars; rows whose largest ``n_valid`` over heads is < 2
        are left out (their entropy base is undefined).
    """
    p = p.detach().to(torch.float64)
    n = n_valid.amax(dim=1).to(torch.float64)
    js = _entropy(p.mean(dim=1)) - _entropy(p).mean(dim=1)
    rows = n >= 2
    js = torch.where(rows, js / torch.log(n.clamp_min(2)), torch.zeros_like(js))
    return js.sum(), rows.sum().to(torch.float64)


def _check_query_mask(query_mask) -> Tensor | None:
    if query_mask is None:
        return None
    if not isinstance(query_mask, Tensor):
        raise TypeError(f"query_mask must be None or a tensor, got {type(query_mask).__name__}")
    if query_mask.dtype != torch.bool and (query_mask.is_floating_point() or query_mask.is_complex()):
        raise TypeError(f"query_mask must be a boolean or integer (0/1, e.g. a tokenizer's attention_mask) tensor, "
                        f"got {query_mask.dtype}")
    if query_mask.dim() != 2:
        raise ValueError(f"query_mask must have shape (batch, query length), got {tuple(query_mask.shape)}")
    return query_mask.detach() != 0


def _query_rows(query_mask: Tensor, n_valid: Tensor) -> Tensor:
    """The ``(B, 1, Nq)`` rows a ``(B, Nq)`` query mask keeps, on ``n_valid``'s device."""
    if tuple(query_mask.shape) != (n_valid.shape[0], n_valid.shape[-1]):
        raise ValueError(f"query_mask has shape {tuple(query_mask.shape)} but a recorded layer got "
                         f"{(n_valid.shape[0], n_valid.shape[-1])} (batch, query rows): set one that matches every "
                         "recorded call (set_query_mask before each call, or None)")
    return query_mask.to(n_valid.device)[:, None, :]


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a private torch function: without it, a
    recomputed forward is recorded again rather than the call failing)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


class _LayerSink:
    """Accumulator one layer reports to (called by the layer's forward)."""

    def __init__(self, wants_weights: bool, history: bool = False):
        self.wants_weights = wants_weights
        self.history = history
        self.query_mask = None
        self.reset()

    def reset(self) -> None:
        self.density_sum = None
        self.rows = None
        self.alpha = None
        self.js_sum = None
        self.js_rows = None
        self.calls = 0
        self.steps = []

    def __call__(self, nnz: Tensor, n_valid: Tensor, alpha: Tensor, weights: Tensor | None) -> None:
        if not torch.compiler.is_compiling() and _in_backward():
            return  # a forward recomputed in the backward (activation checkpointing): its call was counted already
        with torch.no_grad():
            valid = n_valid > 0
            if self.query_mask is not None:
                valid = valid & _query_rows(self.query_mask, n_valid)
                n_valid = torch.where(valid, n_valid, 0)
            frac = torch.where(valid, nnz.to(torch.float64) / n_valid.clamp_min(1).to(torch.float64), 0.0)
            dims = [d for d in range(frac.dim()) if d != 1]
            dens, cnt = frac.sum(dims), valid.sum(dims).to(torch.float64)
            self.density_sum = dens if self.density_sum is None else self.density_sum + dens
            self.rows = cnt if self.rows is None else self.rows + cnt
            if self.history:
                self.steps.append(torch.where(cnt > 0, dens / cnt.clamp_min(1), math.nan))
            self.alpha = alpha.detach().reshape(-1).expand(frac.shape[1])
            if self.wants_weights and weights is not None:
                js, rows = js_head_diversity(weights, n_valid)
                self.js_sum = js if self.js_sum is None else self.js_sum + js
                self.js_rows = rows if self.js_rows is None else self.js_rows + rows
            self.calls += 1


class HeadStatsRecorder:
    """Context manager recording per-head attention statistics of a model (see module docstring).

    Args:
        model: the model; every entmax attention layer inside it is recorded.
        diversity: also record the Jensen-Shannon head diversity (dense weights on those calls).
            Default False.
        history: also keep each call's per-head density (:meth:`density_history`). Default False.
        query_mask: boolean or 0/1 integer ``(B, Nq)``, False / 0 for padded query rows, which are then left
            out of the densities and the diversity (e.g. a tokenizer's ``attention_mask`` for a right-padded
            batch). Every recorded call must have ``B`` batch entries and ``Nq`` query rows (else ``ValueError``);
            change it between calls with :meth:`set_query_mask`. Default None (every row with a valid key).

    Attributes:
        layer_names: qualified names of the recorded layers, in model order.
    """

    def __init__(self, model: nn.Module, diversity: bool = False, history: bool = False, query_mask=None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(diversity, bool):
            raise TypeError(f"diversity must be a bool, got {type(diversity).__name__}")
        if not isinstance(history, bool):
            raise TypeError(f"history must be a bool, got {type(history).__name__}")
        self.model = model
        self.with_diversity = diversity
        self._layers = [(name, m) for name, m in model.named_modules() if _is_recordable(m)]
        if not self._layers:
            raise ValueError(
                f"{type(model).__name__} contains no entmax attention layer to record: replace its "
                "nn.MultiheadAttention layers with sparse_attn.swap_attention(model), or for a Hugging Face model "
                "import sparse_attn.integrations.hf and load or build it with attn_implementation='entmax' "
                "(or call model.set_attn_implementation('entmax'))"
            )
        self.layer_names = [name for name, _ in self._layers]
        self._sinks = [_LayerSink(diversity, history) for _ in self._layers]
        self.set_query_mask(query_mask)
        self._active = False

    def set_query_mask(self, query_mask) -> None:
        """Count only the query rows ``query_mask`` keeps in the calls recorded from now on (see the class)."""
        query_mask = _check_query_mask(query_mask)
        for sink in self._sinks:
            sink.query_mask = query_mask

    def __enter__(self) -> HeadStatsRecorder:
        if self._active:
            raise RuntimeError("this HeadStatsRecorder is already active")
        for name, m in self._layers:
            if m.__dict__.get(_SINK_ATTRIBUTE) is not None:
                raise RuntimeError(f"layer {name!r} is already being recorded by another HeadStatsRecorder")
        for (_, m), sink in zip(self._layers, self._sinks):
            setattr(m, _SINK_ATTRIBUTE, sink)
        self._active = True
        return self

    def __exit__(self, *exc) -> None:
        for _, m in self._layers:
            m.__dict__.pop(_SINK_ATTRIBUTE, None)
        self._active = False

    def reset(self) -> None:
        """Forget everything recorded so far."""
        for sink in self._sinks:
            sink.reset()

    def _n_heads(self) -> int:
        return max(self._heads_of(i) for i in range(len(self._layers)))

    def _heads_of(self, i: int) -> int:
        sink, (_, m) = self._sinks[i], self._layers[i]
        if sink.rows is not None:
            return sink.rows.numel()
        return int(_current_alpha(m).numel())

    def density(self) -> Tensor:
        """Mean density per layer and head, float64 ``(n_layers, n_heads)``; NaN where nothing was recorded."""
        out = torch.full((len(self._layers), self._n_heads()), math.nan, dtype=torch.float64)
        for i, sink in enumerate(self._sinks):
            if sink.rows is not None:
                d = sink.density_sum.cpu() / sink.rows.cpu()
                out[i, : d.numel()] = torch.where(sink.rows.cpu() > 0, d, math.nan)
        return out

    def density_history(self) -> Tensor:
        """Density per call, layer and head, float64 ``(n_calls, n_layers, n_heads)``.

        Entry ``[c, i, h]`` is head ``h``'s mean density over the rows of layer ``i``'s ``c``-th recorded call (with
        ``generate()``: call 0 the prompt, call ``c`` the step whose query is the ``c``-th generated token); NaN where
        a layer made fewer calls or a call had no row with a valid key. Needs ``record_head_stats(model,
        history=True)``."""
        if not any(sink.history for sink in self._sinks):
            raise RuntimeError("the density per call was not recorded: use record_head_stats(model, history=True)")
        n_calls = max(len(sink.steps) for sink in self._sinks)
        out = torch.full((n_calls, len(self._layers), self._n_heads()), math.nan, dtype=torch.float64)
        for i, sink in enumerate(self._sinks):
            for c, dens in enumerate(sink.steps):
                out[c, i, : dens.numel()] = dens.cpu()
        return out

    def alphas(self) -> Tensor:
        """alpha per layer and head at the last recorded call (the current alpha if none).

        Returns a float64 ``(n_layers, n_heads)`` tensor.
        """
        out = torch.full((len(self._layers), self._n_heads()), math.nan, dtype=torch.float64)
        for i, (sink, (_, m)) in enumerate(zip(self._sinks, self._layers)):
            a = sink.alpha if sink.alpha is not None else _current_alpha(m)
            a = a.detach().to("cpu", torch.float64)
            out[i, : a.numel()] = a
        return out

    def diversity(self) -> dict[str, float]:
        """Jensen-Shannon head diversity per layer name (NaN for a layer with no eligible row)."""
        if not self.with_diversity:
            raise RuntimeError("head diversity was not recorded: use record_head_stats(model, diversity=True)")
        out = {}
        for name, sink in zip(self.layer_names, self._sinks):
            if sink.js_rows is None or float(sink.js_rows) == 0:
                out[name] = math.nan
            else:
                out[name] = float(sink.js_sum / sink.js_rows)
        return out

    def rows(self) -> list[dict]:
        """One dict per layer and head: ``{"layer", "head", "alpha", "density"}`` (floats)."""
        dens, alph = self.density(), self.alphas()
        out = []
        for i, name in enumerate(self.layer_names):
            for h in range(self._heads_of(i)):
                out.append({"layer": name, "head": h, "alpha": float(alph[i, h]), "density": float(dens[i, h])})
        return out

    def table(self) -> str:
        """The statistics as a plain-text table (one line per layer and head)."""
        rows = self.rows()
        div = self.diversity() if self.with_diversity else None
        width = max([len("layer")] + [len(r["layer"]) for r in rows])
        header = f"{'layer':<{width}}  head   alpha  density" + ("  diversity" if div is not None else "")
        lines = [header, "-" * len(header)]
        for r in rows:
            line = f"{r['layer']:<{width}}  {r['head']:>4}  {r['alpha']:6.3f}  {r['density']:7.3f}"
            if div is not None:
                line += f"  {div[r['layer']]:9.3f}" if r["head"] == 0 else ""
            lines.append(line)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def plot(self, path=None, ax=None):
        """Heat map of the density per layer (rows) and head (columns), each cell labelled with its alpha.

        Args:
            path: if given, save the figure there. Default None.
            ax: a matplotlib ``Axes`` to draw into; a new figure when None.

        Returns:
            The matplotlib ``Figure``. Needs matplotlib (``pip install sparse_attn[plot]``).
        """
        try:
            import matplotlib
            if ax is None and path is not None:
                matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError as exc:
            raise ImportError(
                "HeadStatsRecorder.plot needs matplotlib: pip install 'sparse_attn[plot]' (or matplotlib)"
            ) from exc
        dens, alph = self.density().numpy(), self.alphas().numpy()
        if ax is None:
            fig, ax = plt.subplots(figsize=(1.0 + 0.7 * dens.shape[1], 1.0 + 0.5 * dens.shape[0]))
        else:
            fig = ax.figure
        im = ax.imshow(dens, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
        for i in range(dens.shape[0]):
            for h in range(dens.shape[1]):
                if not math.isnan(alph[i, h]):
                    ax.text(h, i, f"{alph[i, h]:.2f}", ha="center", va="center", fontsize=7, color="w")
        ax.set_xticks(range(dens.shape[1]))
        ax.set_yticks(range(dens.shape[0]), labels=self.layer_names, fontsize=7)
        ax.set_xlabel("head (cell text: alpha)")
        ax.set_title("attention density")
        fig.colorbar(im, ax=ax)
        if path is not None:
            fig.savefig(path, bbox_inches="tight")
        return fig


def record_head_stats(model: nn.Module, diversity: bool = False, history: bool = False,
                      query_mask=None) -> HeadStatsRecorder:
    """A :class:`HeadStatsRecorder` for ``model``; use it as ``with record_head_stats(model) as rec:``.

    Args:
        model: model containing entmax attention layers.
        diversity: also record the Jensen-Shannon head diversity (eq. 11). Default False.
        history: also keep each call's per-head density (``rec.density_history()``, e.g. per generated
            token). Default False.
        query_mask: ``(B, Nq)`` boolean or 0/1 mask of the real query rows (padded rows are not counted), e.g.
            ``batch["attention_mask"]`` of a right-padded batch. Default None.
    """
    return HeadStatsRecorder(model, diversity=diversity, history=history, query_mask=query_mask)
