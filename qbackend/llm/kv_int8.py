"""An int8 KV cache for attention: ``options={"kv_cache": "int8"}``.

At long contexts a decode step's attention reads the whole cache (4 layers of a Llama-shaped
model at 2048 positions: 16 MB of float32 keys and values a token, read at ~11 GB/s). With the
option, each KV cache append (``kv_append.append``) also keeps the buffer's rows as int8, one
float32 scale per row of a head (``csrc/kv_int8.c``), and attention reads those: a quarter of
the bytes (``csrc/attention_f32.c`` ``qb_attention_kv_int8``). The float32 cache stays as it
was, exact, for everything else that reads it (transformers' cache object, a crop, another
compiler): the option costs a quarter more cache memory, and its values are attention's on
the dequantized keys and values, not the reference's (the benchmark reports the logits
cosine). A view the int8 rows do not cover (a cache that did not grow by appends) runs
float attention.
"""
from __future__ import annotations

from typing import Optional

from torch.fx import GraphModule

from qbackend.kernels import attention
from qbackend.kernels.kv_int8 import append_int8, attention_kv_int8
from qbackend.kernels import kv_append


KV_CACHES = ("float", "int8")  # the option's values


def kv_cache_int8(gm: GraphModule) -> Optional[str]:
    """Attention whose keys and values are both KV cache appends reads their int8 rows."""
    rewritten = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not attention.attention_f32:
            continue
        keys, values = node.args[1:3]
        if all(getattr(x, "target", None) in (kv_append.append, append_int8) for x in (keys, values)):
            keys.target = values.target = append_int8
            node.target = attention_kv_int8
            rewritten += 1
    return f"{rewritten} attention call(s) read an int8 copy of their KV cache (option kv_cache='int8')" if rewritten else None
