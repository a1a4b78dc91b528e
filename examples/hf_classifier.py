"""A Hugging Face text classifier in int8, for any batch size and sequence length.

    pip install "transformers>=4.45,<6"                       # (after torch==2.13.0 and qbackend)
    python examples/hf_classifier.py --model distilbert-base-uncased-finetuned-sst-2-english   # from the hub
    python examples/hf_classifier.py                          # DistilBERT built in code: no download
    python examples/hf_classifier.py --small                  # a 2-layer one, for a quick check

Built in code, the model has random weights and a tokenizer made from this file's sentences
(no download). The calibration batches are tokenized sentences of different lengths; the
export leaves batch and sequence length free, so ``qbackend.compile`` lowers it once for every
shape. It prints the report's first line and, per shape, the logits' cosine against the float
model and how many predictions agree.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import types
from pathlib import Path

import torch

import qbackend

# transformers imports torchvision where it is installed; PyPI's torchvision is built for CUDA
# torch and its C ops fail to register against the CPU wheel. Nothing here needs them.
sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
import transformers  # noqa: E402

SENTENCES = [
    "the film was a delight from start to end", "a slow and tired story", "i would watch it again",
    "the actors seemed lost and the plot made no sense", "great music", "not worth the ticket",
    "a warm funny and clever film that never talks down to its audience", "boring",
    "the best thing i have seen this year", "it starts well but the ending is a mess",
    "beautiful pictures and a moving story", "too long", "the dialogue is sharp and the pace is right",
    "i left before the end", "a small film with a big heart", "loud empty and forgettable",
]


def tokenizer_in_code(directory: Path) -> transformers.PreTrainedTokenizerBase:
    """A WordPiece tokenizer whose vocabulary is this file's words: what from_pretrained gives, offline."""
    words = sorted({word for sentence in SENTENCES for word in sentence.split()})
    (directory / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    return transformers.DistilBertTokenizerFast(vocab_file=str(directory / "vocab.txt"))


def build(args, directory: Path):
    if args.model:
        return (transformers.AutoModelForSequenceClassification.from_pretrained(args.model).eval(),
                transformers.AutoTokenizer.from_pretrained(args.model))
    tokenizer = tokenizer_in_code(directory)
    small = dict(dim=64, hidden_dim=128, n_layers=2, n_heads=2) if args.small else {}
    config = transformers.DistilBertConfig(vocab_size=tokenizer.vocab_size, num_labels=2, **small)
    torch.manual_seed(0)
    return transformers.DistilBertForSequenceClassification(config).eval(), tokenizer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face model name or path (downloads it); default: built in code")
    parser.add_argument("--small", action="store_true", help="2 layers of width 64 (built in code)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as directory:
        model, tokenizer = build(args, Path(directory))
    encode = lambda texts: dict(tokenizer(texts, padding=True, return_tensors="pt"))  # noqa: E731
    calibration = [encode(SENTENCES[start:start + 4]) for start in range(0, len(SENTENCES), 4)]
    batch, sequence = torch.export.Dim("batch", max=1024), torch.export.Dim("sequence", max=512)
    free = {"input_ids": {0: batch, 1: sequence}, "attention_mask": {0: batch, 1: sequence}}
    m = qbackend.quantize_x86(model, calibration[0], calibration, dynamic_shapes=free)
    fast = qbackend.compile(m)  # one lowering for every batch and sequence length

    with torch.no_grad():
        print(qbackend.explain(m, **calibration[0]).summary())
        for texts in (SENTENCES[1:2], SENTENCES[4:7], SENTENCES[7:]):  # (three shapes: one lowering)
            inputs = encode(texts)
            logits, expected = fast(**inputs).logits, model(**inputs).logits
            cosine = torch.cosine_similarity(logits.flatten(), expected.flatten(), dim=0).item()
            agree = (logits.argmax(-1) == expected.argmax(-1)).sum().item()
            print(f"batch {len(texts)}, {inputs['input_ids'].shape[1]} tokens: cosine vs float {cosine:.4f}, "
                  f"{agree} of {len(texts)} predictions agree")


if __name__ == "__main__":
    main()
