import os

import pytest

import thunder_tp.thunder_internals.quiet  # noqa: F401  (before any test imports Thunder: its transformer_engine warning filtered)


@pytest.fixture(scope="session", autouse=True)
def _dist_pools():
    """Stop the persistent gloo worker pools of tests/dist.py at the end of the session."""
    yield
    from tests import dist

    dist.shutdown_pools()


@pytest.fixture
def simulated_float64():
    """float64 as the default dtype for a test whose simulated ranks run in this process (the previous one after)."""
    import torch
    import torch.distributed as dist

    assert not dist.is_initialized(), "simulated ranks run in this process"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.fixture
def speedups_applied():
    """Thunder's speed-ups (thunder_internals.patches) for the plain ``thunder.jit`` compiles of a test."""
    from thunder_tp.thunder_internals import patches

    with patches.applied():
        yield


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``slow`` unless asked for (``-m slow`` or THUNDER_TP_SLOW=1), ``cuda`` ones without a GPU."""
    _skip_slow_unless_asked(config, items)
    _skip_cuda_without_gpu(items)


def _skip_slow_unless_asked(config, items) -> None:
    if os.environ.get("THUNDER_TP_SLOW") == "1" or config.getoption("-m"):  # an explicit -m selects by itself
        return
    skip = pytest.mark.skip(reason="slow: run with THUNDER_TP_SLOW=1 (or -m slow)")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


def _skip_cuda_without_gpu(items) -> None:
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in cuda_items:
        item.add_marker(skip)
