"""Every ```python block of README.md runs on its own, as a user would paste it into a script.

Each block is written to a file in a fresh temporary folder and run there by a new interpreter
(``sys.executable``) with the test session's environment minus ``TRITON_INTERPRET`` (a block
that needs the Triton interpreter sets it itself, before importing Triton). A block passes when
the script exits with status 0 within ``TIMEOUT_S`` seconds.

Marker: a block whose first line is exactly ``# needs a CUDA GPU`` is skipped on a machine
without CUDA. No other block is skipped or expected to fail.
"""

import os
import subprocess
import sys
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
