"""CI smoke of ``benchmarks/offline/sass_cost.py``, the static cost model of the forward's pass loops on sm_90.

The script builds real sm_90 kernels (``TRITON_INTERPRET=0``), so it runs in a subprocess: the test session
itself runs the kernels under the interpreter (tests/conftest.py).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "offline", "sass_cost.py")
_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
# the script builds this checkout's kernels, whichever copy of the package is installed
_ENV = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1",
            PYTHONPATH=os.pathsep.join([_ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))


def _run(args, timeout=300):
    proc = subprocess.run([sys.executable, *args], env=_ENV, capture_output=True, text=True, timeout=timeout)
    if "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("no ptxas in this triton install")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def test_smoke_finds_the_pass_loops(tmp_path):
    """Softmax and 1.5-entmax at head dim 64: the loops are found, their counts add up, and the grid pass costs
    more per key tile than the softmax loop (it adds 8 grid points of per-score work to one QK^T)."""
    out = tmp_path / "cost.json"
    stdout = _run([_SCRIPT, "--smoke", "--json", str(out)])
    assert "sass_cost: d64 non-causal entmax15: dense" in stdout
    builds = {b["cls"]: b for b in json.loads(out.read_text())["builds"]}
    assert set(builds) == {"softmax", "entmax15"}
    assert set(builds["softmax"]["loops"]) == {"softmax"}
    # the threshold and value passes skip the per-score mask on full tiles (their interior paths); the head-dim-64
    # softmax loop does not (docs/kernels.md, "Full tiles")
    assert set(builds["entmax15"]["loops"]) == {"grid", "grid_dead", "cand", "value", "grid_interior",
                                                "cand_interior", "value_interior"}
    for b in builds.values():
        assert b["info"]["spill"] == 0
        for name, lp in b["loops"].items():
            assert lp["cycles"] > 0, name
            assert lp["cycles"] == max(lp["bounds"].values()), name
            assert sum(lp["by_class"].values()) == lp["instructions"] == sum(lp["by_op"].values()), name
            assert lp["by_class"].get("unknown", 0) == 0, name
            # one key tile per iteration: the score product (and in two loops P V) of a 128 x 64 tile, d 64
            products = 2 if name.split("_")[0] in ("softmax", "value") else 1
            assert lp["tensor_macs"] == products * 128 * 64 * 64, name
    soft = builds["softmax"]["loops"]["softmax"]["cycles"]
    ent = builds["entmax15"]
    loops = ent["loops"]
    assert loops["grid"]["cycles"] > 2 * soft
    assert loops["grid_dead"]["instructions"] < loops["grid_interior"]["instructions"] < loops["grid"]["instructions"]
    for role in ("cand", "value"):  # a full tile issues fewer instructions than a boundary one
        assert loops[role + "_interior"]["instructions"] < loops[role]["instructions"], role
    assert ent["model"]["dense"] == pytest.approx(loops["grid_interior"]["cycles"] + loops["cand_interior"]["cycles"] +
                                                  loops["value_interior"]["cycles"])
    assert ent["model"]["ratio"] > ent["model"]["ratio_dead"][0] > ent["model"]["ratio_dead"][1] > 0


_SYNTHETIC = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import sass_cost as sc

    def program(limit):
        # a tile loop (header 0x10, latch 0x90) holding a skippable counted loop (0x40..0x70)
        text = [("", "MOV", "R1,RZ"), ("", "HGMMA.64x32x16.F32.BF16", "R88,gdesc[UR20],RZ"),
                ("@!P0", "BRA", "0x80"), ("", "MOV", "R2,RZ"), ("", "FADD", "R3,R3,R4"),
                ("", "IADD3", "R2,R2,0x1,RZ"), ("", "ISETP.NE.AND", f"P1,PT,R2,{limit},PT"),
                ("@P1", "BRA", "0x40"), ("", "FMUL", "R5,R5,R5"), ("@P2", "BRA", "0x10"), ("", "EXIT", "")]
        return [sc.Ins(16 * n, op, args, pred) for n, (pred, op, args) in enumerate(text)]

    ins = program("0x4")
    blocks = sc.blocks_of(ins)
    loops = sc.natural_loops(blocks)
    assert len(loops) == 2, loops
    outer = next(lp for lp in loops if lp.parent is None)
    assert [c.header for c in outer.children] == [next(lp.header for lp in loops if lp.parent)]
    assert sc.trip_count(blocks, outer.children[0], ins) == 4
    paths = sc.iteration_paths(blocks, outer, ins)
    assert len(paths["live"]) == 2 + 1 + 4 * 4 + 2, len(paths["live"])  # header, MOV, 4 x inner, FMUL + BRA
    assert len(paths["dead"]) == 2 + 2, len(paths["dead"])
    cnt = sc.count_path(ins, paths["live"], 4)
    assert cnt["by_class"]["fp32"] == 5 and cnt["macs"] == 64 * 32 * 16
    bad = program("R7")  # a trip count known only at run time: refused, not guessed
    blocks = sc.blocks_of(bad)
    outer = next(lp for lp in sc.natural_loops(blocks) if lp.parent is None)
    try:
        sc.iteration_paths(blocks, outer, bad)
    except sc.LoopError as exc:
        print("refused:", exc)
    else:
        raise AssertionError("a run-time trip count was accepted")
    # a TMA barrier wait nested in a tile loop (try-wait on an mbarrier, its phase moved into a register): once
    text = [("", "HGMMA.64x32x16.F32.BF16", "R88,gdesc[UR20],RZ"), ("", "IMAD.U32", "R14,RZ,RZ,UR40"),
            ("", "SYNCS.PHASECHK.TRANS64.TRYWAIT", "P5[UR41+0x14000],R14"), ("@!P5", "BRA", "0x10"),
            ("@P2", "BRA", "0x0"), ("", "EXIT", "")]
    wait = [sc.Ins(16 * n, op, args, pred) for n, (pred, op, args) in enumerate(text)]
    blocks = sc.blocks_of(wait)
    outer = next(lp for lp in sc.natural_loops(blocks) if lp.parent is None)
    assert sc.trip_count(blocks, outer.children[0], wait) == 1
    assert len(sc.iteration_paths(blocks, outer, wait)["live"]) == 5
    print("ok")
""")


def test_loop_finder_on_synthetic_sass():
    """Blocks, natural loops, a nested counted loop's trip count and the live / dead iteration paths on a
    hand-written instruction list; a nested loop with a run-time trip count fails loudly."""
    stdout = _run(["-c", _SYNTHETIC, os.path.dirname(_SCRIPT)], timeout=120)
    assert "refused:" in stdout and stdout.rstrip().endswith("ok"), stdout


def test_backward_smoke_finds_the_tile_loops(tmp_path):
    """``--bwd``: the dQ and dK/dV kernels' tile loops (and the dK/dV kernel with the atomic dQ) at head dim 64, for
    the softmax and 1.5-entmax classes: one loop per kernel doing one tile's products per iteration, all on the
    warpgroup MMA, the interior tile (no per-score mask) no longer than a boundary tile, the model's ratios."""
    out = tmp_path / "bwd.json"
    stdout = _run([_SCRIPT, "--bwd", "--smoke", "--nondet", "--json", str(out)])
    assert "sass_cost --bwd: d64 non-causal entmax15: " in stdout
    builds = json.loads(out.read_text())["builds"]
    assert {(b["cls"], b["deterministic"]) for b in builds} == {(c, d) for c in ("softmax", "entmax15")
                                                                for d in (True, False)}
    for b in builds:
        want = {"bwd_dq": 3, "bwd_dkdv": 4} if b["deterministic"] else {"bwd_dkdv+dq": 5}
        assert {name: k["info"]["kernel"] for name, k in b["kernels"].items()} == {n: n for n in want}
        for name, k in b["kernels"].items():
            assert k["info"]["hmma"] == 0 and k["info"]["hgmma"] > 0 and k["info"]["loop_ldst"] == 0, name
            block_m, block_n = (int(x) for x in k["info"]["block"].split("x"))
            loops = k["loops"]
            assert set(loops) == {"boundary", "interior"}
            for path in loops.values():
                assert path["tensor_macs"] == want[name] * block_m * block_n * 64, name
                assert path["cycles"] == max(path["bounds"].values()) > 0, name
            assert loops["interior"]["instructions"] <= loops["boundary"]["instructions"], name
        assert b["floor_ratio"] >= 1.0
        if b["cls"] == "softmax" and b["deterministic"]:
            assert b["ratio"] == pytest.approx(1.0)


def test_training_forward_value_loop(tmp_path):
    """``--train``: the training forward's value loop multiplies ``U V`` next to ``P V`` (the backward's ``out_u``),
    three products per key tile, bound by no less than the tensor cores; the softmax class's one loop keeps its two
    (it stores the unrounded output instead)."""
    out = tmp_path / "train.json"
    _run([_SCRIPT, "--smoke", "--train", "--json", str(out)])
    builds = {b["cls"]: b for b in json.loads(out.read_text())["builds"]}
    assert builds["softmax"]["loops"]["softmax"]["tensor_macs"] == 2 * 128 * 64 * 64
    value = builds["entmax15"]["loops"]["value"]
    assert value["tensor_macs"] == 3 * 128 * 64 * 64
    assert value["cycles"] >= value["bounds"]["tensor"] > 0
