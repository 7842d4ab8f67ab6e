"""The reports of a run of the sparse Transformer example: metrics, per-head statistics, alpha
trajectories (JSON / CSV), the figures and the printed summary."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np
from seq2seq_figures import plot_figures
from seq2seq_model import BLOCKS, block_of, by_block
from seq2seq_task import Config
from seq2seq_training import RunResult


def _head_rows(res: RunResult):
    h = res.metrics["heads"]
    for block, dens in by_block(h["names"], h["density"]).items():
        alphas = by_block(h["names"], h["alpha"])[block]
        divs = by_block(h["names"], h["diversity"])[block]
        for layer in range(dens.shape[0]):
            for head in range(dens.shape[1]):
                yield {"variant": res.variant, "block": block, "layer": layer, "head": head,
                       "alpha": round(float(alphas[layer, head]), 6), "density": round(float(dens[layer, head]), 6),
                       "layer_js_diversity": round(float(divs[layer]), 6)}


def _write_csv(path: Path, rows: list[dict]):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _block_means(res: RunResult, key: str) -> dict:
    h = res.metrics["heads"]
    vals = by_block(h["names"], h[key])
    return {b: float(np.mean(v)) for b, v in vals.items()}


def _per_block(means: dict) -> str:
    """``"x/y/z"``: the value of each attention block (encoder self, decoder self, context), 2 decimals."""
    return "/".join(f"{means[b]:.2f}" for b in BLOCKS)


def _describe_head(names: list[str], alphas: np.ndarray, density: np.ndarray, ij: tuple) -> str:
    """``"<module> head <h> (alpha a, density d)"`` for index ``ij = (module, head)`` of ``(modules, heads)`` arrays."""
    return f"{names[ij[0]]} head {ij[1]} (alpha {alphas[ij]:.2f}, density {density[ij]:.2f})"


def summary_text(cfg: Config, results: list[RunResult], out_dir: Path) -> str:
    """The short text summary printed at the end of a run (also ``summary.txt``)."""
    backend = "fused Triton kernels" if cfg.device.startswith("cuda") else "reference path"
    lines = [
        f"sparse_attn demo: {cfg.task} {cfg.length} digits, encoder-decoder Transformer "
        f"{cfg.layers}+{cfg.layers} layers x {cfg.heads} heads, d_model {cfg.d_model}, "
        f"{cfg.steps} steps x batch {cfg.batch_size}, seed {cfg.seed}, {cfg.device} ({backend})",
        "",
        f"{'variant':<9} {'val loss':>8} {'tok acc':>8} {'seq acc':>8}   "
        f"{'density enc/dec/ctx':<20} {'mean alpha enc/dec/ctx':<23} {'JS enc/dec/ctx':<17} {'train s':>7}",
    ]
    for r in results:
        m = r.metrics
        dens, alph, js = (_block_means(r, k) for k in ("density", "alpha", "diversity"))
        lines.append(f"{r.variant:<9} {m['val_loss']:>8.4f} {m['token_acc']:>8.3f} {m['seq_acc']:>8.3f}   "
                     f"{_per_block(dens):<20} {_per_block(alph):<23} {_per_block(js):<17} {r.seconds:>7.1f}")
    for r in results:
        if r.variant != "adaptive":
            continue
        first, last = np.asarray(r.alpha_history[0]), np.asarray(r.alpha_history[-1])
        h = r.metrics["heads"]
        dens, alph = np.asarray(h["density"]), np.asarray(h["alpha"])
        lo, hi = np.unravel_index(dens.argmin(), dens.shape), np.unravel_index(dens.argmax(), dens.shape)
        lines += [
            "",
            f"adaptive: alpha moved from init mean {first.mean():.2f} (range {first.min():.2f}-{first.max():.2f}) "
            f"to {last.mean():.2f} (range {last.min():.2f}-{last.max():.2f}); "
            f"mean |change| {np.abs(last - first).mean():.2f}",
            f"          sparsest head {_describe_head(h['names'], alph, dens, lo)}",
            f"          densest head  {_describe_head(h['names'], alph, dens, hi)}",
        ]
    lines += ["", "density = mean fraction of attendable keys with nonzero weight (softmax: 1); "
              "JS = Jensen-Shannon head diversity (Correia et al. 2019, eq. 11)",
              f"reports and figures in {out_dir}/"]
    return "\n".join(lines)


def _nan_to_none(obj):
    """``obj`` (nested dicts, lists, tuples, scalars) with every non-finite float replaced by None (JSON null)."""
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_nan_to_none(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_reports(cfg: Config, results: list[RunResult], out_dir: Path, figures: bool = True) -> str:
    """Write metrics.json/.csv, head_stats.csv, alpha_trajectories.csv, the figures and summary.txt.

    Returns the summary text.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = {r.variant: {k: v for k, v in r.metrics.items() if k != "heads"} | {"checkpoint": r.checkpoint}
               for r in results}
    with open(out_dir / "metrics.json", "w") as f:
        report = {"config": asdict(cfg) | {"variant": [r.variant for r in results]}, "variants": metrics,
                  "heads": {r.variant: r.metrics["heads"] for r in results}}
        json.dump(_nan_to_none(report), f, indent=1, allow_nan=False)
    _write_csv(out_dir / "metrics.csv", [{"variant": v} | {k: m[k] for k in
               ("val_loss", "token_acc", "seq_acc", "train_loss_first", "train_loss_last", "steps", "train_seconds")}
               for v, m in metrics.items()])
    _write_csv(out_dir / "head_stats.csv", [row for r in results for row in _head_rows(r)])
    traj = []
    for r in results:
        for step, alphas in zip(r.alpha_steps, r.alpha_history):
            for name, row in zip(r.module_names, alphas):
                for head, a in enumerate(row):
                    traj.append({"variant": r.variant, "step": step, "block": block_of(name),
                                 "layer": int(name.split(".")[1]), "head": head, "alpha": round(a, 6)})
    _write_csv(out_dir / "alpha_trajectories.csv", traj)
    if figures:
        plot_figures(results, out_dir)
    text = summary_text(cfg, results, out_dir)
    (out_dir / "summary.txt").write_text(text + "\n")
    return text


