import os

# Tests never touch the network: any accidental hub call fails fast instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# kvpress wraps every attention function registered when it is imported, and evaluate/engine/decoding.py's
# pool_attention does not take the wrapper's positional dropout: kvpress must come first. The CLI imports it first
# (evaluate.spec.config); a test module that imports the engine before any press did not, once the benchmarks took
# ConfigError from evaluate.errors. TODO(engine): decoding.py should import kvpress before it registers.
import kvpress  # noqa: E402, F401
import pytest  # noqa: E402

from evaluate.models.sources import build_tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()
