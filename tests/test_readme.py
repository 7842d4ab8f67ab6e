"""Every ```python block of README.md runs on its own, as a user would paste it into a script.

Each block is written to a file in a fresh temporary folder and run there by a new interpreter
(``sys.executable``) with the test session's environment minus ``TRITON_INTERPRET`` (a block
that needs the Triton interpreter sets it itself, before importing Triton). A block passes when
the script exits with status 0 within ``TIMEOUT_S`` seconds.

Marker: a block whose first line is exactly ``# needs a CUDA GPU`` is skipped on a machine
without CUDA. No other block is skipped or expected to fail.
"""

import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
GPU_MARKER = "# needs a CUDA GPU"
TIMEOUT_S = 600


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(first line number, code)`` of each fenced block opened by a line that is exactly ```python."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = i + 1
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            if end == len(lines):
                raise ValueError(f"README.md:{i + 1}: ```python block is never closed")
            blocks.append((i + 2, "\n".join(lines[i + 1:end]) + "\n"))
            i = end
        i += 1
    return blocks


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def test_block_extraction():
    assert BLOCKS, "README.md has no ```python block"
    text = "x\n```python\na = 1\n```\n```bash\nls\n```\n```python\n# needs a CUDA GPU\nb = 2\n```\n"
    assert python_blocks(text) == [(3, "a = 1\n"), (9, "# needs a CUDA GPU\nb = 2\n")]
    with pytest.raises(ValueError, match="README.md:2: ```python block is never closed"):
        python_blocks("x\n```python\na = 1\n")


@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_block_runs(line, code, tmp_path):
    if code.splitlines()[0].strip() == GPU_MARKER and not torch.cuda.is_available():
        pytest.skip(f"README.md:{line} is marked {GPU_MARKER!r}")
    script = tmp_path / f"readme_line_{line}.py"
    script.write_text(code, encoding="utf-8")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    try:
        res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"README.md:{line}: the block ran longer than {TIMEOUT_S} s")
    assert res.returncode == 0, (
        f"README.md:{line}: the block exits with status {res.returncode}\n{res.stderr[-3000:]}")


def bash_commands(text: str) -> list[tuple[int, str]]:
    """``(line number, command)`` of every non-empty, non-comment line of the ```bash blocks, comments stripped."""
    lines, out, inside = text.splitlines(), [], False
    for i, line in enumerate(lines, 1):
        if line.strip() == "```bash":
            inside = True
        elif inside and line.strip() == "```":
            inside = False
        elif inside and line.split("#", 1)[0].strip():
            out.append((i, line.split("  #", 1)[0].split(" # ", 1)[0].strip()))
    return out


COMMANDS = bash_commands(README.read_text(encoding="utf-8"))
ROOT = README.parent


def test_bash_commands_are_make_targets_or_venv_scripts():
    """Every shell command is typed as a user runs it from the repository root: a make target or the venv's python."""
    assert COMMANDS
    for line, cmd in COMMANDS:
        assert cmd.startswith(("make ", ".venv/bin/python ")), f"README.md:{line}: {cmd!r}"


@pytest.mark.parametrize("line,cmd", COMMANDS, ids=[f"README.md:{line}" for line, _ in COMMANDS])
def test_bash_command_is_runnable_as_typed(line, cmd):
    """Make targets exist (``make -n`` dry run); a script exists and accepts every option the line gives it (its
    ``--help`` lists them). The commands themselves take minutes (training, the benchmark grid) or a GPU; the quick
    ones run in their own tests (test_demo, test_bench_smoke, test_sparsify)."""
    words = cmd.split()
    if words[0] == "make":
        res = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, f"README.md:{line}: {cmd!r}: {res.stderr.strip()}"
        return
    script = ROOT / words[1]
    assert script.is_file(), f"README.md:{line}: {words[1]} does not exist"
    helps = _helps()
    assert script in helps, f"README.md:{line}: {words[1]} --help was not run"
    code, text, err = helps[script]
    assert code in (0, None), f"{script.name} --help failed: {err}"
    forwarded = re.search(r"other options go to (\w+\.py)", text)
    if forwarded:  # a wrapper (demo.py) passing the rest on to another script
        text += helps[script.parent / forwarded.group(1)][1]
    for opt in (w.split("=", 1)[0] for w in words[2:] if w.startswith("--")):
        assert opt in text, f"README.md:{line}: {words[1]} has no option {opt}"


# Runs each script as ``python SCRIPT --help`` would (``runpy`` as ``__main__``, argv ``[SCRIPT, "--help"]``), all in
# one interpreter: the imports (torch, transformers) are paid once instead of once per script. A script whose help
# forwards options to a sibling ("other options go to X.py") queues the sibling. Writes {script: [exit code,
# stdout, stderr tail]} as JSON to the path given first.
_HELP_DRIVER = r"""
import contextlib, io, json, re, runpy, sys
from pathlib import Path
out_path, todo, helps = sys.argv[1], [Path(p) for p in sys.argv[2:]], {}
while todo:
    script = todo.pop(0)
    if str(script) in helps:
        continue
    out, err, saved = io.StringIO(), io.StringIO(), (sys.argv, list(sys.path))
    sys.argv, code = [str(script), "--help"], None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except Exception as exc:  # reported by the test that reads it
        code, err = 1, io.StringIO(err.getvalue() + repr(exc))
    finally:
        sys.argv, sys.path[:] = saved
    helps[str(script)] = [code, out.getvalue(), err.getvalue()[-800:]]
    forwarded = re.search(r"other options go to (\w+\.py)", out.getvalue())
    if forwarded:
        todo.append(script.parent / forwarded.group(1))
Path(out_path).write_text(json.dumps(helps))
"""


@functools.cache
def _helps() -> dict:
    """``{script: (exit code, --help text, stderr tail)}`` of every script the README's shell lines call."""
    scripts = sorted({str(ROOT / cmd.split()[1]) for _, cmd in COMMANDS if not cmd.startswith("make ")
                      and (ROOT / cmd.split()[1]).is_file()})
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "helps.json"
        res = subprocess.run([sys.executable, "-c", _HELP_DRIVER, str(out), *scripts], cwd=ROOT, capture_output=True,
                             text=True, timeout=600, env=env)
        assert res.returncode == 0 and out.is_file(), f"the --help driver failed: {res.stderr[-2000:]}"
        return {Path(k): tuple(v) for k, v in json.loads(out.read_text()).items()}
