import os

import pytest
import torch

from tests.helpers import checkpoints

# Tests are sized for a 2-core machine; keep torch from oversubscribing it.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    return checkpoints.qwen3_moe(tmp_path_factory.mktemp("qwen3_moe"))


@pytest.fixture(scope="session")
def mixtral_dir(tmp_path_factory):
    return checkpoints.mixtral(tmp_path_factory.mktemp("mixtral"))
