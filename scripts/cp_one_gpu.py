"""Context parallelism on ONE GPU: W processes share the card over gloo (the exchange staged
through host memory) and run a long packed batch split W ways, against one process running it
whole. Needs no multi-GPU machine (issue 46's single-card tier).

    python scripts/cp_one_gpu.py                                   # gdn, 2 and 4 ranks, 64K and 256K tokens, bf16
    python scripts/cp_one_gpu.py --spec kda --worlds 2 --tokens 65536
    python scripts/cp_one_gpu.py --device cpu --tokens 96 --heads 1,2 --dims 16 --dtype float32 --repeat 1   # CPU check

The packed batch holds sequences of several lengths (`--lengths`, fractions of T: one crosses
every rank boundary, short ones start and end inside a rank). Every rank draws the same global
inputs from `--seed`, runs chunk(..., cp_context=) forward and backward on its T / W tokens with
initial and final states, and the outputs, final states and every gradient are gathered; the
whole batch then runs in one process through the same module. Printed per (W, T): the largest
relative error of each against the one-process run, each rank's peak device memory, and the
median milliseconds of `--repeat` more calls, forward (no gradients) and forward + backward, of
the slowest rank (every call started together) beside the one process's. The ranks share the
card, so these say what context parallelism costs on top of the same work, not how it scales.
JSON rows go to $OUT/cp_one_gpu.json (or /tmp).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# a sequence crossing every rank boundary between short ones, as fractions of the batch
DEFAULT_LENGTHS = "0.01,0.02,0.9,0.03,0.04"
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


def boundaries(T: int, fractions: list[float]) -> list[int]:
    """cu_seqlens of sequences with these shares of T (the last takes what rounding leaves)."""
    bounds, total = [0], sum(fractions)
    for f in fractions[:-1]:
        bounds.append(bounds[-1] + max(1, round(T * f / total)))
    bounds.append(T)
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise SystemExit(f"cp_one_gpu.py: --lengths {fractions} leave an empty sequence at T = {T}")
    return bounds


def inputs(rec, shape, bounds, dtype, device, seed):
    """q, k, v and the spec's inputs, initial states, d_o and d_ht: the same on every rank."""
    from lrdsl.verification.workloads import make_inputs

    generator = torch.Generator().manual_seed(seed)
    tensors = [t.to(device) for t in make_inputs(rec, shape, dtype=dtype, generator=generator)]
    N = len(bounds) - 1
    h0 = torch.randn(N, shape.HV, shape.K, shape.V, generator=generator).to(device)
    d_o = torch.randn(1, shape.T, shape.HV, shape.V, generator=generator).to(device, dtype)
    d_ht = torch.randn(N, shape.HV, shape.K, shape.V, generator=generator).to(device)
    return tensors, h0, d_o, d_ht


def rows_per_token(rec):
    """Rows each of q, k, v and the spec's inputs holds per token (0: a per-head input)."""
    steps = rec.steps_per_token
    return [1, steps, steps] + [rec.rows_per_token(i) if i.role.per_token else 0 for i in rec.inputs]


def rank_main(rank, world, init, args, shape, bounds, out):
    import lrdsl
    from lrdsl.distributed import build_cp_context
    from lrdsl.passes.pipeline import run_pipeline
    from lrdsl.spec import load_spec_by_name

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    if args.device == "cuda":
        torch.cuda.set_device(0)  # every rank on the one card
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    try:
        mod = lrdsl.load(args.spec)
        rec = run_pipeline(load_spec_by_name(args.spec), until="recurrence")["recurrence"]
        dtype = getattr(torch, args.dtype)
        tensors, h0, d_o, d_ht = inputs(rec, shape, bounds, dtype, args.device, args.seed)
        ctx = build_cp_context(torch.tensor(bounds, dtype=torch.int32, device=args.device), group=None)
        lo, hi = rank * ctx.num_tokens, (rank + 1) * ctx.num_tokens
        leaves = [(t if rows == 0 else t[:, lo * rows:hi * rows]).clone().requires_grad_()
                  for t, rows in zip(tensors, rows_per_token(rec))]
        mine = h0[list(ctx.initial_state_ids)].clone().requires_grad_()
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()

        def step(backward):
            o, ht = mod.chunk(*leaves, initial_state=mine, output_final_state=True, cp_context=ctx)
            if backward:
                ((o.float() * d_o[:, lo:hi].float()).sum() + (ht * d_ht[list(ctx.final_state_ids)]).sum()).backward()
            return o, ht

        o, ht = step(backward=True)
        peak = torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else None
        result = dict(o=o.detach().cpu(), ht=ht.detach().cpu(), grads=[t.grad.cpu() for t in leaves],
                      d_h0=mine.grad.cpu(), initial_ids=ctx.initial_state_ids, final_ids=ctx.final_state_ids,
                      peak_mib=peak)
        with torch.no_grad():
            result["forward_ms"] = timed(lambda: step(backward=False), args.repeat, args.device, barrier=True)
        result["forward_backward_ms"] = timed(lambda: step(backward=True), args.repeat, args.device, barrier=True)
        torch.save(result, os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def timed(run, repeat, device, barrier=False):
    """Median wall milliseconds of run() over `repeat` calls (None for none), each started together
    on every rank (barrier) and ended when the device is idle."""
    if not repeat:
        return None
    times = []
    for _ in range(repeat):
        if barrier:
            dist.barrier()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def one_process(args, shape, bounds):
    """(o, ht, grads, d_h0) of the whole batch in one call, on the host."""
    import lrdsl
    from lrdsl.passes.pipeline import run_pipeline
    from lrdsl.spec import load_spec_by_name

    mod = lrdsl.load(args.spec)
    rec = run_pipeline(load_spec_by_name(args.spec), until="recurrence")["recurrence"]
    tensors, h0, d_o, d_ht = inputs(rec, shape, bounds, getattr(torch, args.dtype), args.device, args.seed)
    leaves = [t.clone().requires_grad_() for t in tensors]
    h = h0.clone().requires_grad_()
    cu = torch.tensor(bounds, dtype=torch.int32, device=args.device)

    def step(backward):
        o, ht = mod.chunk(*leaves, initial_state=h, output_final_state=True, cu_seqlens=cu)
        if backward:
            ((o.float() * d_o.float()).sum() + (ht * d_ht).sum()).backward()
        return o, ht

    o, ht = step(backward=True)
    result = (rec, o.detach().cpu(), ht.detach().cpu(), [t.grad.cpu() for t in leaves], h.grad.cpu())
    with torch.no_grad():
        forward_ms = timed(lambda: step(backward=False), args.repeat, args.device)
    return result, (forward_ms, timed(lambda: step(backward=True), args.repeat, args.device))


def compare(rec, ranks, whole):
    """{name: relative error} of the gathered ranks against the one-process run."""
    from lrdsl.verification.workloads import relative_error

    _, o, ht, grads, d_h0 = whole
    errors = {"o": relative_error(torch.cat([r["o"] for r in ranks], dim=1).float(), o.float())}
    mine_ht, mine_d_h0 = torch.zeros_like(ht), torch.zeros_like(d_h0)
    for r in ranks:
        mine_ht[list(r["final_ids"])] = r["ht"]
        mine_d_h0[list(r["initial_ids"])] = r["d_h0"]
    errors.update(ht=relative_error(mine_ht, ht), d_h0=relative_error(mine_d_h0, d_h0))
    names = ["q", "k", "v"] + [i.name for i in rec.inputs]
    for i, (name, rows) in enumerate(zip(names, rows_per_token(rec))):
        parts = [r["grads"][i] for r in ranks]
        mine = sum(parts) if rows == 0 else torch.cat(parts, dim=1)
        errors[f"d_{name}"] = relative_error(mine.float(), grads[i].float())
    return errors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="gdn")
    parser.add_argument("--worlds", default="2,4", help="numbers of ranks sharing the device")
    parser.add_argument("--tokens", default="65536,262144", help="tokens of the packed batch")
    parser.add_argument("--heads", default="4,8", help="H,HV")
    parser.add_argument("--dims", type=int, default=128, help="K = V")
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help="the sequences' shares of the batch")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=5,
                        help="timed calls after the checked one (median; 0: no timing)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("cp_one_gpu.py: needs a GPU; run it with --device cpu --tokens 96 --heads 1,2 --dims 16 "
              "--dtype float32 --repeat 1 on a CPU", file=sys.stderr)
        return 2
    from lrdsl import config
    from lrdsl.verification.workloads import Shape

    if args.device == "cpu":
        config.use_interpreter_without_gpu()
    H, HV = (int(x) for x in args.heads.split(","))
    fractions = [float(x) for x in args.lengths.split(",")]
    rows, worst = [], 0.0
    for T in (int(x) for x in args.tokens.split(",")):
        bounds = boundaries(T, fractions)
        shape = Shape(1, T, H, HV, args.dims, args.dims)
        whole = whole_ms = None
        for world in (int(x) for x in args.worlds.split(",")):
            if T % world:
                raise SystemExit(f"cp_one_gpu.py: {T} tokens do not split over {world} ranks")
            with tempfile.TemporaryDirectory() as out:
                mp.start_processes(rank_main, args=(world, f"tcp://127.0.0.1:{free_port()}", args, shape, bounds, out),
                                   nprocs=world, start_method="spawn")
                ranks = [torch.load(os.path.join(out, f"{r}.pt")) for r in range(world)]
            if whole is None:
                whole, whole_ms = one_process(args, shape, bounds)
            errors = compare(whole[0], ranks, whole)
            peaks = [r["peak_mib"] for r in ranks]
            largest = max(errors, key=errors.get)
            worst = max(worst, errors[largest])
            # the slowest rank's median: the call ends when its last rank does
            ms = {kind: max((r[kind] for r in ranks), default=None) if args.repeat else None
                  for kind in ("forward_ms", "forward_backward_ms")}
            print(f"{args.spec} {args.dtype} T={T} H/HV={H}/{HV} K=V={args.dims} on {world} ranks: "
                  f"largest relative error vs one process {errors[largest]:.1e} ({largest}); "
                  f"peak MiB per rank {[round(p) for p in peaks] if peaks[0] is not None else '-'}"
                  + (f"; ms forward {ms['forward_ms']:.2f} (one process {whole_ms[0]:.2f}), forward + backward "
                     f"{ms['forward_backward_ms']:.2f} ({whole_ms[1]:.2f})" if args.repeat else ""))
            rows.append(dict(spec=args.spec, dtype=args.dtype, T=T, H=H, HV=HV, K=args.dims, world=world,
                             cu_seqlens=bounds, errors=errors, peak_mib=peaks, **ms,
                             one_process_forward_ms=whole_ms[0], one_process_forward_backward_ms=whole_ms[1]))
    path = os.path.join(os.environ.get("OUT", tempfile.gettempdir()), "cp_one_gpu.json")
    with open(path, "w") as handle:
        json.dump(rows, handle, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
