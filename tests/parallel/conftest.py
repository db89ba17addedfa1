import pytest
import torch


@pytest.fixture(autouse=True)
def restore_torch_threads():
    """Rank 0 of a CPU group gives itself its share of the cores (parallel/group.py); the tests
    after these run with the process's own thread count again."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
