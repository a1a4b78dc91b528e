"""OpenVINO int8 as a peer: the fp32 model converted with ``ov.convert_model``, quantized by
NNCF's post-training ``nncf.quantize`` on the same calibration batches PT2E sees (the
transformer preset for transformers, as NNCF's docs ask), compiled for the CPU plugin with the
LATENCY hint and the same thread count, everything else as OpenVINO defaults it (on CPUs with
AMX or AVX512-BF16 its float remainder runs in bf16). Benchmark-only: `pip install
openvino nncf` (never a test dependency)."""

import collections
import time

import torch


def int8_model(model, inputs, calibration, threads: int, transformer: bool):
    """A callable taking the model's torch inputs and returning a torch tensor; its
    ``openvino_profile(inputs, calls)`` gives OpenVINO's own per-node counters."""
    import nncf
    import openvino as ov

    with torch.no_grad():
        converted = ov.convert_model(model, example_input=tuple(inputs))
    dataset = nncf.Dataset(calibration, lambda batch: tuple(t.numpy() for t in batch))
    quantized = nncf.quantize(converted, dataset, subset_size=len(calibration),
                              model_type=nncf.ModelType.TRANSFORMER if transformer else None)
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads}
    compiled = ov.Core().compile_model(quantized, "CPU", config)
    request = compiled.create_infer_request()
    output = compiled.output(0)

    def run(*tensors):
        return torch.from_numpy(request.infer([t.numpy() for t in tensors])[output].copy())

    def openvino_profile(tensors, calls: int):
        """(wall ms per call, [(node type [kernel], ms per call, nodes)]) from OpenVINO's
        PERF_COUNT, on a copy compiled with the counters on (the timed one runs without)."""
        counted = ov.Core().compile_model(quantized, "CPU", {**config, "PERF_COUNT": True}).create_infer_request()
        arrays = [t.numpy() for t in tensors]
        counted.infer(arrays)
        totals, nodes = collections.defaultdict(float), collections.Counter()
        start = time.perf_counter()
        for _ in range(calls):
            counted.infer(arrays)
            for info in counted.get_profiling_info():
                if info.status == info.Status.EXECUTED:
                    key = f"{info.node_type} [{info.exec_type}]"
                    totals[key] += info.real_time.total_seconds() * 1e3 / calls
                    nodes[key] += 1 / calls
        wall = (time.perf_counter() - start) * 1e3 / calls
        return wall, sorted(((key, ms, nodes[key]) for key, ms in totals.items()), key=lambda op: -op[1])

    run.openvino_profile = openvino_profile
    return run
