"""Sharded LAMB (``optim.shard``): optimizer state and update split over a group of ranks.

FSDP2 (``fully_shard``) in DDP's place, per encoder layer; every per-tensor norm (LAMB's trust ratio, clipping, AdaGC)
is the whole tensor's, from one small all-reduce, so the update equals ``bert.optim.Lamb`` on whole tensors. How and
what it costs: [docs/sharding.md](../docs/sharding.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from bert.config import OptimSection
from bert.optim.optimizers import Lamb, param_groups_for
from common.errors import ConfigError

SHARD, REPLICATE = "shard", "replicate"  # the mesh's dimension names

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def shard_group_size(shard: str | int, world: int) -> int | None:
    """``optim.shard`` -> ranks per shard group (None: not sharded); ConfigError naming the field."""
    if shard == "none":
        return None
    if shard == "dp":
        return world
    if world % shard:
        raise ConfigError(f"optim.shard: a group of {shard} ranks does not divide the {world} ranks")
    return shard


def shard_model(model: nn.Module, mesh: DeviceMesh, compute_dtype: str = "fp32", reduce_dtype: str = "fp32") -> None:
    """Apply FSDP2 in place: one unit per encoder layer, the rest (embeddings, heads) in the root. ``compute_dtype``:
    of the all-gathered weights (the sharded masters stay fp32); ``reduce_dtype``: of the gradients' reduce-scatter.
    Weights stay gathered from forward to backward (one all-gather per layer per step, not two)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(
        param_dtype=_DTYPES[compute_dtype] if compute_dtype != "fp32" else None,
        reduce_dtype=_DTYPES[reduce_dtype],
        output_dtype=None,
        cast_forward_inputs=False,  # the batch holds integer ids only
    )
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)


def reshard(model: nn.Module) -> None:
    """Put every FSDP2 unit of ``model`` back into its sharded parameters, as a forward without backward (evaluation)
    leaves the whole tensors registered; call it after evaluation and before naming parameters (checkpoints)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def local_shard(t: Tensor) -> Tensor:
    """This rank's part of a DTensor (sharing its storage), a plain tensor as it is."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


class WholeNorms:
    """Whole-tensor L2 norms from local shards: one all-reduce of the partial sums of squares over ``group``, the shard
    group (None: the tensors are whole). Every rank of the group passes the shards of the same N tensors."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group

    def squares(self, tensors: list[Tensor]) -> Tensor:
        """[N] float32 partial sums of squares (an empty shard contributes 0)."""
        return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square()

    def reduce(self, squares: Tensor) -> Tensor:
        if self.group is not None:
            dist.all_reduce(squares, group=self.group)
        return squares.sqrt()

    def __call__(self, tensors: list[Tensor]) -> Tensor:
        return self.reduce(self.squares(tensors))


class ShardedLamb(Lamb):
    """``Lamb`` on DTensor parameters, the math on this rank's shards; moments are DTensors like their parameters.
    The trust ratio's two norms per tensor come from one all-reduce of a [2N] vector over the shard group."""

    def __init__(self, params, norms: WholeNorms, **kwargs):
        super().__init__(params, **kwargs)
        self.whole_norms = norms

    def _local(self, t: Tensor) -> Tensor:
        return local_shard(t)

    def _trust_norms(self, params: list[Tensor], update: list[Tensor]) -> tuple[Tensor, Tensor]:
        both = self.whole_norms.reduce(torch.cat([self.whole_norms.squares(params), self.whole_norms.squares(update)]))
        return both[: len(params)], both[len(params) :]  # [2N] split


@dataclass
class Sharding:
    """How the run is sharded (``apply_sharding``): the mesh, the ranks per shard group, and what the clippers need to
    see gradients as whole tensors (``bert.optim.clipping``'s ``local`` and ``norms`` arguments)."""

    mesh: DeviceMesh
    group_size: int
    norms: WholeNorms
    local = staticmethod(local_shard)


def apply_sharding(
    model: nn.Module, optim: OptimSection, precision: str, world: int, device_type: str
) -> Sharding | None:
    """``optim.shard`` applied to ``model`` in place (FSDP2 on the mesh it asks for); None for ``none``. ``precision``
    (``train.precision``) is the dtype of the gathered compute weights."""
    group = shard_group_size(optim.shard, world)
    if group is None:
        return None
    if group == world:  # one group spans the world: a 1-D mesh
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=(SHARD,))
    else:
        mesh = init_device_mesh(device_type, (world // group, group), mesh_dim_names=(REPLICATE, SHARD))
    shard_model(model, mesh, precision, optim.reduce_dtype)
    return Sharding(mesh, group, WholeNorms(mesh.get_group() if group == world else mesh[SHARD].get_group()))


def build_sharded_lamb(optim: OptimSection, model: nn.Module, sharding: Sharding) -> ShardedLamb:
    """``ShardedLamb`` with ``optim``'s hyperparameters over ``model`` (``apply_sharding``-ed), grouped as unsharded."""
    groups = param_groups_for(model, optim.weight_decay)
    return ShardedLamb(groups, sharding.norms, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer-state tensors held by this rank (a DTensor counts its local shard)."""
    tensors = (local_shard(v) for state in optimizer.state.values() for v in state.values() if isinstance(v, Tensor))
    return sum(t.numel() * t.element_size() for t in tensors)
