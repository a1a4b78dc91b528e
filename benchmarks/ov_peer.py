"""OpenVINO int8 as a peer: the fp32 model converted with ``ov.convert_model``, quantized by
NNCF's post-training ``nncf.quantize`` on the same calibration batches PT2E sees (the
transformer preset for transformers, as NNCF's docs ask), compiled for the CPU plugin with the
LATENCY hint and the same thread count, everything else as OpenVINO defaults it (on CPUs with
AMX or AVX512-BF16 its float remainder runs in bf16). Benchmark-only: `pip install
openvino nncf` (never a test dependency)."""

import torch


def int8_model(model, inputs, calibration, threads: int, transformer: bool):
    """A callable taking the model's torch inputs and returning a torch tensor."""
    import nncf
    import openvino as ov

    with torch.no_grad():
        converted = ov.convert_model(model, example_input=tuple(inputs))
    dataset = nncf.Dataset(calibration, lambda batch: tuple(t.numpy() for t in batch))
    quantized = nncf.quantize(converted, dataset, subset_size=len(calibration),
                              model_type=nncf.ModelType.TRANSFORMER if transformer else None)
    compiled = ov.Core().compile_model(quantized, "CPU", {"PERFORMANCE_HINT": "LATENCY",
                                                          "INFERENCE_NUM_THREADS": threads})
    request = compiled.create_infer_request()
    output = compiled.output(0)

    def run(*tensors):
        return torch.from_numpy(request.infer([t.numpy() for t in tensors])[output].copy())

    return run
