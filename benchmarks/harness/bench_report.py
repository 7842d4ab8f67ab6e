"""What the attention benchmark writes: ``results.csv`` (raw numbers), ``results.md`` (tables) and the
plots, each stamped with where and how the run was made (see ``benchmarks/README.md``)."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from bench_cases import GROUP_TITLES, dense_flops
from bench_common import (
    CASE_COLUMNS,
    COLUMNS,
    FLOAT_COLUMNS,
    INT_COLUMNS,
    MODES,
    OK,
    STAMP_KEYS,
    fmt,
)


def _num(value) -> float:
    return float("nan") if value is None else float(value)


def write_csv(path: Path, stamp: dict, notes: list[str], rows: list[dict], columns=COLUMNS):
    """CSV of ``columns`` with ``# key: value`` stamp lines first (read with ``pandas.read_csv(path, comment="#")``)."""
    buf = io.StringIO()
    for key in STAMP_KEYS:
        buf.write(f"# {key}: {stamp[key]}\n")
    for note in notes:
        buf.write(f"# note: {note}\n")
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({c: fmt(row.get(c), 6) for c in columns})
    path.write_text(buf.getvalue())


def read_csv(path: Path, float_columns=FLOAT_COLUMNS, int_columns=INT_COLUMNS) -> list[dict]:
    """Rows of a results CSV written by :func:`write_csv`, numbers parsed back (``int_columns`` always filled,
    ``float_columns`` None where empty) and ``causal`` as a bool."""
    lines = [ln for ln in path.read_text().splitlines() if not ln.startswith("#")]
    rows = []
    for raw in csv.DictReader(lines):
        row = dict(raw)
        for c in float_columns:
            row[c] = float(row[c]) if row.get(c) not in (None, "") else None
        for c in int_columns:
            row[c] = int(row[c])
        row["causal"] = row["causal"] == "True"
        rows.append(row)
    return rows


MD_CASE_COLUMNS = (
    ("method", "method"), ("backend", "backend"), ("alpha", "α"), ("batch", "B"), ("heads", "H"),
    ("seq_q", "N"), ("head_dim", "D"), ("causal", "causal"), ("score_mult", "score ×"),
    ("density", "density"), ("tiles_skipped", "tiles skipped"), ("passes_mean", "passes mean"),
    ("passes_max", "passes max"), ("visits_mean", "tile visits"), ("max_abs_err", "max err"),
)
def _mode_cells(row: dict | None) -> list[str]:
    """``ms (q20-q80)``, ``TFLOP/s``, ``time / SDPA flash`` and peak MiB of one mode, or its status."""
    if row is None:
        return ["", "", "", ""]
    if row["status"] != OK:
        return [row["status"], "", "", ""]
    return [f"{fmt(row['ms'])} ({fmt(row['ms_q20'])}–{fmt(row['ms_q80'])})", fmt(row["tflops"]),
            fmt(row["time_vs_sdpa_flash"]), fmt(row["peak_mem_mib"], 4)]


def summary_lines(rows: list[dict], modes=MODES) -> list[str]:
    """Flash-grid summary: per mode, ``time / SDPA flash`` of every other method, one line per shape."""
    grid = [r for r in rows if r["group"] == "flash"]
    others = (r for r in grid if not (r["method"] == "sdpa" and r["backend"] == "flash"))
    series = list(dict.fromkeys(_series_label(r) for r in others))
    if not series:
        return []
    lines = ["## Summary: time / SDPA flash on the FlashAttention grid (below 1 = faster than flash)", ""]
    for mode in modes:
        by_shape: dict[tuple, dict] = {}
        for r in grid:
            if r["mode"] == mode:
                by_shape.setdefault((r["head_dim"], r["causal"], r["seq_q"]), {})[_series_label(r)] = r
        if not by_shape:
            continue
        lines += [f"### {mode}", "", "| D | causal | N | " + " | ".join(series) + " |",
                  "|" + "---|" * (3 + len(series))]
        for (hd, causal, seq), cells in by_shape.items():
            vals = []
            for label in series:
                r = cells.get(label)
                vals.append("" if r is None else fmt(r["time_vs_sdpa_flash"]) if r["status"] == OK else r["status"])
            lines.append(f"| {hd} | {causal} | {seq} | " + " | ".join(vals) + " |")
        lines.append("")
    return lines


def stamp_lines(stamp: dict, notes: list[str]) -> list[str]:
    """Markdown list items: the stamp (``- **gpu**: `...```) and then the notes."""
    return [f"- **{key}**: `{stamp[key]}`" for key in STAMP_KEYS] + [f"- note: {n}" for n in notes]


def write_markdown(path: Path, stamp: dict, notes: list[str], rows: list[dict], modes=MODES):
    """Stamp, notes, the flash-grid summary, then tables, one per group, one line per (case, method)
    and four cells per mode (see benchmarks/README.md)."""
    lines = ["# Attention benchmark", "", *stamp_lines(stamp, notes), ""]
    lines += summary_lines(rows, modes)
    header = [h for _, h in MD_CASE_COLUMNS]
    for mode in modes:
        header += [f"{mode} ms (q20–q80)", f"{mode} TFLOP/s", f"{mode} / SDPA flash", f"{mode} peak MiB"]
    header.append("notes")
    for group, title in GROUP_TITLES.items():
        lines_by_key: dict[tuple, dict] = {}
        for r in rows:
            if r["group"] != group:
                continue
            key = tuple(str(r[c]) for c in CASE_COLUMNS) + (r["method"], r["backend"], r["alpha"])
            lines_by_key.setdefault(key, {})[r["mode"]] = r
        if not lines_by_key:
            continue
        lines += [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for by_mode in lines_by_key.values():
            first = next(iter(by_mode.values()))
            cells = [fmt(first.get(c)) for c, _ in MD_CASE_COLUMNS]
            for mode in modes:
                cells += _mode_cells(by_mode.get(mode))
            cells.append("; ".join(dict.fromkeys(r["note"] for r in by_mode.values() if r.get("note"))))
            lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
        lines.append("")
    path.write_text("\n".join(lines))


def _stamp_text(stamp: dict) -> str:
    return (f"{stamp['gpu']} | driver {stamp['driver']} | torch {stamp['torch']} | triton {stamp['triton']} | "
            f"commit {stamp['commit'][:16]} | {stamp['date']}\n{stamp['command']}")


def _series_label(r: dict) -> str:
    alpha = "" if r["method"] in ("sdpa", "flash_attn") else f" α={r['alpha']}"
    backend = f"[{r['backend']}]" if r["method"] in ("sdpa", "torch_recipe") else ""
    return f"{r['method']}{backend}{alpha}"


def write_plots(out: Path, stamp: dict, rows: list[dict]) -> list[Path]:
    """``plot_grid.png`` (TFLOP/s vs seq), ``plot_sparsity.png`` (time ratio, skipped tiles, passes vs density),
    ``plot_mixed.png``."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)", flush=True)
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == OK]
    footer = _stamp_text(stamp)
    return [
        _plot_grid(plt, [r for r in ok if r["group"] == "flash"], footer, out / "plot_grid.png"),
        _plot_sparsity(plt, [r for r in ok if r["group"] == "sparsity"], footer, out / "plot_sparsity.png"),
        _plot_mixed(plt, [r for r in ok if r["group"] == "mixed"], footer, out / "plot_mixed.png"),
    ]


def _plot_grid(plt, grid: list[dict], footer: str, path: Path) -> Path:
    """Dense-equivalent TFLOP/s against sequence length, one panel per (mode, head dim, causal)."""
    panels = sorted({(r["head_dim"], r["causal"]) for r in grid}) or [(0, False)]
    fig, axes = plt.subplots(len(MODES), len(panels), figsize=(4.5 * len(panels), 3.4 * len(MODES)), squeeze=False)
    for i, mode in enumerate(MODES):
        for j, (hd, causal) in enumerate(panels):
            ax = axes[i][j]
            sel = [r for r in grid if r["mode"] == mode and r["head_dim"] == hd and r["causal"] == causal]
            for label in sorted({_series_label(r) for r in sel}):
                pts = sorted((r["seq_q"], r["tflops"]) for r in sel if _series_label(r) == label)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode}, D={hd}, causal={causal}", fontsize=9)
            ax.set_xlabel("seq")
            ax.set_ylabel("dense-equiv. TFLOP/s")
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper center", ncol=min(4, len(labels)), fontsize=7)
    return _save(plt, fig, footer, path, left=0.07, right=0.98, bottom=0.08, top=0.9, hspace=0.45, wspace=0.3)


def _plot_sparsity(plt, sweep: list[dict], footer: str, path: Path) -> Path:
    """Time / SDPA flash, fraction of tiles skipped and passes over K against realized density."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for mode in MODES:
        for alpha in sorted({r["alpha"] for r in sweep if r["method"] == "sparse_attn"}):
            sel = sorted((_num(r["density"]), _num(r["time_vs_sdpa_flash"])) for r in sweep
                         if r["method"] == "sparse_attn" and r["alpha"] == alpha and r["mode"] == mode)
            axes[0].plot([p[0] for p in sel], [p[1] for p in sel], marker="o", label=f"{mode} α={alpha}")
    fwd_rows = [r for r in sweep if r["method"] == "sparse_attn" and r["mode"] == "fwd"]
    for alpha in sorted({r["alpha"] for r in fwd_rows}):
        sel = sorted((_num(r["density"]), _num(r["tiles_skipped"]), _num(r["passes_mean"]))
                     for r in fwd_rows if r["alpha"] == alpha)
        axes[1].plot([p[0] for p in sel], [p[1] for p in sel], marker="o", label=f"α={alpha}")
        axes[2].plot([p[0] for p in sel], [p[2] for p in sel], marker="o", label=f"α={alpha}")
    for ax, ylabel in zip(axes, ("time / SDPA flash", "fraction of tiles skipped", "passes over K (mean per q tile)")):
        ax.set_xscale("log")
        ax.set_xlabel("realized density (nnz / valid keys)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return _save(plt, fig, footer, path, left=0.06, right=0.98, bottom=0.22, top=0.95, wspace=0.3)


def _plot_mixed(plt, mixed: list[dict], footer: str, path: Path) -> Path:
    """Median ms per mode and method, one panel per (head dim, causal), log scale."""
    shapes = sorted({(r["head_dim"], r["causal"]) for r in mixed}) or [(0, False)]
    fig, axes = plt.subplots(1, len(shapes), figsize=(max(9.0, 5.5 * len(shapes)), 4.2), squeeze=False)
    for j, (hd, causal) in enumerate(shapes):
        ax = axes[0][j]
        sel = [r for r in mixed if r["head_dim"] == hd and r["causal"] == causal]
        labels = sorted({_series_label(r) for r in sel})
        width = 0.8 / max(1, len(labels))
        for i, label in enumerate(labels):
            ys = [next((r["ms"] for r in sel if r["mode"] == m and _series_label(r) == label), float("nan"))
                  for m in MODES]
            ax.bar([x + i * width for x in range(len(MODES))], ys, width=width, label=label)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(MODES))], MODES)
        ax.set_ylabel("ms (median)")
        ax.set_yscale("log")
        ax.set_title(f"D={hd}, causal={causal}", fontsize=9)
        if labels:
            ax.legend(fontsize=7)
    return _save(plt, fig, footer, path, left=0.1, right=0.98, bottom=0.22, top=0.92, wspace=0.3)


def _save(plt, fig, footer: str, path: Path, **adjust) -> Path:
    """Stamp ``footer`` at the bottom left, apply ``subplots_adjust(**adjust)``, write ``path`` and close."""
    fig.text(0.01, 0.005, footer, fontsize=6, family="monospace")
    fig.subplots_adjust(**adjust)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_ratios(rows: list[dict]):
    """Fill ``tflops`` and ``time_vs_sdpa_flash`` (method time / SDPA flash time on the same case and mode)."""
    flash = {tuple(r[c] for c in CASE_COLUMNS) + (r["mode"],): r["ms"]
             for r in rows if r["method"] == "sdpa" and r["backend"] == "flash" and r["status"] == OK}
    for r in rows:
        if r["status"] != OK:
            r["tflops"] = r["time_vs_sdpa_flash"] = None
            continue
        r["tflops"] = dense_flops(r["batch"], r["heads"], r["seq_q"], r["seq_k"], r["head_dim"], r["causal"],
                                  r["mode"]) / (r["ms"] * 1e-3) / 1e12
        base = flash.get(tuple(r[c] for c in CASE_COLUMNS) + (r["mode"],))
        r["time_vs_sdpa_flash"] = r["ms"] / base if base else float("nan")


def progress_line(row: dict) -> str:
    """One printed line per measured row."""
    return (f"[{row['group']}] {row['method']}:{row['backend']} a={row['alpha']} {row['mode']} B={row['batch']} "
            f"H={row['heads']} N={row['seq_q']} D={row['head_dim']} causal={row['causal']} "
            f"x{fmt(row['score_mult'])} -> {row['status']} {fmt(row.get('ms'))} ms {row.get('note', '')}")
