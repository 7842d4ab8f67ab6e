"""Text tables, CSV and JSON reports of the sparsification example."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
from sparsify_model import Evaluation
from sparsify_train import TrainResult


def grid(values: np.ndarray, fmt: str = "{:.2f}", row_label: str = "layer") -> str:
    """A ``(n_layers, n_heads)`` array as a text table, one line per layer, with the layer mean."""
    n_heads = values.shape[1]
    width = max(len(fmt.format(1.0)), 4)
    head = f"{row_label:>5} " + " ".join(f"{'h' + str(h):>{width}}" for h in range(n_heads)) + f" {'mean':>{width}}"
    lines = [head]
    for i, row in enumerate(values):
        cells = " ".join(f"{fmt.format(v):>{width}}" for v in row)
        lines.append(f"{i:>5} {cells} {fmt.format(float(np.nanmean(row))):>{width}}")
    return "\n".join(lines)


def metrics_line(name: str, ev: Evaluation, extra: str = "") -> str:
    s = ev.summary()
    alpha = ev.alpha.numpy()
    alpha_text = f"{s['alpha']:.2f}"
    if np.ptp(alpha) >= 1e-6:
        alpha_text += f" ({alpha.min():.2f}-{alpha.max():.2f})"
    return (f"{name:<24} {alpha_text:<17} {s['density']:7.3f}  {s['cosine_mean']:6.3f} {s['cosine_min']:6.3f}"
            f"  {s['nn_top1']:6.3f} {s['nn_top5']:6.3f}  {s['max_abs_diff']:9.2e}{extra}")


METRICS_HEADER = (f"{'setting':<24} {'alpha (range)':<17} {'density':>7}  {'cos':>6} {'min':>6}"
                  f"  {'NN@1':>6} {'top-5':>6}  {'max|dh|':>9}")


def layer_density_line(name: str, ev: Evaluation) -> str:
    per_layer = ev.density.nanmean(dim=1).numpy()
    return f"{name:<24} " + " ".join(f"{v:5.2f}" for v in per_layer)


def write_heads_csv(path: Path, evaluations: dict[str, Evaluation], layer_names: list[str]) -> Path:
    """One row per setting, layer and head: alpha and density (layers and heads counted from 0)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["setting", "layer", "module", "head", "alpha", "density"])
        for setting, ev in evaluations.items():
            for (layer, h), d in np.ndenumerate(ev.density.numpy()):
                w.writerow([setting, layer, layer_names[layer], h, f"{float(ev.alpha[layer, h]):.6f}", f"{d:.6f}"])
    return path


def write_trajectories_csv(path: Path, runs: list[TrainResult]) -> Path:
    """One row per run, logged step, layer and head: alpha."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "step", "layer", "head", "alpha"])
        for r in runs:
            for step, alphas in zip(r.alpha_steps, r.alpha_history):
                for (layer, h), a in np.ndenumerate(alphas):
                    w.writerow([r.name, step, layer, h, f"{a:.6f}"])
    return path


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_metrics_json(path: Path, evaluations: dict[str, Evaluation], runs: list[TrainResult], info: dict) -> Path:
    """Summary metrics per setting, the training runs' settings, losses and times, and ``info`` (strict JSON)."""
    data = {
        **info,
        "settings": {k: {n: _finite(v) for n, v in ev.summary().items()} for k, ev in evaluations.items()},
        "runs": {r.name: {"config": vars(r.config), "seconds": r.seconds, "loss_first": r.losses[0],
                          "loss_last": r.losses[-1], "distill_loss_first": r.distill_losses[0],
                          "distill_loss_last": r.distill_losses[-1],
                          "sparsity_term_first": r.sparsity_terms[0] if r.sparsity_terms else None,
                          "sparsity_term_last": r.sparsity_terms[-1] if r.sparsity_terms else None} for r in runs},
    }
    path.write_text(json.dumps(data, indent=2, allow_nan=False))
    return path
