"""Load a checkpoint written by ``train_sparse_transformer.py`` and look inside its attention.

Runs held-out inputs (drawn with a seed the training and validation data never used) through
greedy decoding, prints a few examples and the accuracy, prints a per-layer, per-head table
of attention density and alpha (:func:`sparse_attn.stats.record_head_stats`), and saves one
attention map (every head of one attention module for one example) as a PNG in which exact
zeros are drawn in a separate colour.

Usage::

    python examples/seq2seq/inference.py --checkpoint runs/demo/adaptive/checkpoint.pt
    python examples/seq2seq/inference.py --checkpoint runs/demo/entmax15/checkpoint.pt --module encoder.0.self_attn
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this example's modules and examples/run_folders.py

from run_folders import add_device_option, option_slug, resolve_device  # noqa: E402
from seq2seq_model import load_checkpoint  # noqa: E402
from seq2seq_task import make_batch  # noqa: E402

from sparse_attn.stats import record_head_stats  # noqa: E402

HELD_OUT_SEED_OFFSET = 2_000_029
ZERO_COLOR = "#d0d0d0"


def plot_attention_map(weights: np.ndarray, alphas, row_labels, col_labels, title: str, path: Path) -> Path:
    """Save a heat map of ``weights`` ``(heads, n_q, n_k)``, exact zeros in light grey, to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    heads = weights.shape[0]
    cols = min(heads, 4)
    rows = -(-heads // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.0 * cols + 1.2, 3.0 * rows + 0.9), squeeze=False,
                             layout="constrained")
    cmap = plt.get_cmap("viridis").with_extremes(bad=ZERO_COLOR)
    image = None
    for h, ax in enumerate(axes.flat):
        if h >= heads:
            ax.axis("off")
            continue
        w = weights[h]
        image = ax.imshow(np.ma.masked_where(w == 0, w), cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest")
        ax.set_title(f"head {h}: alpha {alphas[h]:.2f}, {100 * (w == 0).mean():.0f}% zeros", fontsize=9)
        ax.set_xticks(range(len(col_labels)), col_labels, fontsize=7)
        ax.set_yticks(range(len(row_labels)), row_labels, fontsize=7)
        ax.set_xlabel("key", fontsize=8)
        if h % cols == 0:
            ax.set_ylabel("query", fontsize=8)
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="attention weight (nonzero)")
    fig.legend(handles=[Patch(facecolor=ZERO_COLOR, edgecolor="black", label="exactly 0 (grey cells)")],
               loc="outside lower center", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _digits(tokens: torch.Tensor) -> str:
    """The int64 tokens of one sequence ``(length,)`` as space-separated digits."""
    return " ".join(str(x) for x in tokens.tolist())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=Path("runs/demo/adaptive/checkpoint.pt"),
                   help="checkpoint.pt to load")
    p.add_argument("--n", type=int, default=256, help="held-out examples to decode")
    p.add_argument("--show", type=int, default=4, help="examples to print")
    p.add_argument("--seed", type=int, default=None,
                   help=f"held-out data seed (default: training seed + {HELD_OUT_SEED_OFFSET})")
    p.add_argument("--module", default=None, help="attention module to draw (default: the last context attention)")
    add_device_option(p)
    p.add_argument("--out", type=Path, default=None,
                   help="folder for the attention map (default: the checkpoint's run folder); the file is "
                        "attention_map_<variant>.png, with -<option>=<value>,... for every option but --checkpoint, "
                        "--out, --device and --show that differs from its default")
    return p


def main(argv=None) -> dict:
    """Command line entry point; returns ``{"seq_acc", "token_acc", "table", "attention_map"}``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.n <= 0 or args.show < 0:
        raise SystemExit(f"--n must be positive and --show non-negative, got {args.n} and {args.show}")
    if not args.checkpoint.is_file():
        raise SystemExit(f"--checkpoint must be a checkpoint written by train_sparse_transformer.py, "
                         f"got {args.checkpoint} (not a file)")
    device = str(resolve_device(args.device))
    model, cfg, _ = load_checkpoint(args.checkpoint, device)
    seed = cfg.seed + HELD_OUT_SEED_OFFSET if args.seed is None else args.seed
    batch = make_batch(cfg.task, args.n, cfg.length, cfg.vocab, torch.Generator().manual_seed(seed))
    src, tgt_in, tgt = (t.to(device) for t in batch)

    pred = model.greedy_decode(src)
    ok = pred == tgt
    print(f"{cfg.variant} checkpoint {args.checkpoint}: task {cfg.task}, {args.n} held-out inputs (seed {seed})")
    for i in range(min(args.show, args.n)):
        verdict = "ok" if ok[i].all() else f"WRONG (target {_digits(tgt[i])})"
        print(f"  input {_digits(src[i])}  ->  {_digits(pred[i])}  {verdict}")
    seq_acc, tok_acc = ok.all(1).float().mean().item(), ok.float().mean().item()
    print(f"greedy decoding: sequence accuracy {seq_acc:.3f}, token accuracy {tok_acc:.3f}\n")

    with torch.no_grad(), record_head_stats(model, diversity=True) as rec:
        model(src, tgt_in)
    table = rec.table()
    print("attention density (fraction of attendable keys with nonzero weight) and alpha per layer and head:")
    print(table)

    names = [name for name, _, _, _ in model.attention_modules()]
    module = args.module or [n for n in names if "cross_attn" in n][-1]
    if module not in names:
        raise SystemExit(f"--module must be one of {names}, got {module!r}")
    with torch.no_grad():
        _, weights = model(src[:1], tgt_in[:1], need_weights=True)
    w = weights[module][0].float().cpu().numpy()
    alphas = dict((n, m) for n, _, _, m in model.attention_modules())[module].alpha.detach().float().cpu().tolist()
    src_labels = [str(x) for x in src[0].tolist()]
    dec_labels = ["BOS"] + [str(x) for x in tgt_in[0, 1:].tolist()]
    rows = src_labels if module.startswith("encoder") else dec_labels
    cols = dec_labels if module.endswith("self_attn") and module.startswith("decoder") else src_labels
    out_dir = args.out or args.checkpoint.resolve().parent.parent
    suffix = option_slug(parser, args, skip=("checkpoint", "device", "show"))
    suffix = f"-{suffix}" if suffix else ""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = None
    try:
        path = plot_attention_map(w, alphas, rows, cols, f"{cfg.variant}: {module}, one held-out {cfg.task} example",
                                  out_dir / f"attention_map_{cfg.variant}{suffix}.png")
        print(f"\nattention map of {module} ({100 * (w == 0).mean():.0f}% exact zeros) written to {path}")
    except ImportError:
        print("matplotlib not installed (pip install 'sparse_attn[plot]'): attention map skipped", file=sys.stderr)
    return {"seq_acc": seq_acc, "token_acc": tok_acc, "table": table, "attention_map": path}


if __name__ == "__main__":
    main()
