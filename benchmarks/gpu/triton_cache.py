"""The Triton kernel cache that ``precompile.py`` fills offline and ``headline.py`` reads on the GPU: the folder,
its manifest, the per-process compile-event log and its summary.

``precompile.py`` builds the cache (and imports ``headline.py`` for the launches it replays); ``headline.py`` only
reads and logs, through this module, so neither imports the other's caller.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / ".triton-sm90"
MANIFEST = "manifest.json"
# a folder: each process with this set in its environment appends its compile events to <folder>/<pid>.jsonl
LOG_ENV = "SPARSE_ATTN_COMPILE_LOG"
KEEP_SUFFIXES = (".json", ".cubin")


def kernels_digest() -> str:
    """sha256 of the kernel sources (``kernels/**/*.py``): the JIT key hashes them, line numbers included."""
    h = hashlib.sha256()
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        h.update(path.relative_to(ROOT / "kernels").as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def groups(cache: Path) -> list[Path]:
    """The ``__grp__*.json`` files of a Triton cache folder (one per compiled kernel)."""
    return sorted(cache.glob("*/__grp__*.json")) if cache.is_dir() else []


def rewrite_group(grp: Path, keep=None) -> None:
    """Point ``grp``'s children at the files beside it (those that exist, and of ``keep``'s suffixes if given)."""
    children = json.loads(grp.read_text())["child_paths"]
    kept = {name: str(grp.parent / name) for name in children
            if (grp.parent / name).exists() and (keep is None or name.endswith(keep))}
    grp.write_text(json.dumps({"child_paths": kept}))


def prune(cache: Path) -> None:
    """Keep only the binary and metadata of each entry: the rest (source and IRs) is never read by a launch."""
    for sub in cache.iterdir() if cache.is_dir() else []:
        if not sub.is_dir():
            continue
        listed = set()
        for grp in sub.glob("__grp__*.json"):
            rewrite_group(grp, KEEP_SUFFIXES)
            listed.update(json.loads(grp.read_text())["child_paths"])
        for f in sub.iterdir():
            if f.is_dir():
                shutil.rmtree(f)  # a temporary folder of an interrupted write
            elif not f.name.startswith("__grp__") and f.name not in listed:
                f.unlink()


def install(src: Path, dest: Path) -> int:
    """Copy the cache ``src`` into ``dest`` (or fix it in place when they are one folder) with every group's paths
    pointing into ``dest``; returns the number of kernels."""
    dest.mkdir(parents=True, exist_ok=True)
    same = src.resolve() == dest.resolve()
    n = 0
    for grp in groups(src):
        sub = dest / grp.parent.name
        if not same:
            sub.mkdir(exist_ok=True)
            for f in grp.parent.iterdir():
                if f.is_file():
                    shutil.copy2(f, sub / f.name)
        rewrite_group(sub / grp.name)
        n += 1
    if not same and (src / MANIFEST).exists():
        shutil.copy2(src / MANIFEST, dest / MANIFEST)
    return n


def folder_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def read_manifest(cache: Path) -> dict | None:
    try:
        return json.loads((cache / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _plain(value):
    if type(value).__name__ == "constexpr":  # an element of a tuple argument
        value = value.value
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def compile_event(src, metadata: dict, metadata_group: dict, cache_hit: bool, times) -> dict:
    """One compile (or cache load) reported by ``triton.knobs.compilation.listener``, as plain JSON."""
    names = list(getattr(getattr(src, "fn", None), "arg_names", []))

    def name(path):
        if not path or path[0] >= len(names):
            return str(path)
        return names[path[0]] + "".join(f"[{i}]" for i in path[1:])

    try:
        seconds = times.total / 1e6
    except AttributeError:  # an older CompileTimes
        seconds = None
    return {
        "kernel": metadata.get("name"), "hash": metadata.get("hash"), "cache_hit": bool(cache_hit),
        "dir": Path(next(iter(metadata_group.values()))).parent.name if metadata_group else None,
        "num_warps": metadata.get("num_warps"), "num_stages": metadata.get("num_stages"),
        "shared": metadata.get("shared"), "compile_s": None if cache_hit else seconds,
        "constexprs": {name(p): _plain(v) for p, v in sorted(getattr(src, "constants", {}).items())},
        "div16": sorted(name(p) for p, attr in getattr(src, "attrs", {}).items() if "tt.divisibility" in str(attr)),
    }


def record_compiles(sink) -> None:
    """Send every compile of this process (hit or miss of the disk cache) to ``sink(event)``: Triton's compilation
    listener (the same knob in triton 3.6 and 3.9)."""
    import triton

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        sink(compile_event(src, metadata, metadata_group, cache_hit, times))

    triton.knobs.compilation.listener = listener


def log_compiles_to(folder: str | os.PathLike) -> None:
    """Append this process's compile events to ``folder/<pid>.jsonl`` (a warm-up process of ``headline.py``)."""
    path = Path(folder) / f"{os.getpid()}.jsonl"

    def sink(event):
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")

    record_compiles(sink)


def read_events(folder: Path) -> list[dict]:
    return [json.loads(line) for p in sorted(Path(folder).glob("*.jsonl")) for line in p.read_text().splitlines()
            if line.strip()]


def summarize(events: list[dict], manifest: dict | None) -> dict:
    """Distinct kernels loaded from the cache and compiled, per kernel name, and against the shipped manifest."""
    hit = {e["hash"]: e for e in events if e["cache_hit"]}
    miss = {e["hash"]: e for e in events if not e["cache_hit"]}
    per_kernel: dict[str, list[int]] = {}
    for e in {**hit, **miss}.values():
        per_kernel.setdefault(e["kernel"], [0, 0])[0 if e["hash"] not in miss else 1] += 1
    out = {"kernels": len(hit.keys() | miss.keys()), "compiled": len(miss), "loaded": len(hit.keys() - miss.keys()),
           "compile_s": round(sum(e["compile_s"] or 0.0 for e in miss.values()), 1), "per_kernel": per_kernel}
    if manifest is not None:
        shipped = {k["hash"] for k in manifest.get("kernels", [])}
        out["shipped"] = len(shipped)
        out["shipped_used"] = len(shipped & hit.keys())
        out["shipped_unused"] = len(shipped - hit.keys())
    return out


def summary_line(summary: dict) -> str:
    """One log line: distinct kernels, how many came from the cache, per kernel name ``loaded/compiled``."""
    line = (f"Triton cache: {summary['kernels']} distinct kernels, {summary['loaded']} loaded from the cache, "
            f"{summary['compiled']} compiled ({summary['compile_s']:.1f} s of compiling)")
    if "shipped" in summary:
        line += (f"; shipped cache: {summary['shipped']} kernels, {summary['shipped_used']} used, "
                 f"{summary['shipped_unused']} not used")
    per = summary["per_kernel"]
    if per:
        line += "; per kernel (loaded/compiled): " + ", ".join(f"{k} {h}/{m}" for k, (h, m) in sorted(per.items()))
    return line


def key_digest() -> str:
    """sha256 of this process's ``triton_key()`` (Triton's version and the hashes of its compiler and libtriton)."""
    import triton.runtime.cache as cache

    return hashlib.sha256(cache.triton_key().encode()).hexdigest()


def shipped_cache_line(cache: Path) -> str:
    """Whether the cache folder holds a shipped build that this machine's Triton and kernel sources can use."""
    manifest = read_manifest(cache)
    if manifest is None:
        return f"shipped cache: none ({cache / MANIFEST} missing)"
    import triton

    line = (f"shipped cache: {len(manifest.get('kernels', []))} kernels built for triton {manifest.get('triton')} "
            f"({manifest.get('built_for')}) at commit {str(manifest.get('commit'))[:12]}; this machine: triton "
            f"{triton.__version__}, key {'matches' if key_digest() == manifest.get('triton_key_sha256') else 'DIFFERS'}"
            f", kernel sources {'match' if kernels_digest() == manifest.get('kernels_sha256') else 'DIFFER'}")
    from triton._C.libtriton import get_cache_invalidating_env_vars

    env = get_cache_invalidating_env_vars()
    return line + (f", cache-invalidating environment {env}" if env else "")
