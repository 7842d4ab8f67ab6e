"""Figures of the sparsification example: alpha trajectories, density per head, attention maps.

Every function writes one PNG and returns its path; all need matplotlib (extra ``plot``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

ZERO_GREY = "#cccccc"


def pyplot():
    """matplotlib.pyplot with the Agg backend (raises ImportError without matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _grid(n: int, max_cols: int = 3) -> tuple[int, int]:
    cols = min(n, max_cols)
    return -(-n // cols), cols


def plot_alpha_trajectories(steps: list[int], history: np.ndarray, path: Path, title: str) -> Path:
    """alpha of every head against the training step, one panel per layer.

    Args:
        steps: the logged steps ``(T,)``.
        history: alpha ``(T, n_layers, n_heads)``.
    """
    plt = pyplot()
    n_layers, n_heads = history.shape[1:]
    rows, cols = _grid(n_layers)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.6 * rows), sharex=True, sharey=True,
                             squeeze=False, layout="constrained")
    colors = plt.get_cmap("tab20")(np.linspace(0, 1, max(n_heads, 2)))
    for layer, ax in enumerate(axes.flat):
        if layer >= n_layers:
            ax.axis("off")
            continue
        for h in range(n_heads):
            ax.plot(steps, history[:, layer, h], color=colors[h], lw=1.2, label=f"head {h}")
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.set_ylim(0.98, 2.02)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    for ax in axes[:, 0]:
        ax.set_ylabel("alpha")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_head_density(panels: dict[str, tuple[np.ndarray, np.ndarray]], path: Path) -> Path:
    """Heat maps of the density per layer (rows) and head (columns), cell text the head's alpha.

    Args:
        panels: title -> ``(density, alpha)``, both ``(n_layers, n_heads)``.
    """
    plt = pyplot()
    rows, cols = _grid(len(panels))
    first = next(iter(panels.values()))[0]
    size = (0.5 * first.shape[1] * cols + 1.5, 0.45 * first.shape[0] * rows + 1.2)
    fig, axes = plt.subplots(rows, cols, figsize=size, squeeze=False, layout="constrained")
    image = None
    for ax, (title, (density, alpha)) in zip(axes.flat, panels.items()):
        image = ax.imshow(density, vmin=0.0, vmax=1.0, cmap="magma", aspect="auto")
        for (layer, h), a in np.ndenumerate(alpha):
            color = "black" if density[layer, h] > 0.6 else "white"
            ax.text(h, layer, f"{a:.2f}", ha="center", va="center", fontsize=5.5, color=color)
        ax.set_title(f"{title}\nmean density {np.nanmean(density):.2f}", fontsize=9)
        ax.set_xticks(range(density.shape[1]))
        ax.set_yticks(range(density.shape[0]))
        ax.tick_params(labelsize=7)
        ax.set_xlabel("head (cell text: alpha)", fontsize=8)
        ax.set_ylabel("layer", fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="density (fraction of keys with weight > 0)")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_attention_maps(maps: list[np.ndarray], heads: list[int], alphas: list[float], tokens: list[str],
                        path: Path, title: str) -> Path:
    """One attention map per layer (the given head of each) for one sentence; exact zeros in grey.

    Args:
        maps: per layer, weights ``(n, n)`` of the chosen head.
        heads, alphas: the head drawn for each layer and its alpha.
        tokens: the ``n`` token strings.
    """
    plt = pyplot()
    from matplotlib.patches import Patch

    rows, cols = _grid(len(maps))
    size = 0.22 * len(tokens) + 1.2
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols + 1.0, size * rows + 0.8), squeeze=False,
                             layout="constrained")
    cmap = plt.get_cmap("Blues").with_extremes(bad=ZERO_GREY)
    image = None
    for layer, ax in enumerate(axes.flat):
        if layer >= len(maps):
            ax.axis("off")
            continue
        weights = maps[layer]
        zeros = weights == 0
        image = ax.imshow(np.ma.masked_array(weights, mask=zeros), cmap=cmap, vmin=0.0, vmax=1.0,
                          interpolation="nearest")
        ax.set_title(f"layer {layer}, head {heads[layer]}: alpha {alphas[layer]:.2f}, {100 * zeros.mean():.0f}% zeros",
                     fontsize=8)
        ax.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=6)
        ax.set_yticks(range(len(tokens)), tokens, fontsize=6)
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6, label="attention weight")
    fig.legend(handles=[Patch(facecolor=ZERO_GREY, edgecolor="black", label="weight exactly 0")],
               loc="outside lower center", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
