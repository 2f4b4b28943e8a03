"""Tensor-parallel serving check: the continuous-batching loop of examples/serve.py with
attention heads and MLP columns sharded across N processes (NCCL, one GPU each; gloo on CPU).
Every rank serves the same random requests; rank 0 then serves them again unsharded on its own
device with the same weights and asserts equal greedy outputs.

    torchrun --nproc-per-node 2 examples/serve_tp.py     # 2 GPUs (or any launcher setting RANK...)
    python examples/serve_tp.py --nproc 2                # spawns the processes itself (GPU or CPU)

The default dtype is float32 so that the sharded run's different summation order (the
all-reduce) cannot flip a greedy argmax; `--dtype bfloat16` measures the usual serving dtype.
"""

import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from serve import CPU_MODEL, GPU_MODEL, arg_parser, build, make_requests
from torch_ops.serving.engine import generate

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def serve(args, rank: int, world_size: int) -> None:
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    config = GPU_MODEL if cuda and not args.tiny else CPU_MODEL
    dtype = DTYPES[args.dtype]
    graphs = cuda and args.graphs

    engine = build(config, args.backend, device, dtype, args, graphs, tp_group=dist.group.WORLD)
    requests, arrivals = make_requests(args, config.vocab_size)
    dist.barrier()
    start = time.perf_counter()
    outputs = generate(engine, requests, arrivals)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    every_rank = [None] * world_size
    dist.all_gather_object(every_rank, outputs)
    if rank == 0:
        generated = sum(len(o) for o in outputs.values())
        print(f"tensor parallel: {world_size} ranks ({dist.get_backend()}), {device.type}, "
              f"{args.backend} backend, {args.dtype}, {config.num_layers} layers, {config.num_heads}/"
              f"{config.num_kv_heads} heads ({config.num_heads // world_size}/"
              f"{config.num_kv_heads // world_size} per rank), {len(requests)} requests: "
              f"{generated / elapsed:.1f} generated tokens/s ({elapsed:.2f} s)", flush=True)
        assert all(o == outputs for o in every_rank), "ranks disagree on the greedy outputs"
        single = build(config, args.backend, device, dtype, args, graphs)
        ref_requests, _ = make_requests(args, config.vocab_size)
        reference = generate(single, ref_requests, arrivals)
        same = sum(outputs[i] == reference[i] for i in outputs)
        print(f"check: {same}/{len(outputs)} requests have the same greedy output as the "
              f"single-device run", flush=True)
        if same != len(outputs):
            raise SystemExit("tensor-parallel greedy outputs differ from the single-device run")
    dist.barrier()


def spawned(rank: int, world_size: int, rendezvous: str, args) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        serve(args, rank, world_size)
    finally:
        dist.destroy_process_group()


def main():
    cuda = torch.cuda.is_available()
    parser = arg_parser(cuda, __doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="processes to spawn without torchrun")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--graphs", action="store_true",
                        help="CUDA-graph decode steps (NCCL all-reduces captured in the graphs)")
    parser.set_defaults(**({} if not cuda else dict(num_requests=64, max_prompt=256, max_new=64,
                                                    arrival_steps=50, num_blocks=4096)))
    args = parser.parse_args()
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("nccl" if cuda else "gloo")
        try:
            serve(args, dist.get_rank(), dist.get_world_size())
        finally:
            dist.destroy_process_group()
    else:
        if cuda and torch.cuda.device_count() < args.nproc:
            raise SystemExit(f"--nproc {args.nproc} needs as many GPUs, found {torch.cuda.device_count()}")
        with tempfile.TemporaryDirectory() as folder:   # a file store: no port to pick or collide on
            mp.spawn(spawned, args=(args.nproc, os.path.join(folder, "rendezvous"), args), nprocs=args.nproc,
                     join=True)


if __name__ == "__main__":
    main()
