"""``import sparse_attn`` registers attn_implementation="entmax" with transformers, in either import order, without
importing transformers. Each case runs in a fresh interpreter (the registration happens once per process)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]

_BUILD = """
import torch
from transformers import AttentionInterface, AutoModel, LlamaConfig
config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16)
model = AutoModel.from_config(config, attn_implementation="entmax").eval()
assert model.config._attn_implementation == "entmax", model.config._attn_implementation
hf = sys.modules["sparse_attn.integrations.hf"]
assert AttentionInterface().get("entmax") is hf.entmax_attention_forward
with torch.no_grad():
    out = model(torch.tensor([[1, 2, 3, 4]])).last_hidden_state
assert out.shape == (1, 4, 32) and bool(torch.isfinite(out).all())
assert not any(isinstance(f, sparse_attn.integrations._RegisterAfterImport) for f in sys.meta_path)  # hook gone
mu = sys.modules["transformers.modeling_utils"]
assert "sparse_attn" not in type(mu.__loader__).__module__ and mu.__spec__.loader is mu.__loader__
print("REGISTERED")
"""


def _run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    res = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", textwrap.dedent(code)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return res


@pytest.mark.parametrize("first", [
    "import transformers",  # lazy: modeling_utils is not loaded yet, the import hook registers later
    "from transformers import LlamaConfig",
    "import transformers.models.llama.modeling_llama",
])
def test_import_sparse_attn_then_transformers_registers(first):
    res = _run(f"import sys\nimport sparse_attn\n{first}\n{_BUILD}")
    assert "REGISTERED" in res.stdout


@pytest.mark.parametrize("first", [
    "import transformers",  # lazy: sparse_attn installs the hook
    "from transformers import AutoModel",  # modeling_utils loaded: sparse_attn registers at once
])
def test_import_transformers_then_sparse_attn_registers(first):
    res = _run(f"import sys\n{first}\nimport sparse_attn\n{_BUILD}")
    assert "REGISTERED" in res.stdout


def test_import_sparse_attn_does_not_import_transformers():
    res = _run("""
        import sys
        import sparse_attn
        loaded = sorted(m for m in sys.modules if m == "transformers" or m.startswith("transformers."))
        assert not loaded, loaded
        assert "sparse_attn.integrations.hf" not in sys.modules
        hook = sparse_attn.integrations._RegisterAfterImport
        assert len([f for f in sys.meta_path if isinstance(f, hook)]) == 1, sys.meta_path
        import importlib
        importlib.reload(sparse_attn)  # a second registration request adds no second hook
        assert len([f for f in sys.meta_path if isinstance(f, hook)]) == 1, sys.meta_path
        print("CLEAN")
    """)
    assert "CLEAN" in res.stdout


def test_failed_registration_warns_and_transformers_error_names_it():
    """A transformers without what the integration needs (simulated: one masking helper removed) must not break
    transformers: the failure is a UserWarning, and asking for "entmax" then raises an error that says why."""
    res = _run("""
        import sys, warnings
        import sparse_attn
        import transformers.masking_utils as masking_utils
        del masking_utils.sliding_window_overlay
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from transformers import PreTrainedModel  # noqa: F401 - loads modeling_utils: the hook runs
        from transformers import AutoModel, LlamaConfig
        messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
        assert any("could not register attn_implementation='entmax'" in m and "sliding_window_overlay" in m
                   and "`import sparse_attn.integrations.hf` raises the full error" in m for m in messages), messages
        assert isinstance(sparse_attn.integrations.registration_error(), ImportError)
        assert "sparse_attn.integrations.hf" not in sys.modules
        config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1)
        try:
            AutoModel.from_config(config, attn_implementation="entmax")
        except ValueError as err:
            text = str(err)
            assert 'attn_implementation="entmax"` is not supported' in text, text
            assert "registration with transformers failed" in text and "sliding_window_overlay" in text, text
            assert "import sparse_attn.integrations.hf" in text, text
            assert isinstance(err.__cause__, ImportError)
        else:
            raise AssertionError("entmax was accepted without a registration")
        assert AutoModel.from_config(config, attn_implementation="sdpa").config._attn_implementation == "sdpa"
        print("EXPLAINED")
    """)
    assert "EXPLAINED" in res.stdout
