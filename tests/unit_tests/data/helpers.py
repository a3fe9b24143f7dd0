"""Small deterministic fixtures for the data tests: documents, JSONL files, a tokenizer.json trained offline."""

import json
import os

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def texts(count: int = 40) -> list[str]:
    """``count`` documents of 200 to 400 bytes, different from each other."""
    return [
        f"doc {i}: " + " ".join(WORDS[(i * 7 + j * j) % len(WORDS)] for j in range(30 + i % 25)) for i in range(count)
    ]


def write_jsonl(path, records) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return str(path)


def train_tokenizer_json(directory, corpus: list[str], vocab_size: int = 300) -> str:
    """A byte-level BPE ``tokenizer.json`` with ``<|endoftext|>``, trained on ``corpus`` (milliseconds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "tokenizer.json")
    tokenizer.save(path)
    return path
