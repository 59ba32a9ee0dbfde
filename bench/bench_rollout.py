"""Rollout benchmark: embedded-engine generation throughput and weight-refit time.

1. Generated tokens/s of the embedded engine's sampling loop (KV cache, groups batched,
   finished rows dropped) against a plain ``model.generate`` loop (one call per prompt
   group, same model, same sampling settings) in the same process.
2. Refit time of the gloo bucketed broadcast (a sender and a receiver process, header +
   buckets + applying the weights) against a plain in-process tensor copy of the same
   bytes.

Run: ``uv run --frozen python bench/bench_rollout.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Any

import torch
from ppo_driver.rollout import (
    CharTokenizer,
    EmbeddedEngine,
    GroupRequest,
    PromptDataset,
    SamplingParams,
    broadcast_state_dict,
    build_model,
    connect_group,
    open_store,
    receive_state_dict,
    synthetic_records,
)
from ppo_trainer import ModelSpec

TOK = CharTokenizer()
GROUPS = 16
N = 4
MAX_NEW = 24
REFIT_REPEATS = 5


def _spec(hidden: int, layers: int) -> ModelSpec:
    return ModelSpec(
        vocab_size=TOK.vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        seed=0,
    )


def bench_generation() -> None:
    torch.set_num_threads(1)
    spec = _spec(64, 2)
    data = PromptDataset(synthetic_records(num_prompts=GROUPS, seed=0, max_count=12), TOK)
    params = SamplingParams(n=N, max_new_tokens=MAX_NEW, stop_token_ids=(TOK.eos_id,))
    reqs = [
        GroupRequest(prompt_index=i, prompt_ids=data.prompt_ids(i), params=params)
        for i in range(GROUPS)
    ]

    rows = []
    for batch_groups in (True, False):
        engine = EmbeddedEngine(model=spec, run_seed=0, batch_groups=batch_groups)
        engine.generate(reqs[:2])  # warm-up
        start = time.perf_counter()
        outs = engine.generate(reqs)
        secs = time.perf_counter() - start
        tokens = sum(len(s.token_ids) for o in outs for s in o.samples)
        name = "embedded engine, groups batched" if batch_groups else "embedded engine, per group"
        rows.append((name, tokens, secs))

    model: Any = build_model(spec)
    model.generation_config.pad_token_id = TOK.pad_id
    torch.manual_seed(0)
    with torch.inference_mode():
        model.generate(
            input_ids=torch.tensor([data.prompt_ids(0)] * N), do_sample=True, max_new_tokens=4
        )
        start = time.perf_counter()
        tokens = 0
        for r in reqs:
            ids = torch.tensor([list(r.prompt_ids)] * N)
            out = model.generate(
                input_ids=ids,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=MAX_NEW,
                eos_token_id=TOK.eos_id,
                pad_token_id=TOK.pad_id,
            )
            new = out[:, ids.shape[1] :]
            for row in new.tolist():  # count up to and including eos, like the engine
                tokens += row.index(TOK.eos_id) + 1 if TOK.eos_id in row else len(row)
        secs = time.perf_counter() - start
    rows.append(("plain model.generate loop", tokens, secs))

    print(f"\n== generation: {GROUPS} groups x {N} samples, max_new_tokens={MAX_NEW}, 1 thread")
    print(f"{'path':36s} {'tokens':>7s} {'seconds':>8s} {'tokens/s':>9s}")
    for name, tok, s in rows:
        print(f"{name:36s} {tok:7d} {s:8.3f} {tok / s:9.0f}")
    base = rows[2][1] / rows[2][2]
    print(f"ratio batched engine / model.generate : {rows[0][1] / rows[0][2] / base:.2f}x")
    print(f"ratio per-group engine / model.generate: {rows[1][1] / rows[1][2] / base:.2f}x")


def _receiver(port: int, repeats: int, ready: Any) -> None:
    torch.set_num_threads(1)
    model: Any = build_model(_spec(256, 4))
    group = connect_group(
        store=None, master_addr="127.0.0.1", master_port=port, rank=1, world_size=2, backend="gloo"
    )
    params = model.state_dict()
    for _ in range(repeats):
        _, tensors = receive_state_dict(group=group)
        with torch.no_grad():
            for k, v in tensors.items():
                params[k].copy_(v)
        ready.put(1)


def bench_refit() -> None:
    torch.set_num_threads(1)
    weights = {k: v.clone() for k, v in build_model(_spec(256, 4)).state_dict().items()}
    nbytes = sum(v.numel() * v.element_size() for v in weights.values())
    ctx = mp.get_context("spawn")
    store, port = open_store(host="127.0.0.1", world_size=2, timeout_s=120)
    ready = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, REFIT_REPEATS + 1, ready))
    proc.start()
    group = connect_group(
        store=store, master_addr="127.0.0.1", master_port=port, rank=0, world_size=2, backend="gloo"
    )
    times = []
    for i in range(REFIT_REPEATS + 1):
        start = time.perf_counter()
        broadcast_state_dict(weights, group=group, version=i, bucket_bytes=4 * 1024 * 1024)
        ready.get()  # the receiver applied them
        if i:  # the first one is warm-up
            times.append(time.perf_counter() - start)
    proc.join()
    dst = {k: torch.empty_like(v) for k, v in weights.items()}
    copies = []
    for _ in range(REFIT_REPEATS):
        start = time.perf_counter()
        for k, v in weights.items():
            dst[k].copy_(v)
        copies.append(time.perf_counter() - start)
    refit, copy = statistics.median(times), statistics.median(copies)
    print(
        f"\n== refit: {len(weights)} tensors, {nbytes / 2**20:.1f} MiB, 4 MiB buckets, median of {REFIT_REPEATS}"
    )
    print(f"{'path':36s} {'seconds':>9s} {'MiB/s':>9s}")
    print(f"{'gloo broadcast + apply (2 procs)':36s} {refit:9.4f} {nbytes / 2**20 / refit:9.0f}")
    print(f"{'plain tensor copy (same process)':36s} {copy:9.4f} {nbytes / 2**20 / copy:9.0f}")
    print(f"ratio refit / plain copy: {refit / copy:.1f}x slower")


if __name__ == "__main__":
    bench_generation()
    bench_refit()
