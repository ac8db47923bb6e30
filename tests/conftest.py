import pytest


@pytest.fixture(scope="session", autouse=True)
def _dist_pools():
    """Stop the persistent gloo worker pools of tests/dist.py at the end of the session."""
    yield
    from tests import dist

    dist.shutdown_pools()


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``cuda`` when no CUDA GPU is available."""
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in cuda_items:
        item.add_marker(skip)
