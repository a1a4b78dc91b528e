"""ONNX Runtime int8 as a peer for the CNNs: the fp32 model exported to ONNX, quantized
statically in QDQ form (uint8 activations, int8 per-channel weights, the same calibration
batches PT2E sees), run by ORT's CPU execution provider. Benchmark-only: needs the `bench`
extra (`pip install -e ".[bench]"`).

``quantize`` needs torch (the export); ``runner`` on a saved model needs only onnxruntime and
numpy, as a process of an ONNX Runtime user does."""

import contextlib
import os
import tempfile


def quantize(model, inputs, calibration, path, reduce_range: bool = False) -> None:
    """Write the int8 QDQ model to ``path``. ``reduce_range``: ORT's own advice for CPUs
    without VNNI (7-bit weights; its kernels saturate too)."""
    import torch
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    names = input_names(len(inputs))

    class Batches(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{n: t.numpy() for n, t in zip(names, batch)} for batch in calibration])

        def get_next(self):
            return next(self.batches, None)

    with tempfile.TemporaryDirectory(prefix="ort_peer_") as folder:
        fp32, prepared = (os.path.join(folder, f) for f in ("fp32.onnx", "prepared.onnx"))
        # The TorchScript exporter: the CNNs have no control flow, and it needs no onnxscript.
        torch.onnx.export(model, tuple(inputs), fp32, input_names=names, output_names=["output"],
                          opset_version=17, dynamo=False)
        with contextlib.chdir(folder):  # (its symbolic shape inference writes scratch files to the working directory)
            quant_pre_process(fp32, prepared)  # shape inference + graph optimisation, as ORT recommends
        quantize_static(prepared, os.fspath(path), Batches(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, reduce_range=reduce_range)


def input_names(count: int) -> list:
    return [f"input_{i}" for i in range(count)]


def runner(path, threads: int, spinning: bool = True):
    """A callable taking numpy arrays and returning the output as a numpy array. ``spinning``:
    ORT's default, its idle threads spin after each run. Off where other engines share the
    process: on 2 cores the spinning took the CPU from whichever path an interleaved timing ran
    next (qbackend ResNet-18 b1: 36 ms right after ORT, 13-15 ms alone)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(os.fspath(path), options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]

    def run(*arrays):
        return session.run(None, dict(zip(names, arrays)))[0]

    return run


def int8_session(model, inputs, calibration, threads: int, reduce_range: bool = False):
    """A callable taking the model's torch inputs and returning a torch tensor, for a benchmark
    timing it beside torch engines in one process (ORT's spinning off)."""
    import torch

    with tempfile.TemporaryDirectory(prefix="ort_peer_") as folder:
        path = os.path.join(folder, "int8.onnx")
        quantize(model, inputs, calibration, path, reduce_range)
        run = runner(path, threads, spinning=False)
    return lambda *tensors: torch.from_numpy(run(*(t.numpy() for t in tensors)))
