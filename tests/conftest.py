import os

# Tests never touch the network: any accidental hub call fails fast instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

from evaluate.models.random_models import build_tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()
