"""The figures of the sparse Transformer example: analogues of Correia et al. (2019) Figs. 2-6 and the
training-loss curves."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from seq2seq_model import BLOCKS, by_block
from seq2seq_training import RunResult

FIGURES = (
    "fig2_alpha_trajectories.png",
    "fig3_alpha_distribution.png",
    "fig4_density_histograms.png",
    "fig5_head_density.png",
    "fig6_head_diversity.png",
    "training_loss.png",
)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_figures(results: list[RunResult], out_dir: Path) -> list[Path]:
    """Write the analogues of Correia et al. (2019) Figs. 2-6 and the loss curves; returns the paths.

    Skipped, with a message, when matplotlib (extra ``plot``) is not installed.
    """
    try:
        plt = _pyplot()
    except ImportError:
        print("matplotlib not installed (pip install 'sparse_attn[plot]'): figures skipped", file=sys.stderr)
        return []
    runs = {r.variant: r for r in results}
    colors = {"softmax": "#4c72b0", "entmax15": "#dd8452", "adaptive": "#55a868"}
    paths = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        paths.append(out_dir / name)

    adaptive = runs.get("adaptive")
    if adaptive is not None:
        hist = np.asarray(adaptive.alpha_history)
        steps = np.asarray(adaptive.alpha_steps)
        per_block = by_block(adaptive.module_names, np.moveaxis(hist, 0, 1))
        fig, axes = plt.subplots(1, len(per_block), figsize=(4.2 * len(per_block), 3.6), sharey=True, squeeze=False)
        for ax, (block, arr) in zip(axes[0], per_block.items()):
            cmap = plt.get_cmap("tab10")
            for layer in range(arr.shape[0]):
                for head in range(arr.shape[2]):
                    ax.plot(steps, arr[layer, :, head], color=cmap(head % 10), lw=1.4,
                            ls=("-", "--", ":", "-.")[layer % 4], label=f"L{layer} H{head}")
            ax.set_title(f"{block} attention")
            ax.set_xlabel("training step")
            ax.set_ylim(1.0, 2.0)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("alpha")
        axes[0][-1].legend(fontsize=7, ncol=2, loc="best")
        fig.suptitle("Fig. 2 analogue: alpha trajectories per head (adaptive)")
        save(fig, FIGURES[0])

        fig, axes = plt.subplots(1, len(per_block), figsize=(4.2 * len(per_block), 3.4), sharey=True, squeeze=False)
        bins = np.linspace(1.0, 2.0, 11)
        for ax, (block, arr) in zip(axes[0], per_block.items()):
            ax.hist(arr[:, 0].ravel(), bins=bins, histtype="step", lw=1.5, color="grey", label="initial (random)")
            ax.hist(arr[:, -1].ravel(), bins=bins, alpha=0.7, color=colors["adaptive"], label="learned")
            ax.set_title(f"{block} attention")
            ax.set_xlabel("alpha")
        axes[0][0].set_ylabel("number of heads")
        axes[0][0].legend(fontsize=8)
        fig.suptitle("Fig. 3 analogue: distribution of learned alpha per attention block")
        save(fig, FIGURES[1])

    sparse = [r for r in results if r.variant != "softmax"]
    if sparse:
        fig, axes = plt.subplots(1, len(BLOCKS), figsize=(12.6, 3.4), sharey=True)
        bins = np.linspace(0.0, 1.0, 21)
        for ax, block in zip(axes, BLOCKS):
            for r in sparse:
                h = r.metrics["heads"]
                vals = by_block(h["names"], h["sentence_density"], axis=1)[block]
                ax.hist(vals.ravel(), bins=bins, alpha=0.55, color=colors[r.variant], label=r.variant)
            ax.set_title(f"{block} attention")
            ax.set_xlabel("density (fraction of keys with nonzero weight)")
        axes[0].set_ylabel("heads x validation sentences")
        axes[0].legend(fontsize=8)
        fig.suptitle("Fig. 4 analogue: head density histograms per block (softmax: all at 1)")
        save(fig, FIGURES[2])

        fig, axes = plt.subplots(len(sparse), len(BLOCKS), figsize=(12.6, 3.0 * len(sparse)), sharey=True,
                                 squeeze=False)
        for row, r in zip(axes, sparse):
            h = r.metrics["heads"]
            for ax, block in zip(row, BLOCKS):
                dens = np.sort(by_block(h["names"], h["density"])[block], axis=1)
                layers = np.arange(dens.shape[0])
                for head in range(dens.shape[1]):
                    shade = 0.35 + 0.65 * head / max(1, dens.shape[1] - 1)
                    ax.plot(layers, dens[:, head], marker="o", color=colors[r.variant], alpha=shade)
                ax.set_title(f"{r.variant}: {block}", fontsize=10)
                ax.set_xticks(layers)
                ax.set_ylim(0, 1.05)
                ax.grid(alpha=0.3)
            row[0].set_ylabel("head density (sorted)")
        for ax in axes[-1]:
            ax.set_xlabel("layer")
        fig.suptitle("Fig. 5 analogue: density of each head per layer")
        save(fig, FIGURES[3])

    fig, axes = plt.subplots(1, len(BLOCKS), figsize=(12.6, 3.4), sharey=True)
    for ax, block in zip(axes, BLOCKS):
        for r in results:
            h = r.metrics["heads"]
            js = by_block(h["names"], h["diversity"])[block]
            ax.plot(np.arange(len(js)), js, marker="o", color=colors[r.variant], label=r.variant)
        ax.set_title(f"{block} attention")
        ax.set_xlabel("layer")
        ax.set_xticks(np.arange(len(js)))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("Jensen-Shannon head diversity")
    axes[0].legend(fontsize=8)
    fig.suptitle("Fig. 6 analogue: head diversity per layer")
    save(fig, FIGURES[4])

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for r in results:
        loss = np.asarray(r.losses)
        k = max(1, len(loss) // 50)
        smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
        ax.plot(np.arange(len(smooth)) + k, smooth, color=colors[r.variant], label=r.variant)
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("training loss (cross-entropy)")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, FIGURES[5])
    return paths


