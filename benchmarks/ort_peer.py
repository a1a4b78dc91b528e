"""ONNX Runtime int8 as a peer for the CNNs: the fp32 model exported to ONNX, quantized
statically in QDQ form (uint8 activations, int8 per-channel weights, the same calibration
batches PT2E sees), run by ORT's CPU execution provider. Benchmark-only: needs the `bench`
extra (`pip install -e ".[bench]"`)."""

import contextlib
import os
import tempfile

import torch


def int8_session(model, inputs, calibration, threads: int, reduce_range: bool = False):
    """A callable taking the model's torch inputs and returning a torch tensor. ``reduce_range``:
    ORT's own advice for CPUs without VNNI (7-bit weights; its kernels saturate too)."""
    import onnxruntime as ort
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    names = [f"input_{i}" for i in range(len(inputs))]

    class Batches(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{n: t.numpy() for n, t in zip(names, batch)} for batch in calibration])

        def get_next(self):
            return next(self.batches, None)

    with tempfile.TemporaryDirectory(prefix="ort_peer_") as folder:
        fp32, prepared, int8 = (os.path.join(folder, f) for f in ("fp32.onnx", "prepared.onnx", "int8.onnx"))
        # The TorchScript exporter: the CNNs have no control flow, and it needs no onnxscript.
        torch.onnx.export(model, tuple(inputs), fp32, input_names=names, output_names=["output"],
                          opset_version=17, dynamo=False)
        with contextlib.chdir(folder):  # (its symbolic shape inference writes scratch files to the working directory)
            quant_pre_process(fp32, prepared)  # shape inference + graph optimisation, as ORT recommends
        quantize_static(prepared, int8, Batches(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, reduce_range=reduce_range)
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        # ORT's idle threads spin after each run by default: on 2 cores that took the CPU from
        # whichever path the interleaved timing ran next (qbackend ResNet-18 b1: 36 ms right
        # after ORT, 13-15 ms alone); the other paths' thread pools sleep when idle.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(int8, options, providers=["CPUExecutionProvider"])

    def run(*tensors):
        feeds = {n: t.numpy() for n, t in zip(names, tensors)}
        return torch.from_numpy(session.run(None, feeds)[0])

    return run
