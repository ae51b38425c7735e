import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def one_rank_group():
    """A gloo process group of one rank in this process (FSDP2 and torch.distributed.checkpoint
    want one), unless the test process already has a group."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
