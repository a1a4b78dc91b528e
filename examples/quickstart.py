import torch, qbackend

model = torch.nn.Sequential(                                    # your model: any nn.Module
    torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
    torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10)).eval()
x = torch.randn(1, 3, 64, 64)
calibration = [(torch.randn(1, 3, 64, 64),) for _ in range(8)]  # a few batches of real inputs
m = qbackend.quantize_x86(model, (x,), calibration)             # PT2E int8 (torchao) in one call
fast = torch.compile(m, backend="qbackend")                     # or qbackend.compile(m)
with torch.no_grad():
    print(qbackend.explain(m, x))                               # what runs int8, and why the rest does not
    print(torch.cosine_similarity(fast(x).flatten(), model(x).flatten(), dim=0))  # vs the float model
