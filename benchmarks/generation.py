"""Generation speed at stage 3: Hugging Face ``generate()`` on an 8-layer Llama built from a config.

    python -m benchmarks.generation --repeats 3

Two ranks (gloo, CPU), one process group, each rank generating 2 sequences of 32 new tokens (greedy) from its
own prompts. Three ways, interleaved in each repeat so the machine's load falls on all alike:
``unsharded`` (the same weights, no ZeRO, this rank alone), ``stage3_per_token`` (today's policy before
generation sessions: every decoding step gathers and releases every layer, ``engine.generation(0)``) and
``stage3_kept`` (the default session: what ``generation_max_live_parameters`` / ``max_live_parameters`` allows
stays gathered across decoding steps; here the whole model) and ``stage3_half_budget`` (a session whose budget
holds half the model). One training step comes first, as in an RL step (the trace is recorded by then). Prints the median time per ``generate`` call of rank 0, tokens/s, the
ratio to unsharded, the peak of gathered elements, and whether every rank's tokens equal the unsharded ones.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NEW_TOKENS, BATCH = 32, 2


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return LlamaForCausalLM(config).eval()


def _generate(model, rank: int) -> tuple[float, list]:
    prompt = torch.tensor([[1, 7 + rank, 30, 99, 5], [1, 44, 3 + rank, 8, 250]])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start, out.tolist()


def _worker(rank: int, world: int, port: int, repeats: int, queue) -> None:
    import zero_core

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    plain = build_model()
    model = build_model()
    engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                             {"stage": 3, "stage3_param_persistence_threshold": 0})
    half = sum(u.numel for u in engine.runtime.units) // 2  # a budget that holds half the model
    _train_step(engine, model, plain, rank)  # as in an RL step: generation follows training (trace recorded, checks off)
    ways = {
        "unsharded": lambda: _generate(plain, rank),
        "stage3_per_token": lambda: _per_token(engine, model, rank),
        "stage3_kept": lambda: _generate(model, rank),
        "stage3_half_budget": lambda: _within(engine, model, rank, half),
    }
    times = {name: [] for name in ways}
    tokens, peaks = {}, {}
    for name, run in ways.items():  # warm-up (the first stage 3 forwards record the trace)
        run()
    for _ in range(repeats):
        for name, run in ways.items():
            dist.barrier()
            engine.runtime.peak_live_elements = engine.runtime.live_elements
            elapsed, tokens[name] = run()
            peaks[name] = engine.runtime.peak_live_elements
            times[name].append(elapsed)
    queue.put((rank, times, tokens, peaks))
    engine.close()
    dist.destroy_process_group()


def _train_step(engine, model, plain, rank: int) -> None:
    tokens = torch.randint(0, 1024, (2, 12), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        loss = model(tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
    # the plain copy takes the trained weights, so both generate the same tokens
    plain.load_state_dict(engine.full_state_dict(rank0_only=False))


def _within(engine, model, rank: int, budget: int):
    with engine.generation(budget):  # keeps what fits, synced decoding steps for the rest
        return _generate(model, rank)


def _per_token(engine, model, rank: int):
    with engine.generation(0):  # budget 0: nothing kept, as before generation sessions
        return _generate(model, rank)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, args.repeats, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = sorted(queue.get(timeout=1800) for _ in procs)
    for proc in procs:
        proc.join()
    _, times, _, peaks = results[0]
    same = all(r[2][name] == r[2]["unsharded"] for r in results for name in r[2])
    base = statistics.median(times["unsharded"])
    print(f"8-layer Llama, {BATCH}x{NEW_TOKENS} new tokens per rank, 2 ranks (gloo, CPU), {args.repeats} repeats")
    print(f"{'way':18} {'ms/generate':>12} {'tokens/s':>9} {'x unsharded':>12} {'peak gathered':>14}")
    for name, values in times.items():
        median = statistics.median(values)
        peak = "-" if name == "unsharded" else f"{peaks[name]:,}"
        print(f"{name:18} {median * 1e3:12.0f} {BATCH * NEW_TOKENS / median:9.0f} {base / median:12.2f} {peak:>14}")
    print(f"same tokens as unsharded on every rank: {same}")


if __name__ == "__main__":
    main()
