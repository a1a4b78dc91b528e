"""OpenVINO int8 as a peer: the fp32 model converted with ``ov.convert_model``, quantized by
NNCF's post-training ``nncf.quantize`` on the same calibration batches PT2E sees (its default
preset, or ``nncf.ModelType.TRANSFORMER``, the preset NNCF's docs ask for on transformers),
compiled for the CPU plugin with the LATENCY hint and the same thread count, everything else as
OpenVINO defaults it (on CPUs with AMX or AVX512-BF16 its float remainder runs in bf16).
Benchmark-only: the `bench` extra (never a test dependency).

``quantize`` needs torch (the conversion); ``runner`` on a saved model needs only openvino and
numpy, as a process of an OpenVINO user does."""

import collections
import time


def quantize(model, inputs, calibration, transformer: bool):
    """The int8 ``ov.Model`` NNCF makes of the torch ``model`` (``nncf.quantize`` defaults but
    ``model_type``)."""
    import nncf
    import openvino as ov
    import torch

    with torch.no_grad():
        converted = ov.convert_model(model, example_input=tuple(inputs))
    dataset = nncf.Dataset(calibration, lambda batch: tuple(t.numpy() for t in batch))
    return nncf.quantize(converted, dataset, subset_size=len(calibration),
                         model_type=nncf.ModelType.TRANSFORMER if transformer else None)


def save(model, path) -> None:
    """As NNCF made it: ``ov.save_model`` would otherwise store the float constants in fp16."""
    import openvino as ov

    ov.save_model(model, str(path), compress_to_fp16=False)


def runner(model, threads: int, precision=None):
    """A callable taking numpy arrays and returning the first output as a numpy array;
    ``model``: an ``ov.Model`` or the path of a saved one; ``precision``: the float remainder's
    (``INFERENCE_PRECISION_HINT``, e.g. "f32"), else OpenVINO's default for the CPU. Its
    ``precision`` says which ran, its ``openvino_profile(arrays, calls)`` gives OpenVINO's own
    per-node counters."""
    import openvino as ov

    core = ov.Core()
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads,
              **({"INFERENCE_PRECISION_HINT": precision} if precision else {})}
    compiled = core.compile_model(model, "CPU", config)
    request = compiled.create_infer_request()
    output = compiled.output(0)

    def run(*arrays):
        return request.infer(list(arrays))[output].copy()

    def openvino_profile(arrays, calls: int):
        """(wall ms per call, [(node type [kernel], ms per call, nodes)]) from OpenVINO's
        PERF_COUNT, on a copy compiled with the counters on (the timed one runs without)."""
        counted = core.compile_model(model, "CPU", {**config, "PERF_COUNT": True}).create_infer_request()
        counted.infer(list(arrays))
        totals, nodes = collections.defaultdict(float), collections.Counter()
        start = time.perf_counter()
        for _ in range(calls):
            counted.infer(list(arrays))
            for info in counted.get_profiling_info():
                if info.status == info.Status.EXECUTED:
                    key = f"{info.node_type} [{info.exec_type}]"
                    totals[key] += info.real_time.total_seconds() * 1e3 / calls
                    nodes[key] += 1 / calls
        wall = (time.perf_counter() - start) * 1e3 / calls
        return wall, sorted(((key, ms, nodes[key]) for key, ms in totals.items()), key=lambda op: -op[1])

    run.openvino_profile = openvino_profile
    run.precision = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()  # e.g. "bf16"
    return run
