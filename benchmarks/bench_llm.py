"""LLM decode on CPU end to end: a Hugging Face Llama-architecture model, weight-only int4 / int8.

    pip install -e ".[bench]"
    python benchmarks/bench_llm.py [--quick] [--contexts 32 512 2048]

The model: ``transformers.LlamaForCausalLM`` from a ``LlamaConfig`` (hidden 2048, intermediate
5632, 4 layers, 32 heads, 4 KV heads, vocab 32000), random init, fp32. Paths, each timed on the
same inputs: fp32 eager, bf16 eager, Inductor on the bf16 model (``torch.compile`` default),
``qbackend.quantize_weights`` int4 (group 128) eager and through
``torch.compile(model.forward, backend="qbackend")`` (also with the int8 KV cache option), and
int8 the same way compiled.

Per path: greedy decode latency (median ms per generated token, the KV cache filled to each
context length first), prefill of 512 tokens (``logits_to_keep=1``, as ``generate`` asks), the
first calls' time (compile included) and how many graphs Dynamo compiled after the second decode
step (recompiles). Accuracy: the logits' cosine on the prompt and on every decoded step against
the fp32 model and against the same model with the quantized weights dequantized into fp32 (the
kernels' own error). Memory: the peak RSS of a fresh process that loads the int4 checkpoint
and decodes, against the same for the fp32 checkpoint. The floor: the bytes a decode step must
read (int4 weights and their scales; the embedding row is negligible) over the measured copy
bandwidth. Writes docs/benchmarks_llm.md, one section per CPU.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import gc
import importlib.util
import inspect
import json
import statistics
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

PROJECT_ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("qbackend") is None:  # not installed: use this checkout
    sys.path.insert(0, str(PROJECT_ROOT))

import qbackend  # noqa: E402
from qbackend.quantized_tensor import QuantizedLinearWeight  # noqa: E402

from common import (NUM_THREADS, cosine, cpu_key, fmt, log, machine_description, measure_bandwidth,  # noqa: E402
                    peak_rss_bytes, reset_peak_rss, rss_bytes, short_error, wait_for_parallel_speedup, write_section)

# (transformers imports torchvision where it is installed; its CUDA-built C ops do not load: zoo_models.py)
sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache  # noqa: E402

CONFIG = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
              vocab_size=32000, max_position_embeddings=4096)
GROUP = 128
PROMPT, PREFILL, ACCURACY_STEPS = 32, 512, 32
PAIRED_PREFILLS = (16, 64, 128, 512)  # prompt lengths timed against Inductor, interleaved


def config() -> LlamaConfig:
    return LlamaConfig(**CONFIG)


def build_fp32() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(config()).eval()


# transformers 5 renamed ``past_key_values`` to ``cache`` (argument and output field)
_CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def _cache_of(output):
    return getattr(output, _CACHE_ARG)


@dataclass
class Runner:
    name: str
    forward: Callable  # model.forward or its compiled form
    dtype: torch.dtype  # of the KV cache
    compiled: bool = False
    bits: Optional[int] = None  # of the quantized weights (None: a float path)
    kv_cache: str = "float"  # qbackend's option
    cache: str = "dynamic"  # transformers' cache in the decode turns: DynamicCache, or "static" (StaticCache)
    results: dict = field(default_factory=dict)


def step(path: Runner, tokens: torch.Tensor, cache, **kwargs):
    with torch.no_grad():
        out = path.forward(input_ids=tokens, use_cache=True, **{_CACHE_ARG: cache}, **kwargs)
    return out.logits[:, -1:].argmax(-1), _cache_of(out), out.logits


def filled_cache(length: int, dtype: torch.dtype, static_room: Optional[int] = None):
    """A KV cache holding ``length`` positions (random keys / values: a decode step's time does
    not depend on them, and filling it by a prefill of 2048 tokens costs minutes in bf16 on AVX2):
    a DynamicCache, or a StaticCache with ``static_room`` positions more (its mask covers them all;
    qbackend's attention skips the unfilled ones)."""
    cfg = config()
    cache = DynamicCache() if static_room is None else StaticCache(config=cfg, max_cache_len=length + static_room)
    generator = torch.Generator().manual_seed(5)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    for layer in range(cfg.num_hidden_layers):
        shape = (1, cfg.num_key_value_heads, length, head_dim)
        cache.update(torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype), layer)
    return cache


DECODE_BLOCK = 6  # consecutive steps a path times per turn, after DECODE_WARMUP untimed ones
DECODE_WARMUP = 6  # (measured: after two fp32 steps an int4 step takes 6.5, 5.9, 6.2, 5.9, 5.8, 5.7, 5.5 ms, 5.5 alone)
PROBES: list = []  # two-thread speedups measured before each round of decode turns and each prefill call
ROUND_BANDWIDTHS: list = []  # copy bandwidth measured at the start of each round of decode turns
ROUND_COPY_MB, ROUND_COPY_REPEATS = 256, 3


def decode_ms(paths: list, context: int, steps: int, floor_bytes: dict) -> tuple[list, list, list]:
    """Median ms per decode step of each path, its median step in each round (speedups pair paths
    round by round), and (quantized paths) its median over rounds of the round's median step over
    the floor at the copy bandwidth measured at that round's start (the host's bandwidth moves by
    1.5x over minutes: a step and its floor paired in time). The paths
    take turns (each sees the same drift), a block of consecutive steps each, as a decode loop
    runs them; the first steps of a turn are not timed: after another path's steps, which stream
    up to 1 GB of weights (fp32), a step runs up to 1.2x slower, for about 6 steps. Each round of
    turns waits for the two vCPUs to run side by side (common.parallel_speedup); the probes go to
    ``PROBES``, the bandwidths to ``ROUND_BANDWIDTHS``."""
    rounds = -(-steps // DECODE_BLOCK)
    room = 1 + rounds * (DECODE_WARMUP + DECODE_BLOCK)  # (a static cache's positions past the context: every step's)
    state = [(torch.tensor([[7]]), filled_cache(context, path.dtype, room if path.cache == "static" else None))
             for path in paths]
    for i, path in enumerate(paths):  # the first step after a new cache length may compile
        state[i] = step(path, *state[i])[:2]
    times, ratios, round_ms = [[] for _ in paths], [[] for _ in paths], [[] for _ in paths]
    for round_ in range(rounds):
        PROBES.append(wait_for_parallel_speedup())
        bandwidth = measure_bandwidth(ROUND_COPY_MB, ROUND_COPY_REPEATS)
        ROUND_BANDWIDTHS.append(bandwidth)
        for i in [(round_ + j) % len(paths) for j in range(len(paths))]:  # (each round starts one path later)
            path = paths[i]
            for _ in range(DECODE_WARMUP):
                state[i] = step(path, *state[i])[:2]
            block = []
            for _ in range(DECODE_BLOCK):
                start = time.perf_counter()
                state[i] = step(path, *state[i])[:2]
                block.append(time.perf_counter() - start)
            times[i] += block
            round_ms[i].append(statistics.median(block) * 1e3)
            if path.bits:
                ratios[i].append(statistics.median(block) / (floor_bytes[path.bits] / bandwidth))
    return [statistics.median(t) * 1e3 for t in times], round_ms, [statistics.median(r) if r else None for r in ratios]


def prefill_ms(path: Runner, calls: int) -> float:
    tokens = torch.randint(0, CONFIG["vocab_size"], (1, PREFILL), generator=torch.Generator().manual_seed(3))
    times = []
    for _ in range(calls + 1):  # (the first call of a new prompt length may compile)
        PROBES.append(wait_for_parallel_speedup())
        start = time.perf_counter()
        step(path, tokens, DynamicCache(), logits_to_keep=1)
        times.append(time.perf_counter() - start)
    return min(times[1:]) * 1e3


def prefill_pairs(base: Runner, paths: list, rounds: int) -> dict:
    """{prompt length: {path name: the median over rounds of its prefill time over ``base``'s in
    the same round}} for each of ``PAIRED_PREFILLS``; the paths take turns (each round starting one
    later), each timed call right after an untimed one of its own (the steady state of a loop of
    prompts; compiles land there)."""
    found = {}
    for length in PAIRED_PREFILLS:
        tokens = torch.randint(0, CONFIG["vocab_size"], (1, length), generator=torch.Generator().manual_seed(3))
        order, times = [base, *paths], {path.name: [] for path in (base, *paths)}
        for turn in range(rounds):
            for path in order[turn % len(order):] + order[:turn % len(order)]:
                PROBES.append(wait_for_parallel_speedup())
                step(path, tokens, DynamicCache(), logits_to_keep=1)
                start = time.perf_counter()
                step(path, tokens, DynamicCache(), logits_to_keep=1)
                times[path.name].append(time.perf_counter() - start)
        found[length] = {path.name: statistics.median(t / b for t, b in zip(times[path.name], times[base.name]))
                         for path in paths}
    return found


def first_calls(path: Runner, prompt: torch.Tensor) -> dict:
    """The prompt and two decode steps from cold (Dynamo reset): their time, then the graphs
    Dynamo compiles over 8 more steps (0: no recompiles)."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    start = time.perf_counter()
    token, cache, _ = step(path, prompt, DynamicCache())
    for _ in range(2):
        token, cache, _ = step(path, token, cache)
    seconds = time.perf_counter() - start
    frames = counters["frames"]["ok"]
    for _ in range(8):
        token, cache, _ = step(path, token, cache)
    return {"first_s": seconds, "graphs": frames, "recompiles": counters["frames"]["ok"] - frames}


def greedy_logits(path: Runner, prompt: torch.Tensor, tokens: Optional[list] = None, cache=None) -> tuple[list, list]:
    """Logits of the prompt, then of each decoded step (feeding ``tokens`` when given, so every
    path sees the reference's sequence); the tokens it chose. ``cache``: a DynamicCache unless given."""
    token, cache, logits = step(path, prompt, DynamicCache() if cache is None else cache)
    all_logits, chosen = [logits[0].float()], []
    for i in range(ACCURACY_STEPS):
        feed = token if tokens is None else tokens[i]
        chosen.append(feed)
        token, cache, logits = step(path, feed, cache)
        all_logits.append(logits[0, -1:].float())
    return all_logits, chosen


def static_cache_logits(model: torch.nn.Module, prompt: torch.Tensor, tokens: list) -> list:
    """``greedy_logits`` of ``model`` compiled with qbackend on a StaticCache, through a wrapper
    of its own: the timed paths' Dynamo cache keeps only their own graphs to check."""
    compiled = torch.compile(own_frame(model, "static_cache_check"), backend="qbackend")
    static = StaticCache(config=config(), max_cache_len=PROMPT + ACCURACY_STEPS + 1)
    return greedy_logits(Runner("static", compiled, torch.float32, compiled=True), prompt, tokens, static)[0]


def min_cosine(a: list, b: list) -> float:
    return min(cosine(x, y) for x, y in zip(a, b))


def dequantized_copy(quantized: torch.nn.Module) -> torch.nn.Module:
    """The quantized model with each weight replaced by its dequantized fp32 values."""
    model = copy.deepcopy(quantized)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and isinstance(module.weight, QuantizedLinearWeight):
            module.weight = torch.nn.Parameter(module.weight.dequantize().float(), requires_grad=False)
    return model


def decode_bytes(model: torch.nn.Module) -> int:
    """What one decode step reads of the quantized weights: integers and scales / zero points."""
    total = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear) and isinstance(w, QuantizedLinearWeight):
            total += sum(t.numel() * t.element_size() for t in (w.qdata, w.scale, w.zero))
    return total


# --- peak memory: a fresh process loads a checkpoint and decodes ------------------------------


def memory_child(checkpoint: str, bits: int) -> None:
    with torch.device("meta"):  # the structure only: no fp32 weights are made for the int4 model
        model = LlamaForCausalLM(config()).eval()
    if bits:
        qbackend.quantize_weights(model, bits=bits, group_size=GROUP if bits == 4 else None)
    rotary = model.model.rotary_emb  # (its inverse frequencies are not in a state_dict)
    model.model.rotary_emb = type(rotary)(config=config())
    reset_peak_rss()
    before = rss_bytes()
    with torch.serialization.safe_globals([QuantizedLinearWeight]):
        state = torch.load(checkpoint, weights_only=True, mmap=False)
    model.load_state_dict(state, assign=True, strict=False)
    del state
    path = Runner("child", model.forward, torch.float32)
    token, cache, _ = step(path, torch.arange(PROMPT).unsqueeze(0), DynamicCache())
    for _ in range(4):
        token, cache, _ = step(path, token, cache)
    print(json.dumps({"peak": peak_rss_bytes() - before}))


def peak_memory(models: dict) -> dict:
    found = {}
    for name, (model, bits) in models.items():
        with tempfile.NamedTemporaryFile(suffix=".pt") as checkpoint:
            torch.save(model.state_dict(), checkpoint.name)
            child = subprocess.run([sys.executable, __file__, "--memory-child", checkpoint.name, str(bits)],
                                   capture_output=True, text=True)
        if child.returncode != 0:
            found[name] = f"failed: {(child.stderr.strip().splitlines() or ['?'])[-1]}"
        else:
            found[name] = json.loads(child.stdout.strip().splitlines()[-1])["peak"]
    return found


# --- the run ------------------------------------------------------------------------------------


def own_frame(model: torch.nn.Module, name: str):
    """``model``'s forward behind a function with a code object of its own: Dynamo keeps its
    graphs and counts its recompile limit (8) per code object, so paths compiling
    ``LlamaForCausalLM.forward`` (or one lambda) shared them; past the limit a path ran
    eagerly (int4 decode 10.6 ms where it takes 5.5)."""
    def forward(**inputs):
        return model(**inputs)
    forward.__code__ = forward.__code__.replace(co_name=name)
    return forward


def paths(fp32, bf16, int4, int8) -> list[Runner]:
    return [
        Runner("fp32 eager", fp32.forward, torch.float32),
        Runner("bf16 eager", bf16.forward, torch.bfloat16),
        Runner("Inductor bf16", torch.compile(own_frame(bf16, "inductor_bf16")), torch.bfloat16, compiled=True),
        Runner("qbackend int4 eager", int4.forward, torch.float32, bits=4),
        Runner("qbackend int4", torch.compile(own_frame(int4, "qbackend_int4"), backend="qbackend"), torch.float32, compiled=True, bits=4),
        Runner("qbackend int4, static cache", torch.compile(own_frame(int4, "qbackend_int4_static"), backend="qbackend"), torch.float32,
               compiled=True, bits=4, cache="static"),
        Runner("qbackend int4, int8 KV cache", torch.compile(own_frame(int4, "qbackend_int4_kv8"), backend="qbackend",
                                                             options={"kv_cache": "int8"}),
               torch.float32, compiled=True, bits=4, kv_cache="int8"),
        Runner("qbackend int8", torch.compile(own_frame(int8, "qbackend_int8"), backend="qbackend"), torch.float32, compiled=True, bits=8),
    ]


def run(contexts: list, steps: int, prefill_calls: int, prefill_rounds: int) -> tuple[list, dict]:
    log("building the models")
    fp32 = build_fp32()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    int4 = qbackend.quantize_weights(copy.deepcopy(fp32), bits=4, group_size=GROUP)
    int8 = qbackend.quantize_weights(copy.deepcopy(fp32), bits=8)
    prompt = torch.randint(0, CONFIG["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(1))
    fp32_path = Runner("fp32", fp32.forward, torch.float32)
    reference, tokens = greedy_logits(fp32_path, prompt)
    dequantized = {bits: greedy_logits(Runner("dq", dequantized_copy(m).forward, torch.float32), prompt, tokens)[0]
                   for bits, m in ((4, int4), (8, int8))}
    extra = {"bandwidth": measure_bandwidth(), "int4_bytes": decode_bytes(int4), "int8_bytes": decode_bytes(int8)}
    rows = paths(fp32, bf16, int4, int8)
    for path in rows:
        if path.cache == "static":  # (decode turns only: its logits are the int4 path's, cos_static below)
            continue
        log(f"{path.name}: first calls")
        try:
            if path.compiled:
                path.results.update(first_calls(path, prompt))
            logits, _ = greedy_logits(path, prompt, tokens)
            path.results["cos_fp32"] = min_cosine(logits, reference)
            if path.bits:
                path.results["cos_dequantized"] = min_cosine(logits, dequantized[path.bits])
            if path.bits and path.compiled and path.kv_cache == "float":  # (transformers' other cache: index_copy_)
                path.results["cos_static"] = min_cosine(static_cache_logits({4: int4, 8: int8}[path.bits], prompt, tokens), logits)
            log(f"{path.name}: prefill of {PREFILL}")
            path.results["prefill"] = prefill_ms(path, prefill_calls)
        except Exception as error:  # one broken path must not hide the others
            path.results["error"] = short_error(error)
            log(f"{path.name} failed: {path.results['error']}")
        gc.collect()
    working = [path for path in rows if "error" not in path.results]
    inductor = next((path for path in working if path.name == "Inductor bf16"), None)
    if inductor is not None:
        log(f"prefill of {', '.join(map(str, PAIRED_PREFILLS))} tokens against Inductor bf16, interleaved")
        extra["prefill_vs_inductor"] = prefill_pairs(inductor, [path for path in working if path.bits and path.compiled
                                                                and "prefill" in path.results], prefill_rounds)
    floor_bytes = {4: extra["int4_bytes"], 8: extra["int8_bytes"]}
    for context in contexts:
        log(f"decode at context {context}, every path in turn")
        try:
            for path, ms, rounds, x_floor in zip(working, *decode_ms(working, context, steps, floor_bytes)):
                path.results[f"decode_{context}"] = ms
                path.results[f"rounds_{context}"] = rounds
                path.results[f"x_floor_{context}"] = x_floor
        except Exception as error:
            log(f"decode at context {context} failed: {short_error(error)}")
        gc.collect()
    log("peak memory of fresh processes")
    extra["memory"] = peak_memory({"fp32": (fp32, 0), "qbackend int4": (int4, 4)})
    return rows, extra


def paired_speedup(base_rounds: Optional[list], rounds: Optional[list]) -> Optional[float]:
    """The median over rounds of the base path's median step over this path's, in the same round."""
    if not base_rounds or not rounds:
        return None
    return statistics.median(b / r for b, r in zip(base_rounds, rounds))


def report(rows: list, extra: dict, contexts: list, command: str) -> str:
    bandwidth = extra["bandwidth"]
    floor = {4: extra["int4_bytes"] / bandwidth * 1e3, 8: extra["int8_bytes"] / bandwidth * 1e3}
    fp32 = rows[0].results
    lines = [
        f"- Machine: {machine_description()}",
        f"- Date: {datetime.date.today().isoformat()}; command: `{command}`",
        f"- Model: LlamaForCausalLM, {', '.join(f'{k} {v}' for k, v in CONFIG.items())}; random init; prompt {PROMPT}"
        f" tokens; greedy decode, batch 1, {NUM_THREADS} threads.",
        f"- Copy bandwidth (512 MB, read + write): {bandwidth / 1e9:.1f} GB/s. Floor of a decode step = the weight bytes"
        f" it reads / that bandwidth: int4 g{GROUP} {extra['int4_bytes'] / 1e6:.0f} MB -> {floor[4]:.2f} ms,"
        f" int8 {extra['int8_bytes'] / 1e6:.0f} MB -> {floor[8]:.2f} ms. Measured again ({ROUND_COPY_MB} MB, best of"
        f" {ROUND_COPY_REPEATS}) at the start of each round of decode turns: median"
        f" {statistics.median(ROUND_BANDWIDTHS) / 1e9:.1f} GB/s, {min(ROUND_BANDWIDTHS) / 1e9:.1f}-"
        f"{max(ROUND_BANDWIDTHS) / 1e9:.1f}; `x floor` pairs each round's steps with that round's floor (median over"
        " rounds of the round's median step over its floor).",
        "- Decode: median ms per token over the steps after a KV cache of that many positions, the paths taking"
        f" turns (each round starting one path later), each timing {DECODE_BLOCK} consecutive steps after {DECODE_WARMUP} untimed ones (a decode loop's steady"
        " state: a step right after another path's is up to 1.2x slower); `x floor`"
        " for the quantized paths; speedups against fp32 / bf16 eager at context 32, paired: the median over rounds of the"
        " eager path's median step over this path's in the same round (the host's speed drifts between rounds)."
        " Prefill: best of the calls, 512 tokens."
        " `static cache`: transformers' StaticCache instead, of the context plus every position the turns add (its"
        " mask covers them all; qbackend's attention skips the unfilled ones).",
        f"- Two-thread speedup (one thread's time over two threads' for a small add; ~1.4 when the host runs"
        f" the two vCPUs side by side, ~1.0 when it runs them as one), probed before each round of decode turns and"
        f" each prefill call, waiting up to 60 s for 1.2: median {statistics.median(PROBES):.2f}, lowest {min(PROBES):.2f}.",
        "- First calls: the prompt and two decode steps from cold (compile included); `graphs`: graphs Dynamo"
        " compiled for them; `recompiles`: graphs compiled over the next 8 steps.",
        "- cos: the minimum over the prompt's logits and 32 decoded steps (every path fed the fp32 model's tokens),"
        " against fp32 and against the same model with its quantized weights dequantized into fp32.",
        "",
    ]
    header = ["path", *(f"decode ctx {c} ms" for c in contexts), "x floor (ctx 32 / ctx 2048)", "vs fp32 / bf16 eager",
              f"prefill {PREFILL} ms", "first calls s (graphs, recompiles)", "cos vs fp32", "cos vs dequantized"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for path in rows:
        r = path.results
        if "error" in r:
            lines.append(f"| {path.name} | {r['error'].replace('|', '/')} |" + " |" * (len(header) - 2))
            continue
        x_floor = " / ".join(fmt(r.get(f"x_floor_{c}"), ".2f") for c in (32, 2048) if c in contexts) if path.bits else "–"
        speed = " / ".join(fmt(paired_speedup(base.get("rounds_32"), r.get("rounds_32")), ".1f") for base in (fp32, rows[1].results))
        first = f"{r['first_s']:.1f} ({r['graphs']}, {r['recompiles']})" if "first_s" in r else "–"
        lines.append("| " + " | ".join([path.name, *(fmt(r.get(f"decode_{c}"), ".2f") for c in contexts), x_floor, speed,
                                         fmt(r.get("prefill"), ".0f"), first, fmt(r.get("cos_fp32"), ".5f"),
                                         fmt(r.get("cos_dequantized"), ".5f")]) + " |")
    static = [f"{path.name} {path.results['cos_static']:.5f}" for path in rows if "cos_static" in path.results]
    if static:
        lines += ["", "With a static cache (`StaticCache`, the same tokens fed), logits cosine against the same path's"
                  f" dynamic cache, minimum over the prompt and {ACCURACY_STEPS} steps: {', '.join(static)}."]
    pairs = extra.get("prefill_vs_inductor")
    if pairs:
        names = list(next(iter(pairs.values())))
        lines += ["", "Prefill against Inductor bf16 (the last token's logits, as `generate()` asks), the paths' calls"
                  " interleaved, each timed right after an untimed one of its own: the median over rounds of this path's"
                  " time over Inductor's in the same round.", "",
                  "| prompt tokens | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        lines += [f"| {length} | " + " | ".join(f"{ratios[name]:.3f}x" for name in names) + " |" for length, ratios in pairs.items()]
    memory = extra["memory"]
    lines += ["", "Peak RSS of a fresh process that loads the checkpoint (int4: into a model built on the meta device) and"
              " decodes 4 tokens, above its RSS before the load:", ""]
    for name, peak in memory.items():
        ratio = f" ({peak / memory['fp32']:.2f}x fp32's)" if isinstance(peak, int) and isinstance(memory.get("fp32"), int) else ""
        lines.append(f"- {name}: {peak / 1e6:.0f} MB{ratio}" if isinstance(peak, int) else f"- {name}: {peak}")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", nargs="+", type=int, default=[32, 512, 2048])
    parser.add_argument("--quick", action="store_true", help="fewer decode steps and prefill calls")
    parser.add_argument("--docs", type=Path, default=PROJECT_ROOT / "docs")
    parser.add_argument("--memory-child", nargs=2, metavar=("CHECKPOINT", "BITS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(NUM_THREADS)
    if args.memory_child:
        return memory_child(args.memory_child[0], int(args.memory_child[1]))
    # (24 steps, 4 rounds, had each path's median move by up to ~10% between runs on this noisy host)
    rows, extra = run(args.contexts, steps=8 if args.quick else 60, prefill_calls=1 if args.quick else 5,
                      prefill_rounds=1 if args.quick else 6)
    command = "python benchmarks/bench_llm.py " + " ".join(sys.argv[1:])
    body = report(rows, extra, args.contexts, command.strip())
    write_section(args.docs / "benchmarks_llm.md", "LLM decode on CPU: Llama-architecture, weight-only int4 / int8", cpu_key(), body)
    print(body)


if __name__ == "__main__":
    main()
