"""An LLM with int4 weights, decoding with transformers' own generate() through
torch.compile(backend="qbackend"): text in, text out, tokens per second.

    pip install "transformers>=4.45,<6"                  # (after torch==2.13.0 and qbackend)
    python examples/llm_decode.py --model Qwen/Qwen2.5-0.5B-Instruct     # from the hub (downloads it)
    python examples/llm_decode.py [--arch llama|qwen2] [--layers 4]      # built in code: no download
    python examples/llm_decode.py --small                # a 2-layer model of width 256, for a quick check

Built in code, the model has random weights (the shapes of benchmarks/bench_llm.py: hidden 2048,
intermediate 5632, 32 heads, 4 KV heads) and a byte-level BPE tokenizer trained on this file's
text, so its output is noise, but every kernel and cache path is the real one. It decodes
greedily with the default dynamic cache and with cache_implementation="static", checks that both
give the tokens the eager int4 model gives, and prints tokens per second (a second generate()
call, its prompt included) and how many graphs Dynamo compiled in the first call and then in
the second (0: no recompiles).
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
import transformers  # noqa: E402

PROMPT = "Quantized weights make a language model small enough to decode quickly on a laptop, because"
ARCHITECTURES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                 "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}


def tokenizer_in_code(vocab_size: int):
    """A byte-level BPE tokenizer trained on this file's docstrings: what from_pretrained gives, offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([__doc__, PROMPT, tokenizer_in_code.__doc__], trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


def build(args):
    if args.model:
        return (transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval(),
                transformers.AutoTokenizer.from_pretrained(args.model))
    shapes = (dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
              if args.small else
              dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=args.layers, num_attention_heads=32,
                   num_key_value_heads=4))
    tokenizer = tokenizer_in_code(vocab_size=1024)
    config_class, model_class = ARCHITECTURES[args.arch]
    config = config_class(vocab_size=len(tokenizer), max_position_embeddings=4096, **shapes)
    torch.manual_seed(0)
    return model_class(config).eval(), tokenizer


def timed_generate(model, prompt: dict, tokens: int, **options) -> tuple[torch.Tensor, float, str]:
    """(the generated ids, tokens per second of a second identical call, its prompt included;
    the graphs Dynamo compiled in the first call, then in the second)."""
    counters = torch._dynamo.utils.counters
    counters.clear()
    settings = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, **options)
    with torch.no_grad():
        model.generate(**prompt, **settings)  # (compiles)
        first = counters["frames"]["ok"]
        start = time.perf_counter()
        ids = model.generate(**prompt, **settings)
        seconds = time.perf_counter() - start
    return ids, tokens / seconds, f"{first}, then {counters['frames']['ok'] - first}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face causal LM name or path (downloads it); default: built in code")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama", help="built in code: which one")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--small", action="store_true", help="2 layers of width 256 (built in code)")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args(argv)

    model, tokenizer = build(args)
    qbackend.quantize_weights(model, bits=4, group_size=128 if model.config.hidden_size % 128 == 0 else 64)  # every linear
    prompt = dict(tokenizer(PROMPT, return_tensors="pt"))

    eager_ids, eager_rate, _ = timed_generate(model, prompt, args.tokens)
    eager_forward = model.forward
    model.forward = torch.compile(model.forward, backend="qbackend")
    rows = [("int4, eager", eager_ids, eager_rate, "-")]
    for name, options in (("int4, qbackend", {}), ("int4, qbackend, static cache", {"cache_implementation": "static"})):
        rows.append((name, *timed_generate(model, prompt, args.tokens, **options)))
    model.forward = eager_forward

    print(f"{model.config.model_type}, {model.config.num_hidden_layers} layers, int4 weights, prompt "
          f"{prompt['input_ids'].shape[1]} tokens, {args.tokens} tokens greedy, {torch.get_num_threads()} threads")
    for name, ids, rate, graphs in rows:
        same = "the eager tokens" if torch.equal(ids, eager_ids) else "OTHER TOKENS than eager"
        print(f"  {name:30s} {rate:8.1f} tokens/s   graphs compiled: {graphs:>9}   {same}")
    text = tokenizer.decode(rows[1][1][0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"  text: {PROMPT!r} -> {text[:200]!r}")


if __name__ == "__main__":
    main()
