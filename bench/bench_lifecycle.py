"""Benchmark: sleep + wake_up throughput, memory given back, one actor <-> critic switch.

Run: ``uv run --frozen python bench/bench_lifecycle.py [--param-gib 1.0] [--repeats 2]``
(``uv run nox -s bench -- lifecycle`` runs it with the defaults).

1. A model with about ``--param-gib`` GiB of fp32 parameters plus its Adam state
   (two moments: about 3x that in all) sleeps and wakes through ``OffloadManager``,
   once per backend configuration, and the same bytes (same tensors, same run) take
   the same round trip the plain way: ``copy_`` to host buffers and back. Every row
   moves each byte twice (device -> host, host -> device), so every row is reported
   as the bandwidth of its round trip, ``GB/s = 2 * bytes / (out + in seconds)``, and
   ``ratio`` = a row's GB/s / the plain round trip's GB/s (target >= 0.7). Times are
   the best of ``--repeats`` (for variation run the script several times).

   The plain reference is the round trip that does the same work short of the
   release itself: on CUDA ``copy_`` to preallocated pinned buffers and back into the
   resident tensors (the host copy caches pinned buffers; device memory comes back
   from the caching allocator). On a CPU "device" a sleep that really releases must
   copy into memory it did not hold and wake into memory it just got back from the
   OS, so the reference is ``copy_`` into freshly allocated host tensors
   (``torch.empty_like``) and back into freshly allocated tensors, each freed after
   use: page faults, zeroing and unmapping included, as for the backend. The CPU
   rows also show ``vs warm``: their GB/s over ``copy_`` between preallocated,
   already touched buffers and the resident tensors, the machine's bandwidth with
   no allocation at all (a ceiling no release can reach).
   CPU rows: the default host copy (``spill_to="auto"``: a host-memory child process,
   the row's label says ``[memfd]`` where it fell back to memfd files), the same with
   ``spill_to="memfd"`` (the fallback, for comparison in the same run), a cached
   spill and the in-process copy; ``--spill process|memfd|auto`` keeps only the rows
   of that spill (and the references).
   ``released`` = memory another process can use once the model sleeps, over the
   parameter + optimizer bytes put to sleep (target >= 0.8 on CPU, >= 0.9 on CUDA):
   on CPU the drop of this process's RSS (``/proc/self/statm``), on CUDA the rise of
   the device's free memory (``torch.cuda.mem_get_info``, what another process sees).
   ``retaken``: the same, taken again by the wake-up. Worst of ``--repeats``.
2. One full switch for the default tiny model (Qwen2, 2 layers, hidden 64, built with
   transformers): actor ``sleep(KEEP_GRADIENTS)`` + critic ``wake_up()``, then back.

If the machine lacks memory for 1 GiB of parameters (about 3x for the model plus
the same again for host copies), the size shrinks so that parameters plus Adam total
1 GiB, and the table says so.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

# Large CPU allocations get transparent huge pages (fewer page faults on wake-up).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch
from ppo_lifecycle import (
    ALL_PARTS,
    KEEP_GRADIENTS,
    HostCopyBackend,
    OffloadBackend,
    OffloadManager,
    TorchMemorySaverBackend,
)
from ppo_lifecycle._backends import SpillTo
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
    """Best out / in times of ``copy_`` of the same bytes to host buffers and back.

    ``fresh``: the host buffers are allocated by the way out and freed by the way in,
    which copies into newly allocated tensors (each freed at once): the allocations,
    page faults and frees that a sleep that releases memory pays, in both directions.
    Otherwise: preallocated, already touched host buffers, back into ``tensors``.
    """
    pin = device.type == "cuda"
    hosts: list[torch.Tensor] = []
    if not fresh:
        hosts = [torch.empty_like(t, device="cpu", pin_memory=pin) for t in tensors]
        for h, t in zip(hosts, tensors, strict=True):  # warm the destination pages
            h.copy_(t)
    outs, ins = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i, t in enumerate(tensors):
            if fresh:  # each buffer allocated just before its copy, as the backends do
                hosts.append(torch.empty_like(t, device="cpu", pin_memory=pin))
            hosts[i].copy_(t, non_blocking=pin)
        _sync(device)
        t1 = time.perf_counter()
        for h, t in zip(hosts, tensors, strict=True):
            if fresh:  # into newly allocated device memory, as after a real release
                torch.empty_like(t).copy_(h)
            else:
                t.copy_(h, non_blocking=pin)
        _sync(device)
        if fresh:
            hosts = []  # the host copy is freed by the way in, as a wake-up frees its own
        t2 = time.perf_counter()
        outs.append(t1 - t0)
        ins.append(t2 - t1)
    del hosts
    gc.collect()
    return min(outs), min(ins)


_PAGE = os.sysconf("SC_PAGE_SIZE")


def _free_memory(device: torch.device) -> int:
    """Memory other processes could use, up to a constant: the device's free bytes
    on CUDA; minus this process's resident set on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/self/statm") as f:
        return -int(f.read().split()[1]) * _PAGE


@dataclass
class _Row:
    label: str
    out: float
    into: float
    released: float | None = None  # memory given back by the sleep / bytes slept (worst)
    retaken: float | None = None  # memory taken again by the wake-up / bytes slept (worst)


def _lifecycle_row(
    label: str, manager: OffloadManager, device: torch.device, repeats: int, slept: int
) -> _Row:
    outs, ins, released, retaken = [], [], [], []
    for _ in range(repeats):
        _sync(device)
        free_awake = _free_memory(device)
        t0 = time.perf_counter()
        manager.sleep(parts=ALL_PARTS)
        t1 = time.perf_counter()
        free_asleep = _free_memory(device)
        t2 = time.perf_counter()
        manager.wake_up()
        t3 = time.perf_counter()
        free_woken = _free_memory(device)
        outs.append(t1 - t0)
        ins.append(t3 - t2)
        released.append((free_asleep - free_awake) / slept)
        retaken.append((free_asleep - free_woken) / slept)
    return _Row(label, min(outs), min(ins), min(released), min(retaken))


def _configurations(
    device: torch.device, spills: SpillTo | None = None
) -> list[tuple[str, Callable[[], OffloadBackend]]]:
    """(label, a fresh backend) per row: each row builds, uses and drops its own;
    ``spills``: only the CPU rows of that ``spill_to``."""
    if device.type == "cuda":
        rows: list[tuple[str, Callable[[], OffloadBackend]]] = [
            ("lifecycle host copy (default: pinned)", lambda: HostCopyBackend(device))
        ]
        if importlib.util.find_spec("torch_memory_saver") is not None:
            # Last: its first sleep moves the storages into its regions for good.
            rows.append(
                (
                    "lifecycle torch_memory_saver",
                    lambda: TorchMemorySaverBackend(device, name="bench"),
                )
            )
        return rows
    cpu_rows: list[tuple[str, Callable[[], OffloadBackend]]] = []
    chosen: tuple[SpillTo, ...] = ("auto", "memfd") if spills is None else (spills,)
    for spill in chosen:
        label = "default (auto)" if spill == "auto" else f"spill_to={spill}"
        cpu_rows.append(
            (f"lifecycle {label}", functools.partial(HostCopyBackend, device, spill_to=spill))
        )
    cpu_rows.append(
        (
            f"lifecycle {chosen[0]}, cache_host_buffers=True",
            functools.partial(HostCopyBackend, device, spill_to=chosen[0], cache_host_buffers=True),
        )
    )
    if spills is None:
        cpu_rows.append(
            (
                "lifecycle in-process copy (spill=False)",
                lambda: HostCopyBackend(device, spill=False),
            )
        )
    return cpu_rows


def throughput(
    param_gib: float, repeats: int, device: torch.device, spills: SpillTo | None = None
) -> None:
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
        f"## sleep + wake_up on {device}: {total / GIB:.2f} GiB "
        f"(parameters {param_bytes / GIB:.2f} GiB fp32 + Adam){note}"
    )

    plain_out, plain_in = _plain_copy_times(tensors, device, repeats, fresh=False)
    warm_label = "plain copy_ (preallocated host)"
    if device.type == "cuda":
        warm_label = "plain copy_ (preallocated pinned host)"
    rows = [_Row(warm_label, plain_out, plain_in)]
    if device.type == "cpu":
        fresh_out, fresh_in = _plain_copy_times(tensors, device, repeats, fresh=True)
        rows.append(_Row("plain copy_ (fresh host memory)", fresh_out, fresh_in))
    del tensors
    gc.collect()
    for label, make_backend in _configurations(device, spills):
        try:
            backend = make_backend()
            manager = OffloadManager(model, opt, backend=backend, name="big")
        except (RuntimeError, ValueError) as exc:  # an optional backend that cannot run here
            print(f"{label}: skipped ({exc})")
            continue
        row = _lifecycle_row(label, manager, device, repeats, total)
        if isinstance(backend, HostCopyBackend) and backend.spill_kind is not None:
            row.label += f" [{backend.spill_kind}]"  # where the host copy went
        rows.append(row)
        del manager, backend
        gc.collect()

    on_cpu = device.type == "cpu"
    reference = rows[1] if on_cpu else rows[0]  # the fresh round trip on CPU (see above)
    warm = rows[0]

    def rate(row: _Row) -> float:
        """Round-trip bandwidth: every byte moves out and back in."""
        return 2 * total / (row.out + row.into)

    print(
        f"{'':50s} {'out s':>7s} {'in s':>7s} {'GB/s':>7s} {'ratio':>6s} "
        + (f"{'vs warm':>7s} " if on_cpu else "")
        + f"{'released':>9s} {'retaken':>8s}"
    )
    for row in rows:
        memory = "" if row.released is None else f"{row.released:9.2f} {row.retaken:8.2f}"
        print(
            f"{row.label:50s} {row.out:7.3f} {row.into:7.3f} {rate(row) / 1e9:7.2f} "
            f"{rate(row) / rate(reference):6.2f} "
            + (f"{rate(row) / rate(warm):7.2f} " if on_cpu else "")
            + memory
        )
    target = 0.8 if on_cpu else 0.9
    print(
        f"GB/s = 2 x {total / GIB:.2f} GiB / (out + in); ratio = GB/s over the "
        f"'{reference.label}' row's, target >= 0.7"
        + ("; vs warm = GB/s over the 'plain copy_ (preallocated host)' row's" if on_cpu else "")
        + "; released / retaken = memory another process can use after the sleep / that "
        f"the wake-up takes again, over the {total / GIB:.2f} GiB slept, target >= {target}"
    )
    del model, opt
    gc.collect()


def switch_time(repeats: int, device: torch.device, spills: SpillTo | None = None) -> None:
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

    def backend() -> OffloadBackend:
        if device.type != "cpu":
            return HostCopyBackend(device)  # what backend="auto" builds on CUDA
        return HostCopyBackend(device, spill_to=spills or "auto")

    a = OffloadManager(actor, actor_opt, backend=backend(), name="actor")
    c = OffloadManager(critic, critic_opt, backend=backend(), name="critic")
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
    kind = a.backend.spill_kind if isinstance(a.backend, HostCopyBackend) else None
    print(
        f"## actor <-> critic switch, tiny Qwen2 (2 layers, hidden 64, {params:,} params/model) "
        f"on {device}" + (f", spill_to={spills or 'auto'} [{kind}]" if kind else "")
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
    parser.add_argument(
        "--spill",
        choices=["auto", "process", "memfd"],
        default=None,
        help="CPU: only the rows of this spill_to (default: auto and memfd, and the rest)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE')}"
    )
    throughput(args.param_gib, args.repeats, device, args.spill)
    print()
    switch_time(args.repeats, device, args.spill)


if __name__ == "__main__":
    main()
