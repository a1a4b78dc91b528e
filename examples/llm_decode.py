"""Int4 weight-only decode of a Llama-architecture model with transformers' own generate(),
through torch.compile(backend="qbackend"): the README's recipe, runnable.

    pip install "transformers>=4.45,<6"      # (after torch==2.13.0 and qbackend)
    python examples/llm_decode.py [--layers 4] [--tokens 32]

The model is built from a LlamaConfig with random weights (no download): the same shapes as
benchmarks/bench_llm.py (hidden 2048, intermediate 5632, 32 heads, 4 KV heads, vocab 32000).
It decodes greedily with the default dynamic cache and with cache_implementation="static",
checks that both give the tokens the eager int4 model gives, and prints ms per token (a second
generate() call, its prompt included) and how many graphs Dynamo compiled in the first call and
then in the second (0: no recompiles).
"""
from __future__ import annotations

import argparse
import sys
import time
import types

import torch

import qbackend

# transformers imports torchvision where it is installed; PyPI's torchvision is built for CUDA
# torch and its C ops fail to register against the CPU wheel ("operator torchvision::nms does not
# exist"). Nothing here needs them.
sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def timed_generate(model, prompt, tokens: int, **options) -> tuple[torch.Tensor, float, int]:
    """(the generated ids, seconds per generated token, prompt included, of a second identical call;
    the graphs Dynamo compiled in the first call, then in the second)."""
    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, **options)  # (compiles)
        first = counters["frames"]["ok"]
        start = time.perf_counter()
        ids = model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, **options)
        seconds = (time.perf_counter() - start) / tokens
    return ids, seconds, f"{first}, then {counters['frames']['ok'] - first}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args(argv)
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=args.layers, num_attention_heads=32,
                         num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    qbackend.quantize_weights(model, bits=4, group_size=128)  # every linear, lm_head included
    prompt = torch.randint(0, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))

    eager_ids, eager_s, _ = timed_generate(model, prompt, args.tokens)
    eager_forward = model.forward
    model.forward = torch.compile(model.forward, backend="qbackend")
    rows = [("int4, eager", eager_ids, eager_s, "-")]
    for name, options in (("int4, qbackend", {}), ("int4, qbackend, static cache", {"cache_implementation": "static"})):
        rows.append((name, *timed_generate(model, prompt, args.tokens, **options)))
    model.forward = eager_forward

    print(f"{args.layers}-layer Llama, int4 g128 weights, prompt 32 tokens, {args.tokens} tokens greedy, "
          f"{torch.get_num_threads()} threads")
    for name, ids, seconds, graphs in rows:
        same = "the eager tokens" if torch.equal(ids, eager_ids) else "OTHER TOKENS than eager"
        print(f"  {name:30s} {seconds * 1e3:7.2f} ms / token   graphs compiled: {graphs:>9}   {same}")


if __name__ == "__main__":
    main()
