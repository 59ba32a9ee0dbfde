"""Benchmark: offload + onload throughput, and one actor <-> critic switch.

Run: ``uv run --frozen python bench/bench_lifecycle.py [--param-gib 1.0] [--repeats 2]``.

1. A model with about ``--param-gib`` GiB of fp32 parameters plus its Adam state
   (two moments: about 3x that in all) sleeps and wakes through ``OffloadManager``
   (host-copy backend, the default). Its achieved bytes/s is compared with a plain
   ``copy_`` of the very same bytes (same tensors, preallocated destination, same run):
   ``ratio = plain_time / lifecycle_time``, target >= 0.7. Best of ``--repeats``.
   On a CPU "device" the release is real (``storage.resize_(0)``), so waking pays for
   fresh pages; a second line shows ``copy_`` into freshly allocated memory both
   ways, the floor such a release can reach on this machine (page faults).
2. One full switch for the default tiny model (Qwen2, 2 layers, hidden 64, built with
   transformers): actor ``sleep(KEEP_GRADIENTS)`` + critic ``wake_up()``, then back.

If the machine lacks memory for 1 GiB of parameters (about 3x for the model plus
the same again for host copies), the size shrinks so that parameters plus Adam total
1 GiB, and the table says so.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

# Large CPU allocations get transparent huge pages (fewer page faults on wake-up).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch
from ppo_lifecycle import ALL_PARTS, KEEP_GRADIENTS, HostCopyBackend, OffloadManager
from torch import nn

GIB = 2**30


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def _big_model(param_bytes: int, device: torch.device) -> tuple[nn.Module, torch.optim.Adam]:
    """Square fp32 linear layers totalling ``param_bytes``, with Adam state from one step."""
    width = 4096
    layers = max(1, round(param_bytes / (width * width * 4)))
    model = nn.Sequential(
        *[
            nn.utils.skip_init(nn.Linear, width, width, bias=False, device=device)  # type: ignore[no-untyped-call]
            for _ in range(layers)
        ]
    )
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _plain_copy_times(
    tensors: list[torch.Tensor], device: torch.device, repeats: int, *, fresh: bool
) -> tuple[float, float]:
    """Best out / in times of ``copy_`` of the same bytes to host buffers and back."""
    pin = device.type == "cuda"
    hosts = [] if fresh else [torch.empty_like(t, device="cpu", pin_memory=pin) for t in tensors]
    if not fresh:
        for h, t in zip(hosts, tensors, strict=True):  # warm the destination pages
            h.copy_(t)
    outs, ins = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        if fresh:
            hosts = [torch.empty_like(t, device="cpu", pin_memory=pin) for t in tensors]
        for h, t in zip(hosts, tensors, strict=True):
            h.copy_(t, non_blocking=pin)
        _sync(device)
        t1 = time.perf_counter()
        for h, t in zip(hosts, tensors, strict=True):
            if fresh:  # into newly allocated device memory, as after a real release
                torch.empty_like(t).copy_(h)
            else:
                t.copy_(h, non_blocking=pin)
        _sync(device)
        t2 = time.perf_counter()
        outs.append(t1 - t0)
        ins.append(t2 - t1)
    del hosts
    gc.collect()
    return min(outs), min(ins)


def _lifecycle_times(
    manager: OffloadManager, device: torch.device, repeats: int
) -> tuple[float, float]:
    outs, ins = [], []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        manager.sleep(parts=ALL_PARTS)
        t1 = time.perf_counter()
        manager.wake_up()
        t2 = time.perf_counter()
        outs.append(t1 - t0)
        ins.append(t2 - t1)
    return min(outs), min(ins)


def throughput(param_gib: float, repeats: int, device: torch.device) -> None:
    needed = int(param_gib * GIB * 3 * 2.3)  # model + Adam, host copies, slack
    note = ""
    param_bytes = int(param_gib * GIB)
    if device.type == "cpu" and _mem_available() < needed:
        param_bytes = GIB // 3
        note = (
            f"  (RAM tight: {_mem_available() / GIB:.1f} GiB available; using 1 GiB in all, "
            "parameters + Adam)"
        )
    model, opt = _big_model(param_bytes, device)
    tensors = [p.data for p in model.parameters()] + [
        t
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.device == device
    ]
    total = sum(t.untyped_storage().nbytes() for t in tensors)
    print(
        f"## offload + onload on {device}: {total / GIB:.2f} GiB "
        f"(parameters {param_bytes / GIB:.2f} GiB fp32 + Adam){note}"
    )

    plain_out, plain_in = _plain_copy_times(tensors, device, repeats, fresh=False)
    rows: list[tuple[str, float, float]] = [
        ("plain copy_ (preallocated host)", plain_out, plain_in)
    ]
    if device.type == "cpu":
        rows.append(
            (
                "plain copy_ (fresh host memory)",
                *_plain_copy_times(tensors, device, repeats, fresh=True),
            )
        )
    del tensors
    for label, cache in (
        ("lifecycle sleep/wake_up (default)", True),
        ("lifecycle, cache_host_buffers=False", False),
    ):
        if device.type == "cuda" and cache is False:
            continue  # re-pinning every cycle is known to be slow; not a useful row
        backend = HostCopyBackend(device, cache_host_buffers=cache)
        manager = OffloadManager(model, opt, backend=backend, name="big")
        rows.append((label, *_lifecycle_times(manager, device, repeats)))
        del manager, backend
        gc.collect()

    print(f"{'':38s} {'out s':>7s} {'in s':>7s} {'GB/s':>7s} {'ratio':>6s}")
    base = plain_out + plain_in
    for label, out, into in rows:
        rate = 2 * total / (out + into) / 1e9
        print(f"{label:38s} {out:7.3f} {into:7.3f} {rate:7.2f} {base / (out + into):6.2f}")
    print("ratio = (plain copy_ out+in time) / (this row's out+in time); target >= 0.7")
    del model, opt
    gc.collect()


def switch_time(repeats: int, device: torch.device) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Model

    config = Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    actor: nn.Module = Qwen2ForCausalLM(config)  # type: ignore[no-untyped-call]
    actor.to(device)
    critic = nn.ModuleDict({"body": Qwen2Model(config), "value": nn.Linear(64, 1)}).to(device)
    tokens = torch.randint(0, 128, (4, 32), device=device)
    actor_opt = torch.optim.Adam(actor.parameters(), lr=1e-4)
    critic_opt = torch.optim.Adam(critic.parameters(), lr=1e-4)
    actor(input_ids=tokens, labels=tokens).loss.backward()
    actor_opt.step()
    actor(input_ids=tokens, labels=tokens).loss.backward()  # pending gradients, kept
    hidden = critic["body"](input_ids=tokens).last_hidden_state
    critic["value"](hidden).mean().backward()
    critic_opt.step()
    critic_opt.zero_grad(set_to_none=True)
    a = OffloadManager(actor, actor_opt, name="actor")
    c = OffloadManager(critic, critic_opt, name="critic")
    c.sleep()
    times = []
    for _ in range(max(repeats, 20)):
        _sync(device)
        t0 = time.perf_counter()
        a.sleep(parts=KEEP_GRADIENTS)
        c.wake_up()
        c.sleep(parts=ALL_PARTS)
        a.wake_up()
        _sync(device)
        times.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in actor.parameters())
    print(
        f"## actor <-> critic switch, tiny Qwen2 (2 layers, hidden 64, {params:,} params/model) on {device}"
    )
    print(
        f"full round trip (actor away keeping grads, critic in, critic away, actor in): "
        f"median {statistics.median(times) * 1e3:.2f} ms, min {min(times) * 1e3:.2f} ms "
        f"over {len(times)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--param-gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE')}"
    )
    throughput(args.param_gib, args.repeats, device)
    print()
    switch_time(args.repeats, device)


if __name__ == "__main__":
    main()
