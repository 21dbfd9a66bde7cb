"""Runners of the native PyTorch side: tensor parallelism with
`parallelize_module`, `DistributedDataParallel`, or the module alone
(`native_local_*`); eager or `torch.compile`d."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_counting import count_collectives
from bench_counting import ideal_collectives
from bench_counting import ideal_state_bytes
from bench_counting import local_bytes
from bench_models import keras_tp_layouts
from bench_models import native_module
from bench_runner import Runner
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.parallel import RowwiseParallel
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel

NATIVE_TP_PLANS = {
    "mlp": {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()},
    "transformer": {
        "attn.qkv": ColwiseParallel(),
        "attn.out": RowwiseParallel(),
        "fc1": ColwiseParallel(),
        "fc2": RowwiseParallel(),
    },
}


def native_runner(kind, impl, shapes, ref, data, ctx, args, device):
    """A runner of native tensor parallelism or DDP, eager or compiled, or
    of the module alone (`native_local_*`)."""
    world_size = dist.get_world_size()
    module = native_module(kind, ref, shapes, device)
    x, y = data
    tp = impl.startswith("native_tp")
    ddp = impl.startswith("native_ddp")
    if tp:
        mesh = init_device_mesh(
            device.type, (world_size,), mesh_dim_names=("model",)
        )
        model = parallelize_module(module, mesh, NATIVE_TP_PLANS[kind])
    elif not ddp:
        model = module
    else:
        model = _ddp(module, device)
        # DDP: each rank trains on its part of the global batch.
        rank = dist.get_rank()
        x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)

    def train_step():
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    compiled = impl.endswith("_compile")
    notes = []
    # Static shapes: with automatic dynamic shapes, torch 2.13 fails to
    # trace the DTensor backward of the TP step once it recompiles.
    fn = [torch.compile(train_step, dynamic=False) if compiled else train_step]

    def step():
        with ctx():
            if not notes and compiled:
                return _first_compiled_call(fn, train_step, notes)
            return fn[0]()

    def count():
        if not ddp:
            with ctx():
                result = count_collectives(train_step, [model])
                opt = count_collectives(optimizer.step, [model])
            result["optimizer_alone"] = opt["total"]
            return result
        return ddp_collectives(kind, ref, shapes, device, (x, y), ctx)

    def state_bytes():
        state = [
            t
            for s in optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        ]
        return local_bytes(list(model.parameters()) + state)

    return Runner(
        kind,
        impl,
        step,
        activate=lambda: None,
        count=None if compiled else count,
        state_bytes=state_bytes,
        ideal_collectives=ideal_collectives(kind, impl, ref),
        ideal_bytes=ideal_state_bytes(
            ref, keras_tp_layouts(kind), tp, world_size
        ),
        loss_fn=_global_mean if ddp else float,
        notes=notes,
    )


def _first_compiled_call(fn, eager_step, notes):
    """Runs the first compiled step; falls back to eager if it fails."""
    try:
        result = fn[0]()
        notes.append("torch.compile(train_step, dynamic=False)")
        return result
    except Exception as e:  # torch.compile raises errors of many types.
        notes.append(
            "torch.compile failed, eager instead: "
            f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
        )
        fn[0] = eager_step
        return eager_step()


def _ddp(module, device):
    """DDP with its default buckets: 25 MiB, the first 1 MiB.

    (Passing `bucket_cap_mb=25` would make the first bucket 25 MiB too:
    torch applies its small first bucket only to the default.)
    """
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids)


def _global_mean(loss):
    """Mean of the ranks' losses: the global batch's loss (equal parts)."""
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return float(loss) / dist.get_world_size()


def ddp_collectives(kind, ref, shapes, device, data, ctx):
    """DDP's all-reduces per step, counted with a comm hook.

    `CommDebugMode` cannot see them: DDP's reducer calls the process group
    from C++. A twin DDP module (same model, same bucket size) gets a comm
    hook that counts the buckets it all-reduces (then all-reduces them as
    DDP's default does). DDP rebuilds its buckets after the first step, so
    the third step is counted.
    """
    twin = _ddp(native_module(kind, ref, shapes, device), device)
    calls = []

    def hook(state, bucket):
        calls.append(bucket.buffer().numel())
        return default_hooks.allreduce_hook(state, bucket)

    twin.register_comm_hook(None, hook)
    x, y = data
    with ctx():
        for _ in range(3):
            calls.clear()
            twin.zero_grad(set_to_none=True)
            F.mse_loss(twin(x), y).backward()
    return {
        "total": len(calls),
        "forward": 0,
        "backward": len(calls),
        "ops": {"ddp_bucket_allreduce": len(calls)},
        "bucket_elements": list(calls),
        "optimizer_alone": 0,
    }
